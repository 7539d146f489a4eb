"""The spec's promises point at tests that exist: a promise whose named test was renamed
or deleted is a promise nothing holds."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def _defined() -> dict[str, set[str]]:
    """Test function names defined in each test module (methods of test classes too)."""
    out: dict[str, set[str]] = {}
    for f in TESTS.rglob("test_*.py"):
        tree = ast.parse(f.read_text())
        out[f.name] = {n.name for n in ast.walk(tree)
                       if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("test_")}
    return out


def _named(text: str) -> list[tuple[str | None, str]]:
    """(module, test) pairs the text names: `mod.py::test_x`, then `::test_y` in the same
    module, or a bare `test_z` (module None)."""
    pairs: list[tuple[str | None, str]] = []
    module: str | None = None
    for m in re.finditer(r"(?<!\w)(test_\w+\.py)?(::)?(test_\w+)(?!\.py)\b", text):
        if m.group(1):
            module = m.group(1)
            pairs.append((module, m.group(3)))
        elif m.group(2):
            pairs.append((module, m.group(3)))
        else:
            pairs.append((None, m.group(3)))
    return pairs


@pytest.mark.parametrize("doc", ["spec/SECURITY.md", "spec/ADAPTERS.md", "spec/FORMAT.md", "spec/PROTOCOLS.md",
                                 "spec/CONVERSION.md"])
def test_every_test_the_spec_names_exists(doc):
    defined = _defined()
    everywhere = set().union(*defined.values())
    suite = (ROOT / "core/conformance/suite.py").read_text()
    missing = []
    for module, name in _named((ROOT / doc).read_text()):
        if module is not None and module in defined:
            found = name in defined[module]
        else:
            found = name in everywhere or f"def {name}(" in suite
        if not found:
            missing.append(f"{module or '?'}::{name}")
    assert not missing, f"{doc} names tests that do not exist: {missing}"


def test_the_checker_catches_a_missing_name():
    assert ("test_format.py", "test_nope") in _named("`test_format.py::test_nope`, ok")
    assert (None, "test_other") in _named("see `test_other`")
    assert "test_nope" not in _defined()["test_format.py"]
    assert _named("`mgr.latest_step()`") == []  # a word that merely contains test_


# -- spec/ADAPTERS.md's examples run -------------------------------------------------------

GUIDE = ROOT / "spec" / "ADAPTERS.md"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_FILE = re.compile(r"\A# file: (\S+)\n")
GUIDE_FILES = ("mylib_adapter.py", "mylib_testing.py", "test_mylib.py")


def _guide_examples() -> tuple[dict[str, str], list[tuple[int, str]]]:
    """The guide's python blocks: those whose first line is `# file: NAME`, joined by file
    in order (the minimal adapter), and the others, with their line, which run alone."""
    text = GUIDE.read_text(encoding="utf-8")
    files: dict[str, str] = {}
    scripts: list[tuple[int, str]] = []
    for m in _FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        code, line = m.group(2), text.count("\n", 0, m.start()) + 1
        named = _FILE.match(code)
        if named:
            files[named.group(1)] = files.get(named.group(1), "") + code[named.end():] + "\n\n"
        else:
            scripts.append((line, code))
    return files, scripts


FILES, SCRIPTS = _guide_examples()


def test_the_guide_holds_the_minimal_adapter_and_its_examples():
    assert sorted(FILES) == sorted(GUIDE_FILES), "spec/ADAPTERS.md lost a file of its minimal adapter"
    assert len(SCRIPTS) >= 3, "spec/ADAPTERS.md lost its examples, or this test no longer finds them"


@pytest.mark.parametrize("name", GUIDE_FILES)
def test_the_minimal_adapter_imports_trainrec_only_from_the_adapter_kit(name):
    """The guide says to import from `trainrec.adapter_kit`: its own adapter does (its test,
    the suite)."""
    allowed = {"trainrec.adapter_kit", "trainrec.conformance"}
    found = []
    for node in ast.walk(ast.parse(FILES[name])):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "trainrec"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trainrec":
            found.append(node.module or "")
    assert found and set(found) <= allowed, f"{name} imports {found}"


@pytest.mark.parametrize(("line", "code"), SCRIPTS, ids=[f"ADAPTERS.md:{line}" for line, _ in SCRIPTS])
def test_a_guide_example_runs(line, code, tmp_path):
    script = tmp_path / f"adapters_{line}.py"
    script.write_text(code, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"spec/ADAPTERS.md:{line}: the block exits {done.returncode}\n{done.stderr[-3000:]}"


def test_the_guides_minimal_adapter_passes_the_suite_as_written(tmp_path):
    """Done when an adapter written from the guide passes: its four files, as the guide
    has them, under pytest in a fresh interpreter (fresh-process continuation included)."""
    pytest.importorskip("array_api_strict")
    for name, code in FILES.items():
        (tmp_path / name).write_text(code, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "test_mylib.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, f"{done.stdout[-6000:]}{done.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 60 and "failed" not in summary, summary
