"""Folder checkpoints at store URLs (trainrec.storage.folder; spec/PROTOCOLS.md, "Checkpoints
on object stores"): `DistributedRecorder`, `DCPRecorder` and `OrbaxRecorder` save to and load
from `memory://` and a real S3 protocol server (moto's, through s3fs: tests/conftest.py),
one commit object `X/.trainrec-commit` written last; uncommitted, damaged, truncated, longer
or missing objects refused, a committed URL never saved over, a failed save commits nothing.
The 2-rank saves and loads (gloo, spawned: tests/objstore_ranks.py) run once, in one
bounded phase, for every check of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from same_items import same

import trainrec
from trainrec import (
    CorruptRecordError,
    FileMissingError,
    NativePrecisionSettings,
    RecorderError,
    TensorData,
    TrainingRecord,
)

fsspec = pytest.importorskip("fsspec", reason="the [s3] extra (fsspec, s3fs) is not installed")

NATIVE = NativePrecisionSettings()
COMMIT = ".trainrec-commit"
KINDS = ["distributed", "dcp", "orbax"]


@trainrec.record
class State:
    micro: int


@pytest.fixture
def mem() -> str:
    url = f"memory://trainrec-folders-{os.urandom(6).hex()}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url[len("memory://"):]):
        fs.rm(url[len("memory://"):], recursive=True)


# -- what each recorder saves, and the check that it came back -----------------------------


def _torch():
    return pytest.importorskip("torch")


def _ddp_run():
    """A 1-rank run mid-window: f64 parameters, an f16 buffer, a pending gradient."""
    torch = _torch()
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    model.register_buffer("f16", torch.arange(3, dtype=torch.float16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    opt.step()
    model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    return model, opt


def _item() -> dict:
    return {"bf16": TensorData.from_array(np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3)),
            "f64": TensorData.from_array(np.linspace(0, 1, 5)),
            "i8": TensorData.from_array(np.arange(-3, 3, dtype=np.int8)), "n": 3}


def _save(kind: str, url: str):
    """Save `kind`'s checkpoint at `url`; what `_loads_as_saved` compares against."""
    if kind == "distributed":
        import trainrec.adapters.torch as trt

        model, opt = _ddp_run()
        rec = TrainingRecord.capture(model, opt, None, trainrec.GradientsAccumulator(), State(3))
        assert rec.save(trt.DistributedRecorder(), url) == url
        return rec.into_item(NATIVE)
    if kind == "dcp":
        _torch()
        pytest.importorskip("torch.distributed.checkpoint")
        from test_dcp_load_exact import _trained

        import trainrec.adapters.torch as trt

        run = _trained()
        assert trt.DCPRecorder().save(url, *run) == url
        return run
    pytest.importorskip("orbax.checkpoint")
    import trainrec.adapters.jax as trj

    assert trj.OrbaxRecorder(NATIVE).save_item(_item(), url) == url
    return _item()


def _load(kind: str, url: str):
    if kind == "distributed":
        import trainrec.adapters.torch as trt

        return TrainingRecord.load(trt.DistributedRecorder(), url, state_type=State).into_item(NATIVE)
    if kind == "dcp":
        from test_dcp_load_exact import _fresh

        import trainrec.adapters.torch as trt

        live = _fresh()
        trt.DCPRecorder().load(url, *live)
        return live
    import trainrec.adapters.jax as trj

    return trj.OrbaxRecorder(NATIVE).read(url)[1]


def _loads_as_saved(kind: str, url: str, saved) -> bool:
    got = _load(kind, url)
    if kind == "dcp":
        from test_dcp_load_exact import _loaded_as_saved

        return _loaded_as_saved(saved, *got)
    return same(got, saved)


def _fs():
    return fsspec.filesystem("memory")


def _names(url: str) -> list[str]:
    fs, root = fsspec.core.url_to_fs(url)
    try:
        return sorted(str(p).rsplit("/", 1)[-1] for p in fs.ls(root, detail=False, refresh=True))
    except FileNotFoundError:
        return []


