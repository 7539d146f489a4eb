"""The spec's promises point at tests that exist: a promise whose named test was renamed
or deleted is a promise nothing holds."""

from __future__ import annotations

import ast
import re
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
