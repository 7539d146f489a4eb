"""What every Burn record file shares: the format and role names, Burn's dtypes, ParamIds,
the read helpers each parser uses, and the Burn item tree (module tensors, the optimizer's
path, a training item's parts).
"""

from __future__ import annotations

import base64
import math
import mmap as _mmap
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptRecordError, RecorderError
from ..format.header import Header
from ..items.dtypes import DType
from ..items.tensor import TensorData
from ..items.tree import Item, iter_tensors
from ..precision import Precision, settings_by_name, store_tensor

BURNPACK, NAMEDMPK, NAMEDMPK_GZ, BIN = "burn.burnpack", "burn.namedmpk", "burn.namedmpk.gz", "burn.bin"
MODULE, OPTIMIZER, SCHEDULER = "burn.Module", "burn.Optimizer", "burn.Scheduler"

MAGIC = b"NRUB"  # u32 0x4255524E little-endian
BURNPACK_VERSION = 1
HEADER_SIZE = 10
ALIGNMENT = 256
MAX_METADATA = 100 << 20  # Burn's limits (burn_pack::base)
MAX_TENSORS = 100_000
MAX_DIMS = 32
_RANK = "__rank"

# -- dtypes -------------------------------------------------------------------------------------

_PLAIN = {"F64": DType.F64, "F32": DType.F32, "F16": DType.F16, "BF16": DType.BF16,
          "I64": DType.I64, "I32": DType.I32, "I16": DType.I16, "I8": DType.I8,
          "U64": DType.U64, "U32": DType.U32, "U16": DType.U16, "U8": DType.U8}
_NAMES = {d: n for n, d in _PLAIN.items()}
_BIN_DTYPES = ("F64", "F32", "Flex32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32",
               "U16", "U8", "Bool", "QFloat")
_BOOL_STORES = ("Native", "U8", "U32")


def _dtype(value: Any, key: str, source: str) -> DType:
    """The trainrec dtype of a Burn dtype as serde writes it (`"F32"`, `"Bool"`,
    `{"Bool": "Native"}`); `Flex32` is f32 bytes, a bool stored as u32 a u32 tensor."""
    if isinstance(value, str):
        if value in _PLAIN:
            return _PLAIN[value]
        if value == "Flex32":
            return DType.F32
        if value == "Bool":
            return DType.BOOL
    if isinstance(value, dict) and len(value) == 1:
        (tag, inner), = value.items()
        if tag == "Bool" and inner in ("Native", "U8"):
            return DType.BOOL
        if tag == "Bool" and inner == "U32":
            return DType.U32
        if tag == "QFloat":
            raise CorruptRecordError("a quantized (QFloat) tensor: trainrec does not read Burn's "
                                     "quantized layouts", source=source, key=key)
    raise CorruptRecordError(f"unknown Burn dtype {value!r:.80}", source=source, key=key)


def _burn_dtype(d: DType, bool_style: Any) -> Any:
    return bool_style if d is DType.BOOL else _NAMES[d]


def _bool_style(version: str) -> Any:
    """How Burn of `version` names a bool dtype: a unit variant before 0.21, then
    `Bool(BoolStore)`."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m.group(1)), int(m.group(2))) < (0, 21):
        return "Bool"
    return {"Bool": "Native"}


# -- ParamIds -------------------------------------------------------------------------------------


def param_id_text(value: int) -> str:
    """A ParamId as Burn <= 0.21 writes it: BASE32_DNSSEC of its 8 little-endian bytes."""
    return base64.b32hexencode(int(value).to_bytes(8, "little")).decode("ascii").rstrip("=").lower()


def param_id_value(text: str) -> int | None:
    """The u64 of a ParamId written as base32 (as Burn's `ParamId::deserialize` reads it:
    up to 8 bytes, little-endian, zero-padded); None for anything else (Burn's legacy UUID
    ids, which it hashes with ahash)."""
    if not isinstance(text, str) or not re.fullmatch(r"[0-9a-v]{2,13}", text):
        return None
    try:
        raw = base64.b32hexdecode(text.upper() + "=" * (-len(text) % 8))
    except (ValueError, TypeError):
        return None
    if len(raw) > 8 or base64.b32hexencode(raw).decode().rstrip("=").lower() != text:
        return None
    return int.from_bytes(raw.ljust(8, b"\0"), "little")


def new_param_id() -> int:
    """A ParamId made as Burn makes one: 64 random bits."""
    return secrets.randbits(64)


# -- reading helpers ------------------------------------------------------------------------------


def _read_all(path: Path, source: str, mmap: bool) -> Any:
    """The file's bytes: mapped (`mmap`), else read into a buffer of its own."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CorruptRecordError("empty file", source=source)
        if mmap:
            return _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_READ)
        try:
            buf = np.empty(size, np.uint8)
        except MemoryError:
            raise RecorderError(f"a file of {size} bytes does not fit in memory (read it with "
                                "mmap=True)", source=source) from None
        view, got = buf.data, 0
        while got < size and (n := f.readinto(view[got:])):
            got += n
        if got != size or f.read(1):
            raise CorruptRecordError("file changed size while reading", source=source)
        return buf