def _contents(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {n: bytes(fs.cat_file(f"{root}/{n}")) for n in _names(url)}


def _object(url: str, role: str) -> str:
    """The name of the data object the commit at `url` names for the file `role`."""
    fs, root = fsspec.core.url_to_fs(url)
    doc = json.loads(fs.cat_file(f"{root}/{COMMIT}"))
    return next(o["name"] for o in doc["objects"] if o["role"] == role)


# -- memory:// (fast) -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_folder_recorder_round_trips_a_url_and_the_cli_reads_it(mem, kind, capsys):
    from trainrec.cli.commands import main

    url = f"{mem}/step-1"
    saved = _save(kind, url)
    names = _names(url)
    assert names[0] == COMMIT and len({n.split(".")[0] for n in names[1:]}) == 1  # the save's id
    assert _loads_as_saved(kind, url, saved)
    assert main(["verify", url]) == 0
    assert f"OK: {url}" in capsys.readouterr().out
    assert main(["inspect", "--json", url]) == 0
    assert json.loads(capsys.readouterr().out)["format"].startswith("trainrec.")


@pytest.mark.parametrize("kind", ["distributed", "dcp"])
def test_a_folder_without_its_commit_object_is_not_a_checkpoint(mem, kind, capsys):
    from trainrec.cli.commands import main

    url = f"{mem}/step-1"
    _save(kind, url)
    _fs().rm_file(f"{url[len('memory://'):]}/{COMMIT}")  # as a save killed before its commit
    with pytest.raises(FileMissingError, match="not a committed checkpoint") as e:
        _load(kind, url)
    assert url in str(e.value)
    with pytest.raises(FileMissingError, match="not a committed checkpoint"):
        trainrec.read_file(url)
    assert main(["verify", url]) == 3
    assert "not a committed checkpoint" in capsys.readouterr().out


def _damage(url: str, name: str, how: str) -> None:
    path = f"{url[len('memory://'):]}/{name}"
    data = bytearray(_fs().cat_file(path))
    if how == "flip":
        data[len(data) // 2] ^= 1
    elif how == "truncate":
        del data[-1]
    elif how == "extend":
        data += b"\0"
    if how == "delete":
        _fs().rm_file(path)
    else:
        _fs().pipe_file(path, bytes(data))


@pytest.mark.parametrize(("kind", "role", "how", "error", "match"), [
    ("distributed", "replicated.mpk", "flip", CorruptRecordError, "CRC-32 is"),
    ("distributed", "replicated.mpk", "truncate", CorruptRecordError, "holds [0-9]+ bytes"),
    ("distributed", "manifest.json", "extend", CorruptRecordError, "holds [0-9]+ bytes"),
    ("distributed", "rank-00000-of-00001.mpk", "delete", FileMissingError, "no such object"),
    ("dcp", "dcp/__0_0.distcp", "flip", CorruptRecordError, "CRC-32 is"),
])
def test_a_damaged_truncated_longer_or_missing_object_is_refused_naming_it(mem, kind, role, how,
                                                                           error, match):
    url = f"{mem}/step-1"
    _save(kind, url)
    name = _object(url, role)
    _damage(url, name, how)
    for read in (lambda: _load(kind, url), lambda: trainrec.read_file(url)):
        with pytest.raises(error, match=match) as e:
            read()
        assert f"{url}/{name}" in str(e.value)


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_to_a_committed_url_is_refused_and_changes_nothing(mem, kind):
    url = f"{mem}/step-1"
    saved = _save(kind, url)
    before = _contents(url)
    with pytest.raises(RecorderError, match="committed here already") as e:
        _save(kind, url)
    assert url in str(e.value)
    assert _contents(url) == before
    assert _loads_as_saved(kind, url, saved)


@pytest.mark.parametrize("kind", KINDS)
def test_a_save_whose_upload_fails_midway_commits_nothing_and_keeps_the_last(mem, kind, monkeypatch):
    from trainrec.storage import folder

    saved = _save(kind, f"{mem}/step-1")
    real, calls = folder.upload, []

    def failing(url, **kw):
        calls.append(url)
        if len(calls) == 2:  # the second object: one is uploaded already
            raise RecorderError("injected: the store went away", source=url)
        return real(url, **kw)

    monkeypatch.setattr(folder, "upload", failing)
    with pytest.raises(RecorderError, match="injected"):
        _save(kind, f"{mem}/step-2")
    monkeypatch.undo()
    assert len(calls) == 2 and _names(f"{mem}/step-2") == []  # the one uploaded: deleted
    assert _names(mem) == ["step-1"]
    assert _loads_as_saved(kind, f"{mem}/step-1", saved)


def test_a_commit_naming_a_file_outside_its_folder_is_refused(mem):
    from trainrec.storage.commit import Commit, CommitObject, encode

    url = f"{mem}/step-1"
    _save("distributed", url)
    path = f"{url[len('memory://'):]}/{COMMIT}"
    doc = json.loads(_fs().cat_file(path))
    objects = [CommitObject(o["role"], o["name"], o["size"], int(o["crc32"], 16)) for o in doc["objects"]]
    objects[0] = CommitObject("../escaped", objects[0].name, objects[0].size, objects[0].crc32)
    _fs().pipe_file(path, encode(Commit(None, doc["save"], tuple(objects))))
    with pytest.raises(CorruptRecordError, match="outside its folder"):
        trainrec.read_file(url)


def test_an_async_dcp_save_to_a_url_commits_in_the_background(mem):
    _torch()
    pytest.importorskip("torch.distributed.checkpoint")
    from test_dcp_load_exact import _trained

    import trainrec.adapters.torch as trt

    run = _trained()
    future = trt.DCPRecorder().save(f"{mem}/step-1", *run, async_save=True)
    assert future.result(timeout=60) == f"{mem}/step-1"
    assert _loads_as_saved("dcp", f"{mem}/step-1", run)


def test_orbax_refuses_a_url_save_from_several_processes_writing_nothing(mem, monkeypatch):
    jax = pytest.importorskip("jax")
    pytest.importorskip("orbax.checkpoint")
    import trainrec.adapters.jax as trj

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(RecorderError, match="from one process only"):
        trj.OrbaxRecorder(NATIVE).save_item(_item(), f"{mem}/step-1")
    assert _names(mem) == []


# -- s3:// on moto's server, 1 rank ---------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_folder_recorder_round_trips_s3(s3, kind):
    url = f"{s3}/step-1"
    saved = _save(kind, url)
    assert _loads_as_saved(kind, url, saved)
    with pytest.raises(RecorderError, match="committed here already"):
        _save(kind, url)
    if kind == "distributed":
        with pytest.raises(FileMissingError, match="no such bucket"):
            _save(kind, f"s3://trainrec-no-such-bucket-{os.urandom(4).hex()}/step-1")


# -- 2 ranks (gloo, spawned) on s3:// --------------------------------------------------------

RANKS = Path(__file__).with_name("objstore_ranks.py")
PHASE_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, s3_server):
    """One 2-rank phase on a bucket of its own: every check of tests/objstore_ranks.py."""
    torch = _torch()
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    out = tmp_path_factory.mktemp("objstore-ranks")
    bucket = f"trainrec-{os.urandom(4).hex()}"
    fsspec.filesystem("s3").mkdir(bucket)
    base = f"s3://{bucket}/run"
    procs = [subprocess.Popen([sys.executable, str(RANKS), str(r), "2", str(out / "store"), str(out), base],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(2)]
    failures = []
    for r, p in enumerate(procs):
        try:
            text, _ = p.communicate(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"the 2-rank run did not finish in {PHASE_TIMEOUT_S} s")
        if p.returncode != 0:
            failures.append(f"rank {r} exited {p.returncode}:\n{text[-3000:]}")
    assert not failures, "\n".join(failures)
    return base, [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)], out


def test_two_ranks_save_and_load_back_at_s3_each_its_own(two_ranks):
    base, results, _ = two_ranks
    for rank, got in enumerate(results):
        assert got["ddp_loaded_same"] is True, rank
        assert got["dcp_loaded_same"] is True, rank
    assert results[0]["ddp_grads"] != results[1]["ddp_grads"]  # each rank's own, kept
    for name in ("ddp", "dcp"):
        roles = {o["role"] for o in json.loads(fsspec.filesystem("s3").cat_file(
            f"{base}/{name}/{COMMIT}"))["objects"]}
        assert "manifest.json" in roles and any("00001" in r for r in roles), roles  # rank 1's too
        assert trainrec.read_file(f"{base}/{name}")[0].format == f"trainrec.{'distributed' if name == 'ddp' else name}"


def test_two_ranks_failing_midway_commit_nothing_and_keep_the_last(two_ranks):
    base, results, _ = two_ranks
    for got in results:
        assert "injected" in got["ddp_failed"] and "injected" in got["dcp_failed"]
        assert "committed here already" in got["ddp_again"]
    for name in ("ddp-failed", "dcp-failed"):
        assert _names(f"{base}/{name}") == [], name
    assert results[0]["ddp_after_failures_same"] is True


def test_a_two_rank_dcp_checkpoint_at_s3_reshards_into_one_process(two_ranks):
    torch = _torch()
    from torch import nn

    import trainrec.adapters.torch as trt

    base, _, out = two_ranks
    full = torch.load(out / "dcp-full.pt", weights_only=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    got = trt.DCPRecorder().load(f"{base}/dcp", model, opt, sched, rank_state=0)
    assert got.saved_world_size == 2
    for name, p in model.named_parameters():
        assert p.dtype == full["params"][name].dtype and torch.equal(p.detach(), full["params"][name]), name
        assert torch.equal(p.grad, full["grads"][name]), name
