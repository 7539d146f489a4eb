"""Tensors captured across processes (`ShardedTensor`) in an Orbax checkpoint: the global
`jax.Array` rebuilt from this process's shards for Orbax to write, the CRC-32 of every
distinct shard gathered from all processes (`shards`), the layouts a load reads into, and
each shard read checked against its CRC, all processes failing together.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from trainrec import ChecksumError, CorruptRecordError, RecorderError, TensorData
from trainrec.adapter_kit import (
    DType,
    Item,
    ShardedTensor,
    ShardIndex,
    crc32,
    iter_tensors,
    verify_checksums,
)

from .orbax_json import _Row

Sharding = Any  # a jax.sharding.Sharding
ShardingRule = Callable[[str, tuple[int, ...]], Any]


def _index_text(index: ShardIndex) -> str:
    """A shard's place as text, `"0:4,0:8"` (start:stop per axis; `""` for a scalar)."""
    return ",".join(f"{a}:{b}" for a, b in index)


def _parse_index(text: Any, shape: tuple[int, ...]) -> ShardIndex | None:
    """The shard index `text` names inside `shape`, None when it is malformed or outside."""
    if not isinstance(text, str):
        return None
    parts = text.split(",") if text else []
    if len(parts) != len(shape):
        return None
    out = []
    for part, n in zip(parts, shape):
        a, sep, b = part.partition(":")
        if not (sep and a.isdigit() and b.isdigit() and int(a) <= int(b) <= n):
            return None
        out.append((int(a), int(b)))
    return tuple(out)


def _bytes_of(t: TensorData) -> Any:
    return t.array.reshape(-1).view(np.uint8).data


def _global_array(t: ShardedTensor, source: str, key: str) -> Any:
    """The global `jax.Array` Orbax is given for `t`: this process's devices get its
    shards (`jax.make_array_from_single_device_arrays`), so each process writes its own."""
    from .placement import global_array

    try:
        return global_array(t)
    except RecorderError as e:
        raise RecorderError(str(e), source=source, key=key) from None
    except (ValueError, TypeError) as e:
        raise RecorderError(f"cannot rebuild the global array from this process's shards: {e}",
                            source=source, key=key) from e


def _all_processes(local: Any) -> list[Any]:
    """`local` (JSON data) of every JAX process, in process order (a collective: every
    process calls it)."""
    import jax

    if jax.process_count() == 1:
        return [local]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(local, sort_keys=True).encode("ascii"), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(every[p, : int(n)])) for p, n in enumerate(sizes)]


def _merged_shard_crcs(local: dict[str, dict[str, int]], item: Item,
                       source: str) -> dict[str, dict[str, int]]:
    """The `shards` table: for each tensor saved from shards (by tensor index), the
    CRC-32 of each distinct shard, gathered from every process (each computes those its
    devices hold). Raises `RecorderError` when two processes hold different bytes for one
    shard or when no process holds one."""
    if not local:
        return {}
    merged: dict[str, dict[str, int]] = {}
    for part in _all_processes(local):
        for index, crcs in part.items():
            into = merged.setdefault(index, {})
            for where, crc in crcs.items():
                if into.setdefault(where, crc) != crc:
                    raise RecorderError(f"two processes hold different values for the shard at "
                                        f"[{where}] of tensor {index}", source=source)
    tensors = list(iter_tensors(item))
    for index, crcs in merged.items():
        key, t = tensors[int(index)]
        assert isinstance(t, ShardedTensor), key  # every process captured the same record
        layout = t.layout.devices_indices_map(t.shape).values()
        from .placement import shard_index

        want = {_index_text(shard_index(i, t.shape)) for i in layout}
        if want != set(crcs):
            raise RecorderError(f"the processes hold shards {sorted(crcs)} of a tensor laid out "
                                f"in {sorted(want)}", source=source, key=key)
    return merged


