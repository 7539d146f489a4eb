"""The thread pools NamedMpk writers compute, and readers verify, tensor CRC-32s in (a
large payload is cut into pieces whose CRCs combine)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from ..items.checksum import crc32

__all__ = []

_PARALLEL_CRC_BYTES = 1 << 20
_PARALLEL_VERIFY_BYTES = 8 << 20
_VERIFY_THREADS = min(4, os.cpu_count() or 1)


def _verify_pool() -> ThreadPoolExecutor:
    return _pool("verify", _VERIFY_THREADS)
_POOLS: dict[str, tuple[int, ThreadPoolExecutor]] = {}


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    """This process's thread pool `name`: a forked child (a DataLoader worker, a
    multiprocessing fork) gets its own, since the parent's threads do not exist there."""
    known = _POOLS.get(name)
    if known is None or known[0] != os.getpid():
        known = _POOLS[name] = (os.getpid(), ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"trainrec-{name}"))
    return known[1]


def _crc_pool() -> ThreadPoolExecutor:
    return _pool("crc", 1)


def _crc_all(views: list[memoryview]) -> int:
    crc = 0
    for v in views:
        crc = crc32(v, crc)
    return crc
