"""`FlaxMsgpackFileRecorder` lives in core (`trainrec.FlaxMsgpackFileRecorder`): flax's
msgpack convention is pure msgpack, written and read without jax or flax. Re-exported
here under its old name."""

from trainrec import FlaxMsgpackFileRecorder

__all__ = ["FlaxMsgpackFileRecorder"]
