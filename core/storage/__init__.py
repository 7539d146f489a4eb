"""Where bytes live: local paths and fsspec store URLs (`location`), crash-safe file replacement
(`atomic`), opening the files a load reads, regular files only and JSON within bounds (`files`),
one folder of a store with its small-object operations (`store`),
and commit objects that make a checkpoint of several objects visible at once on a store (`commit`).
It knows nothing of formats or records; it may import `trainrec.errors` and `trainrec.items`.

`trainrec.storage` (the path spec/PROTOCOLS.md names) is `trainrec.storage.location`'s names and `Store`."""


from .location import (
    PART_BYTES,
    READ_BYTES,
    Written,
    download,
    expecting,
    is_url,
    location,
    object_size,
    open_input,
    output,
    read_bytes,
    read_into,
    upload,
    uploads,
)
from .store import Store

__all__ = [
    "is_url",
    "location",
    "Store",
    "upload",
    "read_into",
    "read_bytes",
    "object_size",
    "uploads",
    "expecting",
    "open_input",
    "download",
    "output",
    "Written",
    "PART_BYTES",
    "READ_BYTES",
]
