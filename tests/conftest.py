import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test modules share helpers
from _shared_runs import XLA_TEST_FLAG, xla_flags  # noqa: E402

# Where PYTHONDONTWRITEBYTECODE is set (as on this project's machines), Python compiles every
# module from source in each process and pytest rewrites and compiles every test module in
# each xdist worker, again at every run: the suite lets them keep their bytecode in
# __pycache__ (which git ignores), in its own processes and in those they start. Measured on
# 2 cores: collection 10.8 -> 6.5 s per worker once cached; the whole suite from a tree with
# no bytecode, 776 -> 760 CPU-s (397 -> 389 s). No test's result depends on it.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

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


# XLA's CPU backend spends most of a JAX test's CPU in LLVM, optimizing hundreds of small
# programs (every eager op at every shape, every step function) that run once or a few times:
# the suite compiles them at -O0 (XLA_TEST_FLAG, in every process it starts), unless the
# caller's XLA_FLAGS choose a level. Results are bitwise stable at any level within a run;
# test_jax_continuation.py's fresh-process resumes are compiled at XLA's default level, as a
# user's are. Measured on tests/test_convert_transformer.py: 63 -> 47 CPU-s.
def _xla_test_flags() -> None:
    if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = xla_flags(XLA_TEST_FLAG)


# `-n auto` (the README's test command): one xdist worker more than the cores this process
# may run on (up to 8 cores). A test spends part of its time waiting, on the processes it
# started, a file, a server or a timeout; with one worker per core a core idles then, with one
# more it runs another test. Measured on 2 cores: 2 workers kept them 80-91% busy (580-710 s),
# 3 workers 96-99% (587 s; 718 s on a host with 10x the steal time). PYTEST_XDIST_AUTO_NUM_WORKERS
# still decides when set.
def auto_workers(cores: int) -> int:
    return cores + 1 if cores < 8 else cores


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config):
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return auto_workers(usable_cores())


def pytest_configure(config):
    """Runs in xdist's controller before it starts the workers, which inherit the
    environment (and find the cache already set up)."""
    _xla_test_flags()
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


# -- a real S3 protocol server (moto) through s3fs, for tests/test_object_store*.py --------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server in a process of its own (not a thread of this one: its work would
    take this process's GIL) on a free loopback port, its request log in a file."""
    fsspec = pytest.importorskip("fsspec", reason="the [s3] extra (fsspec, s3fs) is not installed")
    pytest.importorskip("s3fs", reason="the [s3] extra is not installed")
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        pytest.skip("moto[server] is not installed: pip install 'trainrec[test]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the server logs every request to stderr: into a file, never a pipe nobody reads
    # (once its 64 KiB filled, every request hung on the log line: the kill test's
    # "requests hanging > 60 s"). A socket timeout: an idle connection's thread ends.
    serve = ("import socket, sys; socket.setdefaulttimeout(3); from moto.server import main; "
             "main(sys.argv[1:])")
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as err:
        server = subprocess.Popen([sys.executable, "-c", serve, "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                why = log.read_bytes().decode(errors="replace")[-500:]
                pytest.skip(f"the moto S3 server did not start on 127.0.0.1:{port}: {why}")
            time.sleep(0.1)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fsspec.filesystem("s3", skip_instance_cache=True)  # the env is read by new instances
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.terminate()
    server.wait(10)


@pytest.fixture
def s3(s3_server):
    import fsspec

    bucket = f"trainrec-{os.urandom(4).hex()}"
    fs = fsspec.filesystem("s3")
    fs.mkdir(bucket)
    return f"s3://{bucket}/run"
