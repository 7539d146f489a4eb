"""Two JAX processes on CPU (`jax.distributed` with a local coordinator, gloo) training a
model whose parameters, adamw moments and pending gradients are sharded ACROSS both
processes (a mesh over their 4 devices), checkpointed mid-window through
`TrainingRecord.capture` + `OrbaxRecorder` (each process writing its shards), resumed
by two fresh processes that read only their own shards: bitwise equal to the
uninterrupted run, shard by shard. A shard changed on disk is refused in every process
(see `orbax_mp_run.py`)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

HERE = Path(__file__).parent
RUN = HERE / "orbax_mp_run.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _two_processes(role: str, work: Path) -> list[dict]:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(RUN), role, str(work), str(i), port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-4000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    return outs


def test_two_processes_resume_bitwise_from_shards_sharded_across_them(tmp_path):
    for i, got in enumerate(_two_processes("reference", tmp_path)):
        assert got["process"] == i and got["count"] == 2
        # no process held the parameters, moments or pending gradients whole
        assert got["sharded"] and got["pending_sharded"], got
        assert "ShardedTensor" in got["kinds"], got
        assert got["written"] == ["ocdbt.process_0", "ocdbt.process_1"], got
    for i, got in enumerate(_two_processes("resume", tmp_path)):
        assert got["process"] == i and got["count"] == 2
        # each process read only its shards of every array saved from shards
        sharded = {k for k, v in got["loaded"].items() if v == "ShardedTensor"}
        assert {k.rpartition(".")[0] for k in sharded} >= {"0.state", "1.state.0.mu", "1.state.0.nu"}, got["loaded"]
        # the pending gradients of w1, w2, b1 (b2 is replicated: every process holds it whole)
        assert sorted(k for k in sharded if k.startswith("3.")) == ["3.b1.value", "3.w1.value", "3.w2.value"]
        assert got["loaded"]["0.state.b2"] == got["loaded"]["3.b2.value"] == "TensorData", got["loaded"]
        assert got["placed"] and got["mu_placed"] and got["pending_placed"], got
        assert got["count_uncommitted"], got  # optax's step count stays free for jit
        assert got["micro"] == 6 and got["pending"] == ["b1", "b2", "w1", "w2"], got
        assert got["compared"] == 24 and got["same"], got["differ"]
        by_shards, whole = got["corrupt"]
        assert by_shards.startswith("process 0 read a damaged shard: shard [0:4,0:8] checksum mismatch"), by_shards
        assert "item.0.state.w1" in by_shards, by_shards
        assert whole.startswith("shard [0:4,0:8] checksum mismatch") and "item.0.state.w1" in whole, whole
