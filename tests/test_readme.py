"""Every ```python block of README.md runs as written, each as a script in a process of its own.

Blocks that import the same frameworks (the same top-level packages beyond the standard
library and trainrec: two blocks that import torch, say) run in children forked from one
`tests/_zygote.py` that imported those modules once, as `python readme_LINE.py` would run
(sys.argv, sys.path[0], a fresh `__main__`, stdout, stderr and exit code each their own): what
the block imports is then already in `sys.modules`, as it would be after the block's own imports
(trainrec itself is not preloaded: the block imports it). A block runs in a fresh interpreter
when no other block shares its frameworks (a zygote would cost what it saves) or when it
assigns `os.environ` (XLA_FLAGS before JAX starts: read at import, the zygote's would be used).

A block that needs torch, jax, flax, optax, equinox, accelerate, lightning, torchdata or transformers is
skipped when that package is not installed. A block that is not meant to run must say so, and why, in an HTML comment on
the line before its fence: `<!-- readme-test: not run: <the reason> -->`."""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_NOT_RUN = re.compile(r"<!-- readme-test: not run:(.*?)-->[ \t]*\n\Z")
_OPTIONAL = ("torch", "jax", "flax", "optax", "equinox", "orbax", "accelerate", "lightning", "torchdata",
             "transformers", "fsspec")
_IMPORT = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.M)
_DOTTED = re.compile(r"^\s*(?:import|from)\s+([\w.]+)", re.M)
TIMEOUT_S = 300


def _python_blocks() -> list[tuple[int, str, str | None]]:
    """(line of the fence, code, reason it is not run or None) for every python block."""
    text = README.read_text(encoding="utf-8")
    blocks = []
    for m in _FENCE.finditer(text):
        if m.group(1).lower() not in ("python", "py", "python3"):
            continue
        marker = _NOT_RUN.search(text, 0, m.start())
        blocks.append((text.count("\n", 0, m.start()) + 1, m.group(2),
                       marker.group(1).strip() if marker else None))
    return blocks


BLOCKS = _python_blocks()


def _frameworks(code: str) -> frozenset[str]:
    """The top-level packages `code` imports beyond the standard library, numpy (every zygote
    imports it) and trainrec."""
    return frozenset(m for m in _IMPORT.findall(code)
                     if m not in sys.stdlib_module_names and m not in ("numpy", "trainrec"))


def _preload(code: str) -> set[str]:
    """The modules (as imported, dotted) a zygote for `code` imports."""
    return {m for m in _DOTTED.findall(code) if m.split(".")[0] in _frameworks(code)}


def _forkable(code: str) -> bool:
    return "os.environ" not in code and bool(_frameworks(code))


_SHARED = Counter(_frameworks(code) for _, code, reason in BLOCKS if reason is None and _forkable(code))
_GROUPS = {key for key, n in _SHARED.items() if n >= 2}
_PRELOADS = {key: sorted(set().union(*(_preload(code) for _, code, reason in BLOCKS
                                        if reason is None and _forkable(code) and _frameworks(code) == key)))
             for key in _GROUPS}


@pytest.fixture(scope="module")
def zygotes():
    """One zygote per group of blocks with the same frameworks, started when first needed."""
    from _zygote import Zygote

    started: dict[frozenset[str], Zygote] = {}

    def get(key: frozenset[str]) -> Zygote:
        if key not in started:
            started[key] = Zygote(_PRELOADS[key])
        return started[key]

    yield get
    for z in started.values():
        z.close()


def test_the_readme_has_runnable_examples_and_next_to_no_exceptions():
    assert len(BLOCKS) >= 3, "README.md lost its examples, or this test no longer finds them"
    not_run = [(line, reason) for line, _, reason in BLOCKS if reason is not None]
    assert all(reason for _, reason in not_run), f"a not-run block must say why: {not_run}"
    assert len(not_run) <= 1, f"blocks not run: {not_run}"
    stray = README.read_text(encoding="utf-8").count("readme-test:") - len(not_run)
    assert stray == 0, "a readme-test marker that is not right before a python block"


@pytest.mark.parametrize(("line", "code", "reason"), BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS])
def test_readme_block_runs(line, code, reason, tmp_path, zygotes):
    if reason is not None:
        pytest.skip(f"README.md:{line} is not meant to run: {reason}")
    missing = sorted({m for m in _IMPORT.findall(code) if m in _OPTIONAL and importlib.util.find_spec(m) is None})
    if missing:
        pytest.skip(f"README.md:{line} needs {', '.join(missing)}")
    script = tmp_path / f"readme_{line}.py"
    script.write_text(code, encoding="utf-8")
    key = _frameworks(code)
    if _forkable(code) and key in _GROUPS:
        [done] = zygotes(key).run([{"argv": [str(script)], "cwd": str(tmp_path), "timeout": TIMEOUT_S}])
        if done.returncode == -signal.SIGALRM:
            pytest.fail(f"README.md:{line}: the block did not finish in {TIMEOUT_S} s")
    else:
        try:
            done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                                  text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"README.md:{line}: the block did not finish in {TIMEOUT_S} s")
    assert done.returncode == 0, (
        f"README.md:{line}: the block exits {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    )


def test_the_jax_loops_bitwise_checks_catch_a_resume_without_its_pending_gradients(tmp_path):
    """The README's JAX loops (linen, nnx, equinox) end by asserting that the resumed run is
    bitwise the uninterrupted one: those assertions fail when the resume drops the pending
    gradients of the window, so they can fail. One interpreter runs the three."""
    for module in ("jax", "flax", "optax", "equinox"):
        pytest.importorskip(module)
    loops = [(line, code) for line, code, reason in BLOCKS
             if reason is None and "import jax" in code and "restored.accumulator" in code]
    assert len(loops) >= 3, f"expected the linen, nnx and equinox loops, found blocks at {[ln for ln, _ in loops]}"
    mutated = [(line, code.replace("restored.accumulator", "GradientsAccumulator()")) for line, code in loops]
    driver = tmp_path / "mutants.py"
    driver.write_text(
        "import sys\n"
        f"blocks = {mutated!r}\n"
        "for line, code in blocks:\n"
        "    try:\n"
        "        exec(compile(code, f'README.md:{line}', 'exec'), {'__name__': '__main__'})\n"
        "    except AssertionError:\n"
        "        continue\n"
        "    sys.exit(f'README.md:{line}: resumed without its pending gradients, yet the check passed')\n",
        encoding="utf-8")
    done = subprocess.run([sys.executable, str(driver)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout[-2000:]}{done.stderr[-4000:]}"