def _tensor(buf: Any, offset: int, dtype: DType, shape: tuple[int, ...]) -> TensorData:
    count = math.prod(shape)
    arr = np.frombuffer(buf, dtype=dtype.numpy, count=count, offset=offset).reshape(shape)
    if not arr.flags.aligned:
        arr = arr.copy()  # msgpack and bincode do not align: a view would be unaligned
    return TensorData.from_array(arr, copy=False)


def _check_shape(shape: Any, key: str, source: str) -> tuple[int, ...]:
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape)):
        raise CorruptRecordError(f"shape {shape!r:.80} is not a list of at most {MAX_DIMS} sizes",
                                 source=source, key=key)
    if math.prod(max(d, 1) for d in shape) >= 2**62:
        raise CorruptRecordError(f"shape {shape} is larger than any tensor can be", source=source, key=key)
    return tuple(shape)


def _precision(float_name: Any, int_name: Any, settings: Any) -> Precision:
    """Burn's precision settings (its metadata names the element types as Rust does) as
    trainrec's: Full, Half or Double where they are one of those."""
    floats = {"f64": DType.F64, "f32": DType.F32, "half::binary16::f16": DType.F16,
              "half::bfloat::bf16": DType.BF16, "half::binary16::bf16": DType.BF16}
    ints = {"i64": DType.I64, "i32": DType.I32, "i16": DType.I16, "i8": DType.I8}
    f, i = floats.get(float_name), ints.get(int_name)
    for name in ("full", "half", "double"):
        p = settings_by_name(name, None if f is None else f.value, None if i is None else i.value)
        if type(p) is not Precision:  # a built-in one
            return p
    return Precision(str(settings or "burn"), f, i)


def _header(fmt: str, version: tuple[int, int], burn_version: str, settings: Precision,
            record_type: str) -> Header:
    return Header(fmt, version, f"burn {burn_version}" if burn_version else "burn (version not recorded)",
                  settings, record_type)


# -- Burnpack -------------------------------------------------------------------------------------


def _scalar(value: Any, key: str, source: str) -> dict[str, Any]:
    ok = isinstance(value, dict) and len(value) == 1
    if ok:
        (tag, v), = value.items()
        ok = ((tag == "Int" and isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63)
              or (tag == "UInt" and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64)
              or (tag == "Float" and isinstance(v, (int, float)) and not isinstance(v, bool))
              or (tag == "Bool" and isinstance(v, bool)))
    if not ok:
        raise CorruptRecordError(f"a scalar is {{Int|UInt|Float|Bool: value}}, got {value!r:.80}",
                                 source=source, key=key)
    return dict(value)


# -- NamedMpk -------------------------------------------------------------------------------------

_META_KEYS = ("float", "int", "format", "version", "settings")


def _from_view(buf: Any, view: memoryview, dtype: DType, shape: tuple[int, ...], key: str,
               source: str) -> TensorData:
    need = math.prod(shape) * dtype.itemsize
    if view.nbytes != need:
        raise CorruptRecordError(f"{dtype.value} tensor of shape {list(shape)} needs {need} bytes, "
                                 f"{view.nbytes} are stored", source=source, key=key)
    arr = np.frombuffer(view, dtype=dtype.numpy, count=math.prod(shape)).reshape(shape)
    if not arr.flags.aligned:
        arr = arr.copy()
    return TensorData.from_array(arr, copy=False)


