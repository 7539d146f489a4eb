"""Issue 30: core's layers hold. `lint-imports` checks the contracts in pyproject.toml
(`[tool.importlinter]`: the layers of core top to bottom, and no import circle among the
modules of one package) on the real tree, and fails on a copy of it with one upward
import planted, naming that import."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the dev extra")

ROOT = Path(__file__).resolve().parents[1]
_LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on the package `trainrec` found first on the path in `tree`, with
    the contracts of `tree/pyproject.toml`."""
    return subprocess.run([sys.executable, "-c", _LINT, "--no-cache", "--config", str(tree / "pyproject.toml")],
                          capture_output=True, text=True, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""},
                          timeout=300)


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "core", tmp_path / "trainrec", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_real_tree_keeps_the_contracts(tmp_path):
    out = _lint(_copy(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_a_planted_upward_import_breaks_the_layers(tmp_path):
    tree = _copy(tmp_path)
    items = tree / "trainrec" / "items" / "tree.py"  # the bottom of the data path
    items.write_text(items.read_text() + textwrap.dedent("""

        def _planted() -> object:
            from ..manager.local import CheckpointManager  # a lazy import counts too

            return CheckpointManager
        """))
    out = _lint(tree)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "core's layers (top to bottom) BROKEN" in out.stdout
    assert "trainrec.items is not allowed to import trainrec.manager" in out.stdout
    assert "trainrec.items.tree -> trainrec.manager.local" in out.stdout


def test_a_planted_circle_inside_a_package_breaks_the_acyclic_contract(tmp_path):
    tree = _copy(tmp_path)
    dtypes = tree / "trainrec" / "items" / "dtypes.py"  # tensor imports dtypes
    dtypes.write_text(dtypes.read_text() + "\n\nfrom . import tensor as _tensor  # noqa: E402\n")
    out = _lint(tree)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "No cycles are allowed in trainrec.items" in out.stdout