def _shard_table(doc: dict[str, Any], table: list[_Row], source: str) -> dict[int, dict[ShardIndex, int]]:
    """The `shards` table by tensor index, each shard's index parsed; `CorruptRecordError`
    for a malformed one (absent: a 1.0 checkpoint, every tensor whole)."""
    raw = doc.get("shards", {})
    if not isinstance(raw, dict):
        raise CorruptRecordError("malformed shards table", source=source, key="shards")
    out: dict[int, dict[ShardIndex, int]] = {}
    for index, crcs in raw.items():
        i = int(index) if isinstance(index, str) and index.isdigit() else -1
        if not 0 <= i < len(table) or not isinstance(crcs, dict) or not crcs:
            raise CorruptRecordError(f"malformed shards table entry {index!r}", source=source,
                                     key="shards")
        shape = table[i][1]
        parsed: dict[ShardIndex, int] = {}
        for where, crc in crcs.items():
            at = _parse_index(where, shape)
            if at is None or type(crc) is not int or not 0 <= crc <= 0xFFFFFFFF:
                raise CorruptRecordError(f"malformed shard [{where}] of tensor {index}",
                                         source=source, key="shards")
            parsed[at] = crc
        if sum(math.prod(b - a for a, b in at) for at in parsed) != math.prod(shape):
            raise CorruptRecordError(f"the shards of tensor {index} do not tile its shape {shape}",
                                     source=source, key="shards")
        out[i] = parsed
    return out


def _read_layouts(table: list[_Row], shard_crcs: dict[int, dict[ShardIndex, int]],
                  sharding: Sharding | ShardingRule | None) -> dict[str, Any]:
    """The sharding each array saved from shards is read into (by array name): the
    rule's; the others are read whole."""
    if sharding is None or not shard_crcs:
        return {}
    import jax

    out: dict[str, Any] = {}
    for i, (key, shape, _, name) in enumerate(table):
        if i in shard_crcs and name is not None:
            layout = sharding if isinstance(sharding, jax.sharding.Sharding) else sharding(key, shape)
            if layout is not None:
                if not isinstance(layout, jax.sharding.Sharding):
                    raise TypeError(f"the sharding rule gave {type(layout).__name__} for {key!r}, "
                                    "not a jax.sharding.Sharding or None")
                out[name] = layout
    return out


def _verified_shards(arr: Any, crcs: dict[ShardIndex, int], source: str, key: str) -> TensorData:
    """The tensor of an array saved from shards, each shard checked against its CRC: a
    whole array (read whole, or a layout this process holds all of) as a `TensorData`,
    every saved shard cut from it and checked; a global array spanning other processes
    as a `ShardedTensor` of this process's shards, those in the saved layout checked (a
    shard of another layout has no CRC to check)."""
    from .placement import host_copy, shards_of

    if isinstance(arr, np.ndarray) or arr.is_fully_addressable:
        whole = arr if isinstance(arr, np.ndarray) else host_copy(arr)
        for at, crc in crcs.items():
            part = TensorData.from_array(whole[tuple(slice(a, b) for a, b in at)])
            _check_crc(part, crc, at, source, key)
        return TensorData.from_array(whole, copy=False)
    parts = shards_of(arr)
    for at, part in parts.items():
        if at in crcs:
            _check_crc(part, crcs[at], at, source, key)

    return ShardedTensor(DType.from_numpy(arr.dtype), tuple(arr.shape), parts, arr.sharding)


def _agree(damaged: ChecksumError | None, source: str) -> None:
    """Raise in every process when any found a damaged shard (a collective: a process
    that failed alone would leave the others waiting in their next one)."""
    reports = _all_processes(None if damaged is None else str(damaged))
    for process, report in enumerate(reports):
        if report is not None:
            raise ChecksumError(f"process {process} read a damaged shard: {report}",
                                source=source) from damaged


def _check_crc(part: TensorData, crc: int, at: ShardIndex, source: str, key: str) -> None:
    got = crc32(_bytes_of(part))
    if got != crc:
        raise ChecksumError(f"shard [{_index_text(at)}] checksum mismatch (stored {crc:#010x}, "
                            f"computed {got:#010x})", source=source, key=f"item.{key}")


def _verify(item: Item, checksums: Any, sharded: dict[int, Any], source: str) -> None:
    """Each whole tensor against its CRC-32 in `checksums` (one entry per tensor, in
    order; a tensor saved from shards was checked shard by shard)."""
    verify_checksums(item, checksums, source, recompute=False)  # the table's shape
    for i, ((key, t), stored) in enumerate(zip(iter_tensors(item), checksums)):
        got = None if i in sharded else crc32(_bytes_of(t))
        if got is not None and got != stored:
            raise ChecksumError(f"tensor checksum mismatch (stored {stored:#010x}, computed "
                                f"{got:#010x})", source=source, key=f"item.{key}")