def split_training_item(item: list[Item], source: str) -> tuple[Item, Item | None]:
    """The Burn module item of a TrainingRecord's item and its optimizer item (None where
    the optimizer holds no state): what a Burn recorder writes of it."""
    if len(item) != 5:
        raise CorruptRecordError("a TrainingRecord item is a list of 5", source=source)
    model, optimizer = item[0], item[1]
    if not (isinstance(model, dict) and isinstance(model.get("kind"), str)
            and str(model["kind"]).startswith("burn")):
        kind = model.get("kind") if isinstance(model, dict) else None
        raise CorruptRecordError(f"a Burn file holds a Burn module record, this TrainingRecord's model "
                                 f"is a {kind!r}: convert it first (trainrec convert --to burn)", source=source)
    rest = [i for i, part in enumerate(item[2:4], 2) if part not in (None, {})]
    if rest:
        raise CorruptRecordError("a Burn file holds no scheduler or pending gradients; this record has "
                                 f"{' and '.join({2: 'a scheduler', 3: 'pending gradients'}[i] for i in rest)}",
                                 source=source)
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    held = isinstance(state, dict) and (state.get("tensors") or state.get("scalars"))
    return model["state"], ({k: v for k, v in state.items() if k != "config"} if held and isinstance(state, dict)
                            else None)


def nest(flat: dict[str, Any]) -> Item:
    """Dotted names as a tree: `{"a.0.w": x}` -> `{"a": [{"w": x}]}` (a map whose keys are
    0..n-1 becomes a list), in the order of `flat`."""
    root: dict[str, Any] = {}
    for name, value in flat.items():
        parts = name.split(".")
        node = root
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise CorruptRecordError(f"the names {name!r} and {part!r} collide")
            node = nxt
        if parts[-1] in node:
            raise CorruptRecordError(f"the names collide at {name!r}")
        node[parts[-1]] = value

    def lists(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: lists(v) for k, v in node.items()}
            if out and set(out) == {str(i) for i in range(len(out))}:
                return [out[str(i)] for i in range(len(out))]
            return out
        return node

    return lists(root)  # type: ignore[no-any-return]


# -- items ----------------------------------------------------------------------------------------


def is_burn_item(item: Any) -> bool:
    """Whether `item` is laid out as a Burn record of this module (Burnpack or NamedMpk)."""
    return isinstance(item, dict) and (
        (isinstance(item.get("tensors"), dict) and "param_ids" in item)
        or ("item" in item and isinstance(item.get("metadata"), dict) and "param_ids" in item))


def module_tensors(item: Item) -> dict[str, TensorData]:
    """The tensors of a Burn item by module path (`fc1.weight`), in record order."""
    if not isinstance(item, dict):
        raise TypeError(f"a Burn record item is a map, got {type(item).__name__}")
    if isinstance(item.get("tensors"), dict):
        return {k: v for k, v in item["tensors"].items() if isinstance(v, TensorData)}  # type: ignore[union-attr]
    return dict(iter_tensors(item.get("item")))


def optimizer_path(path: str | os.PathLike[str]) -> Path | str:
    """Where `BurnpackRecorder` puts a TrainingRecord's optimizer: `x.bpk` -> `x.optim.bpk`
    (a store URL's: the URL of that name beside it, a str)."""
    from ..storage.location import is_url

    url = is_url(path)
    folder, _, leaf = str(path).rpartition("/") if url else ("", "", Path(path).name)
    name = leaf[: -len(".bpk")] if leaf.lower().endswith(".bpk") else leaf
    if url:
        return f"{folder}/{name}.optim.bpk"
    return Path(path).with_name(f"{name}.optim.bpk")


def _bin_header(n: int) -> bytes:
    if n < 256:
        return b"\xc4" + bytes([n])
    if n < 65536:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _stored(t: TensorData, settings: Any, key: str, allow_lossy: bool, recorder: str) -> TensorData:
    return store_tensor(t, settings, key=key, allow_lossy=allow_lossy, recorder=recorder)


def tensors_in_order(item: Item) -> Iterator[tuple[str, TensorData]]:
    """The tensors of a Burn item by module path, in record order."""
    return iter(module_tensors(item).items())
