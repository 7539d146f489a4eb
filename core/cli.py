"""The `trainrec` command line (also `python -m trainrec`).

Exit codes: 0 success, 1 the check failed (corrupt file, records differ, inexact
resume), 2 usage errors, 3 a file could not be read as a record.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .errors import RecorderError
from .items import Item
from .tensor import TensorData

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainrec", description="Exact, portable training checkpoints."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="train with gradient accumulation, kill mid-window, resume, prove it bitwise exact",
        description="Trains a small model with gradient accumulation, checkpoints in the "
        "middle of an accumulation window, kills the training process, resumes from the file "
        "in a new process and compares against an uninterrupted run. Exit 0 only when the "
        "resume is bitwise exact.",
    )
    demo.add_argument("--backend", choices=["auto", "torch", "jax", "numpy"], default="auto")
    demo.add_argument("--steps", type=int, default=24, help="micro-steps in all (default 24)")
    demo.add_argument("--window", type=int, default=4, help="accumulation window (default 4)")
    demo.add_argument("--checkpoint-at", type=int, default=None,
                      help="micro-step to checkpoint after (default: mid-window near the middle)")
    demo.add_argument("--workdir", default=None, help="where to keep files (default: a temp dir)")
    demo.add_argument("--json", action="store_true", help="print the results as JSON")

    ins = sub.add_parser("inspect", help="show a record file's header and tensors",
                         description="Format, version, precision, record kind and a tree of "
                         "components with dtype, shape and bytes. Reads no tensor bytes.")
    ins.add_argument("file")
    ins.add_argument("--json", action="store_true")

    ver = sub.add_parser("verify", help="check every checksum of a record file (exit 1 on corruption)")
    ver.add_argument("file")
    ver.add_argument("--json", action="store_true")

    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(
            backend=args.backend, steps=args.steps, window=args.window,
            checkpoint_at=args.checkpoint_at, workdir=args.workdir, as_json=args.json,
        )
    if args.command == "inspect":
        return _inspect(args.file, args.json)
    if args.command == "verify":
        return _verify(args.file, args.json)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _tree(item: Item) -> Any:
    if isinstance(item, TensorData):
        return {"dtype": item.dtype.value, "shape": list(item.shape), "bytes": item.nbytes}
    if isinstance(item, dict):
        return {k: _tree(v) for k, v in item.items()}
    if isinstance(item, list):
        return [_tree(v) for v in item]
    if isinstance(item, bytes):
        return f"<{len(item)} bytes>"
    return item


def _print_tree(node: Any, indent: str, out: list[str]) -> None:
    entries = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in entries:
        if isinstance(v, dict) and set(v) == {"dtype", "shape", "bytes"}:
            out.append(f"{indent}{k}: {v['dtype']}{v['shape']} {v['bytes']} B")
        elif isinstance(v, (dict, list)) and v:
            out.append(f"{indent}{k}:")
            _print_tree(v, indent + "  ", out)
        else:
            out.append(f"{indent}{k}: {v!r}")


_COMPONENTS = ("model", "optimizer", "scheduler", "grads", "state")


def _inspect(path: str, as_json: bool) -> int:
    from .recorders import read_file

    try:
        header, item = read_file(path, mmap=True)
    except RecorderError as e:
        print(f"trainrec inspect: {e}", file=sys.stderr)
        return 3
    tree = _tree(item)
    if header.record_type == "TrainingRecord" and isinstance(tree, list) and len(tree) == 5:
        tree = dict(zip(_COMPONENTS, tree))
    s = header.settings
    info = {
        "file": path,
        "format": header.format,
        "version": f"{header.version[0]}.{header.version[1]}",
        "written_by": header.trainrec_version,
        "precision": {"name": s.name,
                      "float": None if s.float_dtype is None else s.float_dtype.value,
                      "int": None if s.int_dtype is None else s.int_dtype.value},
        "record": header.record_type,
        "tree": tree,
    }
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    lines = [f"{k}: {v}" for k, v in info.items() if k != "tree"]
    lines.append("tree:")
    if isinstance(tree, (dict, list)):
        _print_tree(tree, "  ", lines)
    else:
        lines.append(f"  {tree!r}")
    print("\n".join(lines))
    return 0


def _verify(path: str, as_json: bool) -> int:
    from .items import iter_tensors
    from .recorders import read_file

    count = total = 0
    try:
        _, item = read_file(path, mmap=True)
        for _, t in iter_tensors(item):
            t.array  # noqa: B018 - reading checks the checksum
            count += 1
            total += t.nbytes
    except RecorderError as e:
        if as_json:
            print(json.dumps({"file": path, "ok": False, "error": str(e)}))
        else:
            print(f"CORRUPT: {e}")
        return 1
    if as_json:
        print(json.dumps({"file": path, "ok": True, "tensors": count, "bytes": total}))
    else:
        print(f"OK: {path}: header, structure and {count} tensor checksums ({total} bytes) verified")
    return 0
