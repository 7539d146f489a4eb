"""Caller state comes back as it was saved, or the save refuses it: non-init fields keep
their data, a record field holds exactly its declared record type, NamedTuples and enums
rebuild as themselves, unions of several record types and records whose annotations
cannot be resolved are refused; a device that is not there is no corrupt file."""

from __future__ import annotations

import typing

import pytest

import trainrec
from trainrec import (
    CorruptRecordError,
    DefaultRecorder,
    GradientsAccumulator,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    RecorderError,
    RecordMismatchError,
    TrainingRecord,
)

R = NamedMpkBytesRecorder(NativePrecisionSettings())


def roundtrip(value: typing.Any) -> typing.Any:
    return R.load(R.record(value, None), None, type(value))


# -- a device that is not there is not a corrupt file -----------------------------------------


def _state_with_tensor(tensor_type: type) -> type:
    @trainrec.record
    class S:
        micro: int
        noise: tensor_type  # type: ignore[valid-type]

    S.__annotations__["noise"] = tensor_type  # evaluated: not a string to resolve
    return S


def test_loading_torch_state_onto_a_missing_gpu_is_not_a_corrupt_file(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("trainrec.adapters.torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    state_cls = _state_with_tensor(torch.Tensor)
    model = torch.nn.Linear(2, 1)
    path = tmp_path / "a.mpk"
    TrainingRecord.capture(model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                           GradientsAccumulator(), state_cls(1, torch.zeros(2))).save(DefaultRecorder(), path)
    with pytest.raises(RecorderError, match="no CUDA device is visible") as e:
        TrainingRecord.load(DefaultRecorder(), path, "cuda", state_type=state_cls)
    assert not isinstance(e.value, CorruptRecordError)
    assert isinstance(e.value, RecordMismatchError)
    back = TrainingRecord.load(DefaultRecorder(), path, "cpu", state_type=state_cls)  # the file is good
    assert back.state.micro == 1 and torch.equal(back.state.noise, torch.zeros(2))


def test_loading_jax_state_onto_a_missing_gpu_is_not_a_corrupt_file():
    jax = pytest.importorskip("jax")
    pytest.importorskip("trainrec.adapters.jax")
    try:
        jax.devices("gpu")
        pytest.skip("a GPU is visible to JAX")
    except RuntimeError:
        pass
    state_cls = _state_with_tensor(jax.Array)
    data = R.record(state_cls(1, jax.numpy.zeros(2)), None)
    with pytest.raises(RecordMismatchError, match="no CUDA device is visible to JAX") as e:
        R.load(data, "gpu:0", state_cls)
    assert not isinstance(e.value, CorruptRecordError)
    assert R.load(data, "cpu", state_cls).micro == 1
