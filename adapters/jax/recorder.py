"""`FlaxMsgpackFileRecorder` lives in core (`trainrec.flaxmsgpack`): flax's msgpack
convention is pure msgpack, written and read without jax or flax. Re-exported here under
its old name."""

from trainrec.flaxmsgpack import MAX_CHUNK_SIZE, FlaxMsgpackFileRecorder, parse

__all__ = ["FlaxMsgpackFileRecorder", "MAX_CHUNK_SIZE", "parse"]
