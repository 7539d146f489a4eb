"""The JAX adapter's record file format (Orbax checkpoint directories), `trainrec check
--recorder orbax` and fork check, declared in trainrec's entry points (`trainrec.formats`,
`trainrec.check_recorders`, `trainrec.fork_prepare`) as any adapter's are. Importing this module imports no JAX:
the reader needs orbax-checkpoint and is imported when a checkpoint is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainrec import Format, RecorderError
from trainrec.adapter_kit import Header, Item, PrecisionSettings

__all__ = ["ORBAX", "fork_prepare", "orbax_recorder"]


def _sniff_orbax(head: bytes) -> bool:
    """The JSON item of `OrbaxRecorder`'s checkpoints starts with its format string."""
    return head.lstrip().startswith(b"{") and b'"trainrec.orbax"' in head


def _read_orbax(path: Path, mmap: bool) -> tuple[Header, Item]:
    try:
        from .orbax_recorder import read_orbax
    except ImportError as e:
        raise RecorderError(f"reading a trainrec.orbax checkpoint needs orbax-checkpoint and "
                            f"JAX ({e}): pip install 'trainrec[orbax]'", source=str(path)) from e
    result: tuple[Header, Item] = read_orbax(path, mmap)
    return result


ORBAX = Format(
    "trainrec.orbax", (".orbax",), _sniff_orbax, _read_orbax,
    "trainrec.adapters.jax.orbax_recorder:OrbaxRecorder",
    "an Orbax checkpoint directory: trainrec.adapters.jax.OrbaxRecorder reads it",
    "the JSON item's checksum (header, structure, scalars, tensor table), Orbax's "
    "array metadata against the table, and every tensor checksum",
    marker="trainrec/metadata")


def orbax_recorder(native: PrecisionSettings) -> Any:
    """`trainrec check --recorder orbax`: one Orbax checkpoint directory for all ranks."""
    from .orbax_recorder import OrbaxRecorder

    return OrbaxRecorder(native)


def fork_prepare() -> str | None:
    """`trainrec.check.zygote`'s fork check for a process that imported JAX: once its
    backends are initialized JAX runs threads of its own, and a fork can deadlock (JAX warns
    so at every fork); before that a fork is safe."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return "JAX's backends are initialized in it (JAX is multithreaded: a fork can deadlock)"
    return None
