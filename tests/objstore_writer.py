"""A checkpoint writer on a store URL, for the SIGKILL test of tests/test_object_store.py.

    python tests/objstore_writer.py URL

runs a fork server: it imports trainrec, numpy and s3fs once, prints "ready", then for
each line "go" on stdin forks a writer (a process of its own, killed by the test with
SIGKILL at a random moment) and prints "pid PID"; the writer opens
`CheckpointManager(URL, keep_last=3)`, resumes after its latest step and saves step after
step (`block=True`), printing "saved STEP" after each returns. When the writer is gone
the server reaps it (a zombie would still hold the lease: its pid is alive) and prints
"exit PID STATUS". No torch or jax: a numpy record (bf16, f32, i8, f64) proves the same.

The fork happens before any s3fs filesystem (and so its event loop thread and
connections) exists in the server, so a writer shares no socket with another.
"""

from __future__ import annotations

import importlib
import os
import sys

import ml_dtypes
import numpy as np

import trainrec
from trainrec import CheckpointManager, GradientsAccumulator, TrainingRecord
from trainrec.adapters.numpy import MLP, AdamW, StepLr

SIZE = 1264
"""An MLP([SIZE, SIZE, 2]): 1.6 M float32 weights, 6.1 MiB a checkpoint. With PART_BYTES
at S3's minimum part size (5 MiB) each save is a multipart upload of two parts, so kills
land inside multipart uploads too."""
PART_BYTES = 5 << 20


@trainrec.record
class Written:
    step: int
    bf16: np.ndarray
    i8: np.ndarray
    f64: np.ndarray


def state(step: int) -> Written:
    """What step `step` holds besides its weights (bf16, int8, float64: dtypes kept)."""
    return Written(step, np.arange(12, dtype=ml_dtypes.bfloat16) + ml_dtypes.bfloat16(step % 64),
                   (np.arange(-5, 5) + step % 100).astype(np.int8), np.linspace(0, step, 9))


def params(step: int, model: MLP) -> dict[str, np.ndarray]:
    """Step `step`'s parameters (float32): a pattern shifted by the step."""
    return {k: ((np.arange(v.size) % 251).reshape(v.shape) + step).astype(np.float32)
            for k, v in model.params.items()}


def record(step: int) -> TrainingRecord:
    model = MLP([SIZE, SIZE, 2], seed=0)
    model.params = params(step, model)
    return TrainingRecord.capture(model, AdamW(), StepLr(0.1, 2), GradientsAccumulator(), state(step))


def _writer(url: str) -> None:
    # the module that reads it (the package's name `location` is that module's function)
    importlib.import_module("trainrec.storage.location").PART_BYTES = PART_BYTES
    mgr = CheckpointManager(url, keep_last=3)
    step = (mgr.latest_step() or 0) + 1
    while True:
        mgr.save(step, record(step), block=True)
        os.write(1, f"saved {step}\n".encode())
        step += 1


def _warm_session() -> None:
    """Give every s3fs filesystem the writers make one botocore session whose service
    models are loaded already (parsing them is most of a first request's 0.5 s): fsspec's
    own configuration passes it to S3FileSystem(session=...). No connection is opened."""
    import asyncio

    import fsspec
    import s3fs  # noqa: F401  # imported once here, not by each writer
    from aiobotocore.session import AioSession

    session = AioSession()

    async def client() -> None:
        async with session.create_client("s3"):
            pass

    asyncio.run(client())
    fsspec.config.conf.setdefault("s3", {})["session"] = session


def main(url: str) -> None:
    _warm_session()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _writer(url)
            except BaseException as e:  # a writer is only ever killed: say why it stopped
                os.write(1, f"error {type(e).__name__}: {e}\n".replace("\n", " ").encode() + b"\n")
                code = 1
            os._exit(code)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
