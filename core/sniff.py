"""Which recorder wrote a file, told from its first bytes, so a recorder given another
recorder's file can say which one reads it (and `read_file` can pick it)."""

from __future__ import annotations

__all__ = ["HEAD_BYTES", "kind_of", "reader_of"]

HEAD_BYTES = 64
"""How many leading bytes `kind_of` looks at."""

_READERS = {
    "namedmpk": "a NamedMpk file: NamedMpkFileRecorder (DefaultRecorder, CompactRecorder) reads it",
    "namedmpk.gz": "a gzip NamedMpk file: NamedMpkGzFileRecorder reads it",
    "torch": "a .pt zip file: trainrec.adapters.torch.TorchFileRecorder reads it",
    "flax": "a msgpack map without a NamedMpk header, as flax writes: "
            "trainrec.adapters.jax.FlaxMsgpackFileRecorder reads it",
}


def kind_of(head: bytes) -> str | None:
    """"namedmpk", "namedmpk.gz", "torch" (a zip, as `torch.save` writes), "flax" (a
    msgpack map that is not NamedMpk: ours or a plain flax state dict) or None (unknown,
    or a NamedMpk header whose format name is damaged)."""
    head = bytes(head[:HEAD_BYTES])
    if head[:2] == b"\x1f\x8b":
        return "namedmpk.gz"
    if head[:4] == b"PK\x03\x04":
        return "torch"
    if head and (0x80 <= head[0] <= 0x8F or head[0] in (0xDE, 0xDF)):
        if b"trainrec.namedmpk" in head:
            return "namedmpk"
        if b"trainrec.flax" in head:
            return "flax"
        if b"trainrec" in head or b"namedmpk" in head:
            return None  # a NamedMpk header with a damaged format name
        return "flax"
    return None


def reader_of(head: bytes, *, not_: str) -> str:
    """A sentence to append to a wrong-magic error: which recorder (or
    `trainrec.read_file`) reads a file starting with `head`; "" when it is of kind `not_`
    or of no kind trainrec knows."""
    kind = kind_of(head)
    if kind is None or kind == not_:
        return ""
    return f"; this is {_READERS[kind]}, and trainrec.read_file reads any of them"
