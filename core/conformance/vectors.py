"""The spec test vectors: golden files in every recorder format with their expected
contents in JSON (`spec/vectors/`, installed as `trainrec.conformance.golden`).

    python -m trainrec.conformance.vectors write spec/vectors   # regenerate
    python -m trainrec.conformance.vectors check                # verify

A vector is checked two ways: loading it gives exactly the JSON's contents (dtypes,
shapes, bytes, scalars), and saving what was loaded again, with the trainrec version
recorded in the file, gives the same bytes. The check never rebuilds a vector, and the
builders use fixed values only (no training, no BLAS), so neither depends on the CPU.
A change to the bytes written must bump the format version.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.resources
import importlib.util
import json
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import Item, map_tensors, map_tree
from ..precision import (
    DoublePrecisionSettings,
    FullPrecisionSettings,
    HalfPrecisionSettings,
    NativePrecisionSettings,
)
from ..recorders.formats import format_named
from ..recorders.namedmpk import NamedMpkFileRecorder, NamedMpkGzFileRecorder
from ..training.protocols import Recorder
from ..workload.loop import load_workload, train_until

__all__ = ["describe", "check_vectors", "write_vectors", "vector_dir"]

_SETTINGS = {s.name: s for s in (FullPrecisionSettings(), HalfPrecisionSettings(),
                                  DoublePrecisionSettings(), NativePrecisionSettings())}


def _t(values: Any, dtype: DType) -> TensorData:
    return TensorData.from_array(np.asarray(values).astype(dtype.numpy))


def _every_dtype() -> Item:
    item: dict[str, Item] = {}
    for d in DType:
        vals = np.arange(6).reshape(2, 3) % 5
        item[d.value] = _t(vals % 2 == 1 if d is DType.BOOL else (vals / 4 if d.is_float else vals), d)
    item["zero_d"] = _t(2.5, DType.F32)
    item["empty"] = _t(np.zeros((0, 3)), DType.F32)
    item["specials"] = _t([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40], DType.F32)
    return item


def _precision_item() -> Item:
    return {"f64": _t([0.5, 1.25, -3.0], DType.F64), "f32": _t([[1.5, 2.0]], DType.F32),
            "bf16": _t([1.0, -2.0], DType.BF16), "i64": _t([1, -7, 300], DType.I64),
            "u8": _t([0, 255], DType.U8), "bool": _t([True, False], DType.BOOL),
            "scalars": {"int": 7, "float": 0.1, "str": "s"}}


def _nested() -> Item:
    return {"a": [1, -2, 2**63, 2.5, None, True, False, "text", b"\x00\xff"],
            "b": {"c": {"d": [_t([1, 2, 3], DType.I32), {"e": _t([[0.5]], DType.F16)}]}},
            "unicode": "ünïcødé ✓", "empty": {"list": [], "map": {}}}


def _training_record() -> Item:
    """A whole `TrainingRecord` item of the numpy reference adapter (model, AdamW state,
    scheduler, two pending gradients, caller state with RNG records) whose float values
    are fixed: the structure comes from training, every float from an integer grid, since
    BLAS kernels round differently from CPU to CPU."""
    h = load_workload("numpy")
    random.seed(0)
    np.random.seed(0)
    parts = h.build(0)
    train_until(h, parts, 6, 4)  # one window of 4 applied, 2 gradients pending
    h.before_capture(parts)
    from ..training.record import TrainingRecord

    rec = TrainingRecord.capture(parts.model, parts.optimizer, parts.scheduler,
                                 parts.accumulator, parts.state)
    item = rec.into_item(NativePrecisionSettings())
    assert isinstance(item, list) and isinstance(item[4], dict)
    grid = np.random.Generator(np.random.PCG64(7))

    def fixed(_: str, t: TensorData) -> TensorData:
        if not t.dtype.is_float:
            return t
        return _t(grid.integers(-(2**10), 2**10, t.shape) * 2.0**-12, t.dtype)

    fixed_item = map_tensors(item, fixed)
    assert isinstance(fixed_item, list) and isinstance(fixed_item[4], dict)
    fixed_item[4]["losses"] = [0.5 + i / 16 for i in range(6)]  # measured losses come from BLAS too
    return fixed_item


def _recorder(kind: str, settings: str) -> Recorder:
    s = _SETTINGS[settings]
    if kind == "mpk":
        return NamedMpkFileRecorder(s)
    if kind == "gz":
        return NamedMpkGzFileRecorder(s)
    fmt = format_named({"torch": "trainrec.torch", "flax": "trainrec.flax"}[kind])
    assert fmt is not None  # built in
    return fmt.new_recorder(s)


# name -> (recorder kind, settings name, builder of the item, record type, needs)
VECTORS: dict[str, tuple[str, str, Callable[[], Item], str, str]] = {
    "every-dtype.mpk": ("mpk", "native", _every_dtype, "Item", ""),
    **{f"precision-{n}.mpk": ("mpk", n, _precision_item, "Item", "") for n in _SETTINGS},
    "nested.mpk": ("mpk", "full", _nested, "Item", ""),
    "nested.mpk.gz": ("gz", "full", _nested, "Item", ""),
    "training-record.mpk": ("mpk", "native", _training_record, "TrainingRecord", ""),
    "nested.pt": ("torch", "native", _nested, "Item", "torch"),
    "every-dtype.pt": ("torch", "native", _every_dtype, "Item", "torch"),
    "nested.msgpack": ("flax", "native", _nested, "Item", ""),
    "every-dtype.msgpack": ("flax", "native", _every_dtype, "Item", ""),
}


# files an older format version wrote, kept to prove they still load: name -> (recorder
# kind, settings name); only their contents are checked (a writer writes the new version)
LEGACY: dict[str, tuple[str, str]] = {
    "precision-half-1.0.mpk": ("mpk", "half"),  # 1.0: tensors load in their stored dtype
}


def describe(item: Item) -> Any:
    """An item as exact JSON: tensors as dtype, shape and hex bytes; floats by `float.hex`."""

    def one(_: str, node: Any) -> Any:
        if isinstance(node, TensorData):
            return {"tensor": node.dtype.value, "shape": list(node.shape), "hex": node.to_bytes().hex()}
        if isinstance(node, bytes):
            return {"bytes": node.hex()}
        if isinstance(node, float):
            return {"float": node.hex()}
        if isinstance(node, dict):  # a map of what its values became
            return {"map": node}
        return node

    return map_tree(item, one)


def vector_dir() -> Path:
    return Path(str(importlib.resources.files("trainrec.conformance.golden")))


@contextlib.contextmanager
def _pinned_version(version: str) -> Iterator[None]:
    """Write with the trainrec version a vector records, so its bytes can match."""
    names = ["trainrec.format.writer", "trainrec.format.envelope"]
    saved = {n: sys.modules[n].__version__ for n in names if n in sys.modules}
    for n in saved:
        sys.modules[n].__version__ = version  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for n, v in saved.items():
            sys.modules[n].__version__ = v  # type: ignore[attr-defined]


def write_vectors(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, dict[str, Any]] = {}
    for name, (kind, settings, build, record, needs) in VECTORS.items():
        if needs and importlib.util.find_spec(needs) is None:
            print(f"skipped {name}: needs {needs}")
            continue
        path = directory / name
        _recorder(kind, settings).save_item(build(), path, record)
        header, item = _recorder(kind, settings).read(path)
        (directory / f"{name}.json").write_text(json.dumps(describe(item), indent=1) + "\n")
        manifest[name] = {"recorder": kind, "settings": settings, "record": header.record_type,
                          "trainrec": header.trainrec_version, "needs": needs}
        print(f"wrote {name}")
    for name, (kind, settings) in LEGACY.items():
        header, item = _recorder(kind, settings).read(directory / name)
        (directory / f"{name}.json").write_text(json.dumps(describe(item), indent=1) + "\n")
        manifest[name] = {"recorder": kind, "settings": settings, "record": header.record_type,
                          "trainrec": header.trainrec_version, "needs": "", "rewrite": False}
        print(f"described {name} (format {header.version[0]}.{header.version[1]})")
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def check_vectors(core_only: bool = False) -> list[str]:
    """Problems found (empty when every vector loads bit-exactly and its loaded contents
    save to the same bytes); vectors whose framework is not installed are left out."""
    directory = vector_dir()
    manifest = json.loads((directory / "manifest.json").read_text())
    problems: list[str] = []
    for name, info in manifest.items():
        needs = info["needs"]
        if needs and (core_only or importlib.util.find_spec(needs) is None):
            continue
        recorder = _recorder(info["recorder"], info["settings"])
        header, item = recorder.read(directory / name)
        expected = json.loads((directory / f"{name}.json").read_text())
        if describe(item) != expected:
            problems.append(f"{name}: loaded contents differ from {name}.json")
        if header.record_type != info["record"]:
            problems.append(f"{name}: record type {header.record_type!r}")
        if not info.get("rewrite", True):
            continue
        with tempfile.TemporaryDirectory() as tmp, _pinned_version(info["trainrec"]):
            again = recorder.save_item(item, Path(tmp) / name, header.record_type).read_bytes()
        if again != (directory / name).read_bytes():
            problems.append(f"{name}: saving its loaded contents again gives different bytes, "
                            "so the writer changed the bytes it writes (that needs a new format "
                            "version and regenerated vectors)")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["write"] and len(args) == 2:
        write_vectors(Path(args[1]))
        return 0
    if args == ["check"]:
        problems = check_vectors()
        print("\n".join(problems) or "all vectors OK")
        return 1 if problems else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
