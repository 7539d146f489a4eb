"""Save/load callables for trainrec and its peers, on one state of torch tensors.

Every `load` returns the state fully materialized as torch tensors. A peer whose package
is not installed is reported as skipped, with the reason.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

State = dict[str, Any]  # name -> torch.Tensor
Save = Callable[[State, Path], None]
Load = Callable[[Path], State]


def _torch_views(item: Any) -> State:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only views of the loaded buffer
        return {k: torch.from_numpy(t.array) for k, t in item.items()}


def raw(reserve: bool = False) -> tuple[Save, Load]:
    """The limit: the same bytes with one write each and one readinto (no fsync: none of
    the peers fsyncs; trainrec's durable default is measured on its own row). `reserve`:
    the file's blocks are allocated first, as trainrec's file recorders do."""
    import torch

    from trainrec.storage import atomic as _atomic

    layout: dict[str, tuple[int, int, Any, tuple[int, ...]]] = {}

    def save(state: State, path: Path) -> None:
        at = 0
        with open(path, "wb") as f:
            if reserve:
                _atomic._reserve(f.fileno(), sum(t.numel() * t.element_size() for t in state.values()))
            for k, t in state.items():
                view = t.numpy().reshape(-1).view(np.uint8)
                f.write(view.data)
                layout[k] = (at, view.nbytes, t.dtype, tuple(t.shape))
                at += view.nbytes

    def load(path: Path) -> State:
        buf = np.empty(path.stat().st_size, np.uint8)
        with open(path, "rb") as f:
            f.readinto(buf.data)
        whole = torch.from_numpy(buf)
        return {k: whole[a : a + n].view(dt).reshape(shape) for k, (a, n, dt, shape) in layout.items()}

    return save, load


def trainrec_recorder(kind: str) -> tuple[Save, Load]:
    import trainrec

    load_kw: dict[str, Any] = {}
    if kind == "default":
        recorder: Any = trainrec.DefaultRecorder()
    elif kind == "nofsync":  # like the peers: no fsync; load reads, copies and verifies
        recorder = trainrec.NamedMpkFileRecorder(durable=False)
    elif kind == "fast":  # no fsync, mapped and fully verified load (no copy)
        recorder = trainrec.NamedMpkFileRecorder(durable=False)
        load_kw = {"mmap": True, "verify": True}
    elif kind == "gz":
        recorder = trainrec.NamedMpkGzFileRecorder()
    elif kind == "flax":
        from trainrec.adapters.jax.recorder import FlaxMsgpackFileRecorder

        recorder = FlaxMsgpackFileRecorder()
    elif kind == "orbax":  # an Orbax checkpoint directory, as orbax's StandardCheckpointer's
        from trainrec.adapters.jax import OrbaxRecorder

        recorder = OrbaxRecorder()
    else:
        import trainrec.adapters.torch as trt

        recorder = trt.TorchFileRecorder()

    def save(state: State, path: Path) -> None:
        item = {k: trainrec.TensorData.from_array(t.numpy(), copy=False) for k, t in state.items()}
        recorder.save_item(item, path)

    def load(path: Path) -> State:
        return _torch_views(recorder.load_item(path, **load_kw))

    return save, load


def torch_pickle() -> tuple[Save, Load]:
    import torch

    return (lambda state, path: torch.save(state, path),
            lambda path: torch.load(path, weights_only=True))


def safetensors_torch() -> tuple[Save, Load]:
    from safetensors.torch import load_file, save_file

    return (lambda state, path: save_file(state, str(path)), lambda path: load_file(str(path)))


def flax_msgpack() -> tuple[Save, Load]:
    import torch
    from flax import serialization

    def save(state: State, path: Path) -> None:
        path.write_bytes(serialization.msgpack_serialize({k: t.numpy() for k, t in state.items()}))

    def load(path: Path) -> State:
        restored = serialization.msgpack_restore(path.read_bytes())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return {k: torch.from_numpy(v) for k, v in restored.items()}

    return save, load


def orbax_standard() -> tuple[Save, Load]:
    import shutil

    import orbax.checkpoint as ocp
    import torch

    def save(state: State, path: Path) -> None:
        if path.exists():
            shutil.rmtree(path)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(path.absolute(), {k: t.numpy() for k, t in state.items()})

    def load(path: Path) -> State:
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(path.absolute())
        return {k: torch.from_numpy(np.asarray(v)) for k, v in restored.items()}

    return save, load


PEERS: dict[str, Callable[[], tuple[Save, Load]]] = {
    "raw write/readinto": raw,
    "raw, blocks reserved first (fallocate)": lambda: raw(reserve=True),
    "trainrec DefaultRecorder (durable: fsync)": lambda: trainrec_recorder("default"),
    "trainrec NamedMpk durable=False": lambda: trainrec_recorder("nofsync"),
    "trainrec durable=False, mmap+verify load": lambda: trainrec_recorder("fast"),
    "trainrec TorchFileRecorder": lambda: trainrec_recorder("torch"),
    "trainrec FlaxMsgpackFileRecorder": lambda: trainrec_recorder("flax"),
    "trainrec OrbaxRecorder": lambda: trainrec_recorder("orbax"),
    "trainrec NamedMpkGzFileRecorder": lambda: trainrec_recorder("gz"),
    "torch.save/load(weights_only)": torch_pickle,
    "safetensors.torch": safetensors_torch,
    "flax msgpack": flax_msgpack,
    "orbax StandardCheckpointer": orbax_standard,
}


def lazy_rows(state: State, tmp: Path) -> dict[str, Callable[[], None]]:
    """Open a file of the whole state and read its smallest tensor."""
    import torch

    small = min(state, key=lambda k: state[k].numel())
    rows: dict[str, Callable[[], None]] = {}
    import trainrec

    mpk = tmp / "lazy.mpk"
    trainrec.DefaultRecorder().save_item(
        {k: trainrec.TensorData.from_array(t.numpy(), copy=False) for k, t in state.items()}, mpk)

    def trainrec_mmap() -> None:
        item = trainrec.DefaultRecorder().load_item(mpk, mmap=True)
        _ = item[small].array  # type: ignore[index, union-attr]

    rows["trainrec mmap=True"] = trainrec_mmap
    rows["trainrec load(mmap=True) of a @record, one small field"] = _record_field_row(state, tmp)
    pt = tmp / "lazy.pt"
    torch.save(state, pt)
    rows["torch.load(mmap=True)"] = lambda: torch.load(pt, weights_only=True, mmap=True)[small].clone()
    try:
        from safetensors import safe_open
        from safetensors.torch import save_file

        st = tmp / "lazy.safetensors"
        save_file(state, str(st))

        def safetensors_lazy() -> None:
            with safe_open(str(st), "pt") as f:
                f.get_tensor(small)

        rows["safetensors safe_open"] = safetensors_lazy
    except ImportError:
        pass
    return rows


def _record_field_row(state: State, tmp: Path) -> Callable[[], None]:
    """`Recorder.load(..., mmap=True)` of a `@trainrec.record` holding the whole state as
    one array field (1 GiB at the default size) and a 3-element one, reading the small
    field only: the big one stays unread (and unverified) until it is read."""
    import numpy as np

    import trainrec

    @trainrec.record
    class Weights:
        step: np.ndarray
        weights: np.ndarray

    path = tmp / "record-field.mpk"
    whole = np.concatenate([t.numpy().reshape(-1) for t in state.values()])
    recorder = trainrec.NamedMpkFileRecorder(trainrec.NativePrecisionSettings(), durable=False)
    recorder.record(Weights(np.arange(3.0), whole), path)
    del whole

    def read_one_field() -> None:
        _ = recorder.load(path, None, Weights, mmap=True).step

    return read_one_field


# -- background saves: save(step) returns when the training thread may go on ---------------

Async = tuple[Callable[[int], None], Callable[[], None], Callable[[], None]]
"""save(step): start saving the live state as `step`; wait(): until it is written;
close(): release what the peer holds."""


def trainrec_manager(model: Any, opt: Any, acc: Any, state: Any, tmp: Path) -> Async:
    """`TrainingRecord.capture` (host copies, on the training thread), then
    `CheckpointManager.save` (written on its thread; default recorder, durable)."""
    import trainrec

    mgr = trainrec.CheckpointManager(tmp, keep_last=2)

    def save(step: int) -> None:
        mgr.save(step, trainrec.TrainingRecord.capture(model, opt, None, acc, state))

    return save, mgr.wait, mgr.wait


def flat_tensors(model: Any, opt: Any, pending: list[Any]) -> State:
    """Every tensor a `TrainingRecord` of `model`, `opt` and the `pending` gradients
    holds, live, under flat names: what the peers below are given."""
    out: State = {f"model.{k}": p.detach() for k, p in model.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            out[f"optim.{i}.{k}"] = v
    for i, g in enumerate(pending):
        out[f"grads.{i}"] = g
    return out


def orbax_async(tensors: State, tmp: Path) -> Async:
    """orbax `AsyncCheckpointer(StandardCheckpointHandler())` of numpy views of the live
    tensors, one directory per step."""
    import orbax.checkpoint as ocp

    ckpt = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    arrays = {k: t.numpy() for k, t in tensors.items()}

    def save(step: int) -> None:
        ckpt.wait_until_finished()  # one in flight, as the others
        _keep_two(tmp, step)
        ckpt.save((tmp / f"step-{step}").absolute(), args=ocp.args.StandardSave(arrays))

    return save, ckpt.wait_until_finished, ckpt.close


def orbax_manager(tensors: State, tmp: Path) -> Async:
    """orbax `CheckpointManager(max_to_keep=2, enable_async_checkpointing=True)`."""
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(tmp.absolute(), options=ocp.CheckpointManagerOptions(
        max_to_keep=2, enable_async_checkpointing=True))
    arrays = {k: t.numpy() for k, t in tensors.items()}

    def save(step: int) -> None:
        mgr.save(step, args=ocp.args.StandardSave(arrays))

    return save, mgr.wait_until_finished, mgr.close


def torch_dcp_async(tensors: State, tmp: Path) -> Async:
    """`torch.distributed.checkpoint.async_save`, one process, no process group: it
    stages a CPU copy on the calling thread and writes on its own."""
    import torch.distributed.checkpoint as dcp

    pending: list[Any] = []

    def wait() -> None:
        while pending:
            pending.pop().result()

    def save(step: int) -> None:
        wait()  # one in flight, as the others
        _keep_two(tmp, step)
        pending.append(dcp.async_save(tensors, checkpoint_id=str(tmp / f"step-{step}")))

    return save, wait, wait


def _keep_two(tmp: Path, step: int) -> None:
    """Delete the step before the last, as the managers' retention of two does."""
    import shutil

    shutil.rmtree(tmp / f"step-{step - 2}", ignore_errors=True)
