"""Item trees to bytes and back: the NamedMpk format (`namedmpk`), the trainrec header and checksum
table other formats carry (`envelope`) and the bounded CBOR codec Burnpack's metadata uses
(`cbor`). It may import `trainrec.errors`, `trainrec.items`, `trainrec.precision` and
`trainrec.storage`; never a recorder, a record or the format registry (a hint about which format a
file is comes in as an argument).

`trainrec.format` (the path spec/FORMAT.md names) is `trainrec.format.namedmpk`'s names."""


from .namedmpk import (
    ALIGNMENT,
    FORMAT_NAME,
    FORMAT_VERSION,
    Ext,
    Header,
    Limits,
    check_limits,
    check_magic,
    decode_msgpack,
    document_size_bound,
    document_size_estimate,
    read_document,
    write_document,
)

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ALIGNMENT",
    "Header",
    "write_document",
    "document_size_bound",
    "document_size_estimate",
    "read_document",
    "Limits",
    "check_limits",
    "check_magic",
    "decode_msgpack",
    "Ext",
]
