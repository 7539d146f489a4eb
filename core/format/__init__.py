"""Item trees to bytes and back: the NamedMpk format (its header `header`, the limits writer and
reader share `limits`, `writer`, the bounds-checked `parser`, the document `reader`, and the
CRC-32 thread pools `checksums`), the trainrec header and checksum
table other formats carry (`envelope`) and the bounded CBOR codec Burnpack's metadata uses
(`cbor`). It may import `trainrec.errors`, `trainrec.items`, `trainrec.precision` and
`trainrec.storage`; never a recorder, a record or the format registry (a hint about which format a
file is comes in as an argument).

`trainrec.format` (the path spec/FORMAT.md names) re-exports the NamedMpk names."""

from . import checksums, envelope, header, limits, parser, reader, writer  # noqa: F401  (submodules)
from .header import FORMAT_NAME, FORMAT_VERSION, Header
from .limits import ALIGNMENT, Limits, check_limits
from .parser import Ext, decode_msgpack
from .reader import check_magic, read_document
from .writer import document_size_bound, document_size_estimate, write_document

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "ALIGNMENT", "Header", "write_document", "document_size_bound", "document_size_estimate", "read_document", "Limits", "check_limits", "check_magic", "decode_msgpack", "Ext"]
