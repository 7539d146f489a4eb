"""The checkpoints `ExactResume` finds in a Trainer's `output_dir`: exact ones'
names (`exact-checkpoint-{step}-{micro}[-{n}]`) and format, which directories are exact
checkpoints, a free name for the next one, and `checkpoints`, every committed checkpoint
(Trainer's own and exact ones) oldest first.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

FORMAT = "trainrec.transformers"
_NAME = re.compile(r"exact-checkpoint-(\d+)-(\d+)(?:-(\d+))?")
_STEP = re.compile(r"checkpoint-(\d+)")


def checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[tuple[int, int, int], Path]]:
    """Every committed checkpoint in `output_dir`, oldest first, as ((global step,
    micro-step within the window, tie-break), path): Trainer's `checkpoint-N` are (N, 0, -1),
    exact ones (N, k, r). What `train(resume_from_checkpoint=True)` picks the last of."""
    out: list[tuple[tuple[int, int, int], Path]] = []
    root = Path(output_dir)
    for entry in os.listdir(root):
        exact = _NAME.fullmatch(entry)
        step = _STEP.fullmatch(entry)
        if not (root / entry).is_dir():
            continue
        if exact:
            out.append(((int(exact[1]), int(exact[2]), int(exact[3] or 0)), root / entry))
        elif step:
            out.append(((int(step[1]), 0, -1), root / entry))
    return sorted(out)


def _is_exact(path: Path) -> bool:
    """Whether `path` is (or, by its name, claims to be) an exact checkpoint: its manifest
    says so. One whose manifest is damaged is read, and refused with the reason, as one."""
    if _NAME.fullmatch(path.name):
        return True
    try:
        doc = json.loads((path / "manifest.json").read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def _free_name(root: Path, step: int, micro: int) -> str:
    base = f"exact-checkpoint-{step}-{micro}"
    if not os.path.lexists(root / base):
        return base
    n = 1
    while os.path.lexists(root / f"{base}-{n}"):
        n += 1
    return f"{base}-{n}"
