"""`trainrec diff`: two records compared part by part, tensors and scalars named where they
differ.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..errors import RecorderError
from ..items.tensor import TensorData
from ..items.tree import Item
from .shared import _message, _regular_file
from .terminal import printable as _printable


def _diff(a: str, b: str, as_json: bool) -> int:
    import numpy as np

    from ..items.tree import iter_tensors
    from ..recorders.read import read_file

    try:
        _regular_file(a)
        _regular_file(b)
        (ha, ia), (hb, ib) = read_file(a), read_file(b)
    except RecorderError as e:
        print(f"trainrec diff: {_message(e)}", file=sys.stderr)
        return 3
    name = _part_names(ha.record_type, ia) if ha.record_type == hb.record_type else _raw_path
    ta = {name(k): t for k, t in iter_tensors(ia)}
    tb = {name(k): t for k, t in iter_tensors(ib)}
    rows = []
    for key in sorted(set(ta) | set(tb)):
        x, y = ta.get(key), tb.get(key)
        if x is None or y is None:
            rows.append({"key": key, "status": "only in " + ("b" if x is None else "a")})
            continue
        if x.shape != y.shape:
            rows.append({"key": key, "status": f"shape {list(x.shape)} vs {list(y.shape)}"})
            continue
        equal = x.dtype is y.dtype and x.to_bytes() == y.to_bytes()
        row: dict[str, Any] = {"key": key, "status": "equal" if equal else "differs",
                               "dtype": [x.dtype.value, y.dtype.value]}
        if not equal and x.numel and x.dtype.value != "bool" and y.dtype.value != "bool":
            fx, fy = x.array.astype(np.float64), y.array.astype(np.float64)
            diff = np.abs(fx - fy)
            row["max_abs"] = float(np.nanmax(diff))
            row["max_rel"] = float(np.nanmax(diff / np.maximum(np.abs(fx), 1e-30)))
        rows.append(row)
    others = ["record"] if ha.record_type != hb.record_type else []
    same = sum(r["status"] == "equal" for r in rows)
    scalars = _scalar_differences(ia, ib, name)
    result = {"a": a, "b": b, "tensors": len(rows), "bitwise_equal": same,
              "scalars_equal": not scalars, "scalars": scalars,
              "rows": [r for r in rows if r["status"] != "equal"], "headers_differ": others}
    identical = same == len(rows) and not scalars
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for r in result["rows"]:
            extra = (f"  max abs {r['max_abs']:.3g}  max rel {r['max_rel']:.3g}" if "max_abs" in r else "")
            print(_printable(f"{r['key']}: {r['status']}{extra}"))
        for d in scalars:
            print(_printable(f"{d['key']}: {d['a']} in a, {d['b']} in b"))
        print(f"{same} of {len(rows)} tensors bitwise equal; "
              + ("scalars equal" if not scalars else f"{len(scalars)} scalar{'s' * (len(scalars) > 1)} differ"))
    return 0 if identical else 1


# a TrainingRecord item is [model, optimizer, scheduler, pending, state] (spec/FORMAT.md):
# its paths are printed by part name, a component's {kind, state} and a pending
# gradient's {dtype, value} left out
_PARTS = ("model", "optimizer", "scheduler", "pending", "state")


def _raw_path(path: str) -> str:
    return path


def _part_names(record_type: str, item: Item) -> Any:
    """How `diff` names a key path of a record of `record_type`: a TrainingRecord's by its
    parts (`pending.fc1.bias`, `optimizer.state.fc1.bias.exp_avg`), others as they are."""
    if record_type != "TrainingRecord" or not isinstance(item, list) or len(item) != len(_PARTS):
        return _raw_path

    def name(path: str) -> str:
        head, _, rest = path.partition(".")
        if not head.isdigit() or int(head) >= len(_PARTS):
            return path
        part = _PARTS[int(head)]
        if part in ("model", "optimizer", "scheduler"):
            rest = rest[len("state."):] if rest.startswith("state.") else "" if rest == "state" else rest
        elif part == "pending" and rest.endswith(".value"):
            rest = rest[: -len(".value")]
        return f"{part}.{rest}" if rest else part

    return name


def _scalar_differences(a: Item, b: Item, name: Any, prefix: str = "") -> list[dict[str, str]]:
    """Each scalar (every leaf but a tensor) that differs between the two items, and each
    place where their structure does, by key path, with both values as Python writes them
    (a tensor only one side has is a tensor row, not repeated here)."""
    from ..items.tree import join_key, walk_pairs

    out: list[dict[str, str]] = []
    for path, x, y in walk_pairs(a, b, prefix):
        if isinstance(x, TensorData) and isinstance(y, TensorData):
            continue  # the tensor rows
        if isinstance(x, dict) and isinstance(y, dict):  # other keys: compare what both have
            for k in x.keys() | y.keys():
                if k in x and k in y:
                    out.extend(_scalar_differences(x[k], y[k], name, join_key(path, k)))
                elif not _has_tensors(x.get(k, y.get(k))):
                    out.append({"key": name(join_key(path, k)),
                                "a": _short(x[k]) if k in x else "absent", "b": _short(y[k]) if k in y else "absent"})
        elif type(x) is not type(y) or repr(x) != repr(y):
            if not (_has_tensors(x) and _has_tensors(y)):  # lists of tensors of another length: the rows
                out.append({"key": name(path) if path else "(root)", "a": _short(x), "b": _short(y)})
    return sorted(out, key=lambda d: d["key"])


def _has_tensors(item: Any) -> bool:
    from ..items.tree import iter_tensors

    return isinstance(item, TensorData) or (isinstance(item, (dict, list)) and next(iter_tensors(item), None) is not None)


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else (
        f"a map of {len(value)}" if isinstance(value, dict) else f"a list of {len(value)}")
    return text if len(text) <= 80 else text[:77] + "..."
