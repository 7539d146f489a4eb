"""The import graph of `adapters/` (installed as `trainrec.adapters`) has no cycle.

Every import statement counts, wherever it stands: at the top of a module, inside a
function (a deferred import hides a circle from Python, not from a reader) and under
`TYPE_CHECKING`. An edge goes to the module named: `from .a import b` goes to `a.b`
when `a/b.py` is a module, else to `a`. A package's `__init__` re-exporting its
modules is an edge like any other, so a module that imports its own package's
`__init__` closes a circle.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package's __init__)} of every module under `root`."""
    out: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join([package, *parts])] = (path, is_package)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """{module: the modules of `package` it imports} for the package whose files are
    under `root` (`package` its dotted name, as installed)."""
    modules = _modules(root, package)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in modules else source)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_adapters_import_no_module_in_a_circle():
    graph = import_graph(ROOT / "adapters", "trainrec.adapters")
    # the graph is the real one: edges the adapters are known to have
    assert "trainrec.adapters.jax.bindings" in graph["trainrec.adapters.jax.nnx"]
    assert "trainrec.adapters.jax._arrays" in graph["trainrec.adapters.jax.nnx"]  # `from . import _arrays`
    assert "trainrec.adapters.jax.nnx" in graph["trainrec.adapters.jax.adapter"]  # a deferred import
    assert "trainrec.adapters.torch.dcp_reader" in graph["trainrec.adapters.torch.dcp"]
    circles = cycles(graph)
    assert not circles, "modules of trainrec.adapters that import each other: " + "; ".join(
        " <-> ".join(c) for c in circles)


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "pkg"


def test_a_planted_circle_is_found(tmp_path):
    """Circles closed the ways the JAX adapter's was: a deferred import inside a function,
    `from . import module`, an import under TYPE_CHECKING, and a module importing its
    own package's `__init__`; an acyclic package of the same shape passes."""
    clean = _package(tmp_path / "clean", {
        "__init__.py": "from .b import f\n",
        "a.py": "X = 1\n",
        "b.py": "from . import a\n\ndef f():\n    from .sub.c import g\n    return g()\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import X\n\ndef g():\n    return X\n",
    })
    assert cycles(import_graph(clean, "pkg")) == []

    deferred = _package(tmp_path / "deferred", {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from .a import g\n    return g\n",
    })
    assert cycles(import_graph(deferred, "pkg")) == [["pkg.a", "pkg.b"]]

    module_import = _package(tmp_path / "module_import", {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "sub/__init__.py": "",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import c\n",
        "sub/c.py": "from .. import a\n",
    })
    assert cycles(import_graph(module_import, "pkg")) == [["pkg.a", "pkg.b", "pkg.sub.c"]]

    own_package = _package(tmp_path / "own_package", {
        "__init__.py": "from .a import A\n",
        "a.py": "import pkg\nA = 1\n",
    })
    assert cycles(import_graph(own_package, "pkg")) == [["pkg", "pkg.a"]]
