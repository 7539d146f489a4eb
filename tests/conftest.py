import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # test modules share helpers

# JAX compiles the same training steps in many processes of one run (the xdist workers,
# every fresh process of a continuation or `trainrec check` test): a persistent
# compilation cache shared by all of them, for this run only, compiles each once. The
# cache's size bound turns on its file lock, so that two processes never read an entry
# half written. A compiled program read from the cache is the one that was written:
# results stay bitwise (test_jax_continuation.py compares against runs with the cache off).
_JAX_CACHE = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(4 << 30),
}
_made_cache: list[str] = []
_CACHE_PREFIX = "trainrec-tests-jax-cache-"
# Each write under the size bound lists the whole cache directory (jax's LRU eviction reads
# every entry's access time), so the writes of a run cost the square of its entries. Most
# entries are the pytest processes' own: one quick program per eager op and shape, reused by
# the in-memory cache of the process that compiled it. The pytest processes write only the
# programs that take this long to compile; the processes they start still write every one,
# for the fresh processes that run the same steps after them.
_IN_PROCESS_MIN_COMPILE_SECS = 0.2
_in_process_bound: list[bool] = []


def pytest_configure(config):
    """Runs in xdist's controller before it starts the workers, which inherit the
    environment (and find the cache already set up)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # the caller's own cache, or the controller's
    _made_cache.append(tempfile.mkdtemp(prefix=_CACHE_PREFIX))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _made_cache[0]
    for k, v in _JAX_CACHE.items():
        os.environ.setdefault(k, v)


def pytest_runtest_setup(item):
    """Once jax is imported in this pytest process (at collection, or by an earlier test),
    bound which of its compiles go to the run's cache (see `_IN_PROCESS_MIN_COMPILE_SECS`)."""
    if _in_process_bound or "jax" not in sys.modules:
        return
    if not Path(os.environ.get("JAX_COMPILATION_CACHE_DIR", "")).name.startswith(_CACHE_PREFIX):
        _in_process_bound.append(False)  # the caller's own cache: its settings stay
        return
    sys.modules["jax"].config.update("jax_persistent_cache_min_compile_time_secs", _IN_PROCESS_MIN_COMPILE_SECS)
    _in_process_bound.append(True)


def pytest_unconfigure(config):
    for path in _made_cache:
        shutil.rmtree(path, ignore_errors=True)
