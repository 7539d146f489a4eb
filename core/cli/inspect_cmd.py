"""`trainrec inspect`: a record file's kind, components and tensor tree, printed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..errors import RecorderError
from ..items.tensor import TensorData
from ..items.tree import Item, map_leaves
from .shared import _message, _regular_file
from .terminal import printable as _printable


def _tree_leaf(path: str, leaf: Any) -> Any:
    if isinstance(leaf, TensorData):
        return {"dtype": leaf.dtype.value, "shape": list(leaf.shape), "bytes": leaf.nbytes}
    if isinstance(leaf, bytes):
        return f"<{len(leaf)} bytes>"
    return leaf


def _tree(item: Item) -> Any:
    return map_leaves(item, _tree_leaf)


def _print_tree(node: Any, indent: str, out: list[str]) -> None:
    entries = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in entries:
        if isinstance(v, dict) and set(v) == {"dtype", "shape", "bytes"}:
            out.append(f"{indent}{_printable(str(k))}: {v['dtype']}{v['shape']} {v['bytes']} B")
        elif isinstance(v, (dict, list)) and v:
            out.append(f"{indent}{_printable(str(k))}:")
            _print_tree(v, indent + "  ", out)
        else:
            out.append(f"{indent}{_printable(str(k))}: {v!r}")


_COMPONENTS = ("model", "optimizer", "scheduler", "grads", "state")


def _inspect(path: str, as_json: bool) -> int:
    from ..recorders.read import read_file

    try:
        _regular_file(path)
        header, item = read_file(path, mmap=True)
    except RecorderError as e:
        print(f"trainrec inspect: {_message(e)}", file=sys.stderr)
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
    print("\n".join(map(_printable, lines)))
    return 0
