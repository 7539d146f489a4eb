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
This module is the front door (`trainrec.burn` is an alias of it): its names live in one
module per idea, `burn_names` (format and role names, dtypes, ParamIds, the read helpers and
the item tree), `burn_sniff` (telling the files apart), `burnpack`, `burn_namedmpk` (with
NamedMpk.gz) and `burn_bin`, and it re-exports every one of them.
"""

from __future__ import annotations

# every name this module held before its split, from its new home (tests and users import them)
from .burn_bin import (  # noqa: F401
    _Bin,
    _layouts,
    _structure,
    parse_bin,
    read_bin,
    register_template_layout,
)
from .burn_namedmpk import (  # noqa: F401
    _FULL_META,
    _GZ_BYTES,
    _GZ_RATIO,
    BurnNamedMpkRecorder,
    _is_tensor_map,
    _named_parts,
    gunzip,
    parse_namedmpk,
    read_namedmpk,
    read_namedmpk_gz,
)
from .burn_namedmpk import gz_head as gz_head  # imported from here by trainrec itself
from .burn_names import (  # noqa: F401
    _BIN_DTYPES,
    _BOOL_STORES,
    _META_KEYS,
    _NAMES,
    _PLAIN,
    _RANK,
    ALIGNMENT,
    BIN,
    BURNPACK,
    BURNPACK_VERSION,
    HEADER_SIZE,
    MAGIC,
    MAX_DIMS,
    MAX_METADATA,
    MAX_TENSORS,
    MODULE,
    NAMEDMPK,
    NAMEDMPK_GZ,
    OPTIMIZER,
    SCHEDULER,
    _bin_header,
    _bool_style,
    _burn_dtype,
    _check_shape,
    _dtype,
    _from_view,
    _header,
    _precision,
    _read_all,
    _scalar,
    _stored,
    _tensor,
    is_burn_item,
    module_tensors,
    nest,
    new_param_id,
    param_id_text,
    param_id_value,
    split_training_item,
    tensors_in_order,
)
from .burn_names import optimizer_path as optimizer_path  # imported from here by trainrec itself
from .burn_sniff import (  # noqa: F401
    gz_is_burn,
    sniff_bin,
    sniff_burnpack,
    sniff_namedmpk,
    sniff_namedmpk_gz,
)
from .burnpack import (  # noqa: F401
    BurnpackRecorder,
    _flat,
    _kind,
    burnpack_layout,
    parse_burnpack,
    read_burnpack,
    write_burnpack,
)

__all__ = [
    "BURNPACK", "NAMEDMPK", "NAMEDMPK_GZ", "BIN", "MODULE", "OPTIMIZER", "SCHEDULER",
    "BurnpackRecorder", "BurnNamedMpkRecorder", "read_burnpack", "read_namedmpk",
    "read_namedmpk_gz", "read_bin", "param_id_text", "param_id_value", "new_param_id",
    "is_burn_item", "module_tensors", "sniff_burnpack", "sniff_namedmpk", "sniff_bin",
    "sniff_namedmpk_gz", "gz_is_burn", "split_training_item", "register_template_layout",
]
