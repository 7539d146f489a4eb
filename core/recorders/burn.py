"""Burn's own record files, read and written with core alone (no Rust, no framework).

Burn (the Rust framework whose `GradientsAccumulator` and `TrainingRecord` trainrec follows)
saves records in four ways (spec/FORMAT.md, "Burn's files", says what each holds):

- **Burnpack** (`.bpk`, Burn >= 0.22): a 10-byte header (`NRUB`, version 1, metadata
  length), CBOR metadata (`trainrec.format.cbor`) describing each tensor's dtype, shape, byte
  range and ParamId, then the tensors, each on a 256-byte boundary;
- **NamedMpk** (`.mpk`, Burn <= 0.21): one msgpack map `{"metadata", "item", "_b"}` with
  the module record under `item`, each parameter `{"id": <ParamId, base32>, "param":
  {"bytes", "shape", "dtype"}}`; **NamedMpk.gz** the same, gzipped;
- **Bin** (`.bin`, Burn <= 0.21): the same record in bincode 2 (`config::standard()`): no
  names, so a template must say the module's structure.

Items (what `trainrec.read_file` returns), every tensor keyed by its module path:

- Burnpack: `{"tensors": {name: tensor}, "param_ids": {name: u64}, "metadata": {str: str},
  "scalars": {name: {"Int"|"UInt"|"Float"|"Bool": value}}, "dtypes": {name: Burn dtype}}`,
  the tensors in the file's data order (Burn's module order); `dtypes` only where the
  Burn dtype is not the plain one of the tensor (`Flex32`, a `Bool` stored as u32);
- NamedMpk, NamedMpk.gz and Bin: `{"metadata": {float, int, format, version, settings},
  "item": <the module record as a tree: structs as maps in field order, Vec as lists,
  constants and None as None, each tensor where its map was>, "param_ids": {module path:
  id text}, "dtypes": {...}}`.

Header: format `burn.burnpack`, `burn.namedmpk`, `burn.namedmpk.gz` or `burn.bin`;
`trainrec_version` is `"burn X.Y.Z"` (Burn's version where the file says it); record type
`burn.Module`, or for a Burnpack `burn.Optimizer` (tensors `"{param_id}.{field}"`,
scalars `"{param_id}.__rank"`) or `burn.Scheduler` (scalars only).

Burn keeps no checksum: a read checks the framing (header, metadata, every declared length,
dtype and byte range against the file) but cannot tell a flipped bit inside a tensor's
bytes; `trainrec verify` says so. Every read is bounded by the file's size (spec/SECURITY.md).
"""

from __future__ import annotations

from .burn_names import (
    BURNPACK as BURNPACK,
    NAMEDMPK as NAMEDMPK,
    NAMEDMPK_GZ as NAMEDMPK_GZ,
    BIN as BIN,
    MODULE as MODULE,
    OPTIMIZER as OPTIMIZER,
    SCHEDULER as SCHEDULER,
    MAGIC as MAGIC,
    BURNPACK_VERSION as BURNPACK_VERSION,
    HEADER_SIZE as HEADER_SIZE,
    ALIGNMENT as ALIGNMENT,
    MAX_METADATA as MAX_METADATA,
    MAX_TENSORS as MAX_TENSORS,
    MAX_DIMS as MAX_DIMS,
    _RANK as _RANK,
    _PLAIN as _PLAIN,
    _NAMES as _NAMES,
    _BIN_DTYPES as _BIN_DTYPES,
    _BOOL_STORES as _BOOL_STORES,
    _dtype as _dtype,
    _burn_dtype as _burn_dtype,
    _bool_style as _bool_style,
    param_id_text as param_id_text,
    param_id_value as param_id_value,
    new_param_id as new_param_id,
    _read_all as _read_all,
    _tensor as _tensor,
    _check_shape as _check_shape,
    _precision as _precision,
    _header as _header,
    _scalar as _scalar,
    _META_KEYS as _META_KEYS,
    _from_view as _from_view,
    split_training_item as split_training_item,
    nest as nest,
    is_burn_item as is_burn_item,
    module_tensors as module_tensors,
    optimizer_path as optimizer_path,
    _bin_header as _bin_header,
    _stored as _stored,
    tensors_in_order as tensors_in_order,
)
from .burn_sniff import (
    sniff_burnpack as sniff_burnpack,
    sniff_namedmpk as sniff_namedmpk,
    sniff_bin as sniff_bin,
    gz_is_burn as gz_is_burn,
    sniff_namedmpk_gz as sniff_namedmpk_gz,
)
from .burnpack import (
    _kind as _kind,
    parse_burnpack as parse_burnpack,
    read_burnpack as read_burnpack,
    _flat as _flat,
    BurnpackRecorder as BurnpackRecorder,
    burnpack_layout as burnpack_layout,
    write_burnpack as write_burnpack,
)
from .burn_namedmpk import (
    _is_tensor_map as _is_tensor_map,
    parse_namedmpk as parse_namedmpk,
    read_namedmpk as read_namedmpk,
    _GZ_BYTES as _GZ_BYTES,
    _GZ_RATIO as _GZ_RATIO,
    gunzip as gunzip,
    gz_head as gz_head,
    read_namedmpk_gz as read_namedmpk_gz,
    BurnNamedMpkRecorder as BurnNamedMpkRecorder,
    _FULL_META as _FULL_META,
    _named_parts as _named_parts,
)
from .burn_bin import (
    _Bin as _Bin,
    _structure as _structure,
    _layouts as _layouts,
    register_template_layout as register_template_layout,
    parse_bin as parse_bin,
    read_bin as read_bin,
)

__all__ = [
    "BURNPACK", "NAMEDMPK", "NAMEDMPK_GZ", "BIN", "MODULE", "OPTIMIZER", "SCHEDULER",
    "BurnpackRecorder", "BurnNamedMpkRecorder", "read_burnpack", "read_namedmpk",
    "read_namedmpk_gz", "read_bin", "param_id_text", "param_id_value", "new_param_id",
    "is_burn_item", "module_tensors", "sniff_burnpack", "sniff_namedmpk", "sniff_bin",
    "sniff_namedmpk_gz", "gz_is_burn", "split_training_item", "register_template_layout",
]
