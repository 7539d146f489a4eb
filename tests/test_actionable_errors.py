"""Errors a user can act on: each says what is wrong in the user's terms and what to do."""

from __future__ import annotations

import errno
import re
import subprocess
import sys

import numpy as np
import pytest

import trainrec
from trainrec import (
    ChecksumError,
    CorruptRecordError,
    FileMissingError,
    GradientsAccumulator,
    NamedMpkBytesRecorder,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    TensorData,
    TrainingRecord,
)

NATIVE = NativePrecisionSettings()
ITEM = {"w": TensorData.from_array(np.arange(6, dtype=np.float32))}


# -- missing files and folders ---------------------------------------------------------------


def test_file_missing_error_is_a_file_not_found_error(tmp_path):
    path = tmp_path / "absent.mpk"
    with pytest.raises(FileNotFoundError) as e:
        NamedMpkFileRecorder().load_item(path)
    assert isinstance(e.value, FileMissingError) and isinstance(e.value, RecorderError)
    assert e.value.errno == errno.ENOENT and e.value.filename == str(path)
    assert str(e.value) == f"no such checkpoint (file {path})"
    with pytest.raises(FileNotFoundError):
        trainrec.read_file(path)


def test_saving_into_a_missing_folder_says_the_folder_is_missing(tmp_path):
    path = tmp_path / "runs" / "ckpt.mpk"
    for recorder in (NamedMpkFileRecorder(), NamedMpkGzFileRecorder()):
        with pytest.raises(FileMissingError) as e:
            recorder.save_item(ITEM, path)
        msg = str(e.value)
        assert f"the folder {str(tmp_path / 'runs')!r} does not exist" in msg
        assert "trainrec-tmp" not in msg
    assert not (tmp_path / "runs").exists()


# -- a recorder given another recorder's file -------------------------------------------------


def _files(tmp_path):
    files = {
        "namedmpk": NamedMpkFileRecorder(NATIVE).save_item(ITEM, tmp_path / "a.mpk"),
        "namedmpk.gz": NamedMpkGzFileRecorder(NATIVE).save_item(ITEM, tmp_path / "a.mpk.gz"),
    }
    try:
        import trainrec.adapters.torch as trt

        files["torch"] = trt.TorchFileRecorder(NATIVE).save_item(ITEM, tmp_path / "a.pt")
    except ImportError:
        pass
    try:
        from trainrec.adapters.jax.recorder import FlaxMsgpackFileRecorder

        files["flax"] = FlaxMsgpackFileRecorder(NATIVE).save_item(ITEM, tmp_path / "a.msgpack")
    except ImportError:
        pass
    return files


READER_NAMES = {
    "namedmpk": "NamedMpkFileRecorder",
    "namedmpk.gz": "NamedMpkGzFileRecorder",
    "torch": "TorchFileRecorder",
    "flax": "FlaxMsgpackFileRecorder",
}


def _recorder(kind):
    if kind == "namedmpk":
        return NamedMpkFileRecorder(NATIVE)
    if kind == "namedmpk.gz":
        return NamedMpkGzFileRecorder(NATIVE)
    if kind == "torch":
        return pytest.importorskip("trainrec.adapters.torch").TorchFileRecorder(NATIVE)
    return pytest.importorskip("trainrec.adapters.jax.recorder").FlaxMsgpackFileRecorder(NATIVE)


@pytest.mark.parametrize("reader", list(READER_NAMES))
@pytest.mark.parametrize("written", list(READER_NAMES))
def test_a_recorder_given_another_recorders_file_names_the_one_that_reads_it(reader, written, tmp_path):
    files = _files(tmp_path)
    if reader == written or written not in files:
        pytest.skip("same recorder or not installed")
    rec = _recorder(reader)
    with pytest.raises(CorruptRecordError) as e:
        rec.load_item(files[written])
    msg = str(e.value)
    assert READER_NAMES[written] in msg and "trainrec.read_file" in msg
    assert str(files[written]) in msg
    assert trainrec.read_file(files[written])[1]["w"].bitwise_equal(ITEM["w"])


def test_bytes_recorder_given_a_pt_file_names_its_reader(tmp_path):
    files = _files(tmp_path)
    if "torch" not in files:
        pytest.skip("torch not installed")
    with pytest.raises(CorruptRecordError, match="TorchFileRecorder reads it"):
        NamedMpkBytesRecorder().load_item(files["torch"].read_bytes())


@pytest.mark.parametrize("at", [3, 10, 20])
def test_a_damaged_namedmpk_file_gets_no_misleading_hint(at, tmp_path):
    data = bytearray(NamedMpkBytesRecorder().save_item({"a": 1}))
    data[at] ^= 0x01
    with pytest.raises(CorruptRecordError) as e:
        NamedMpkBytesRecorder().load_item(bytes(data))
    assert "wrong magic" in str(e.value) and "reads it" not in str(e.value)
    (tmp_path / "d.mpk").write_bytes(bytes(data))
    with pytest.raises(CorruptRecordError, match="wrong magic"):
        trainrec.read_file(tmp_path / "d.mpk")


# -- checksum messages: one base ---------------------------------------------------------------

_NUMBERS = re.compile(r"(stored|computed) (\S+?)[,)]")


def _assert_hex(msg: str) -> None:
    found = dict(_NUMBERS.findall(msg))
    assert set(found) == {"stored", "computed"}, msg
    for v in found.values():
        assert re.fullmatch(r"0x[0-9a-f]{8}", v), msg


def test_structure_and_header_checksum_messages_use_hex():
    good = NamedMpkBytesRecorder().save_item({"a": "x" * 40})
    # a flipped bit in the item's structure and one in the header's
    for at in (good.index(b"xxxx"), good.index(b"Item")):
        data = bytearray(good)
        data[at] ^= 0x01
        with pytest.raises(ChecksumError) as e:
            NamedMpkBytesRecorder().load_item(bytes(data))
        _assert_hex(str(e.value))


def test_envelope_checksum_messages_use_hex(tmp_path):
    jr = pytest.importorskip("trainrec.adapters.jax.recorder")
    path = jr.FlaxMsgpackFileRecorder(NATIVE).save_item(ITEM, tmp_path / "a.msgpack")
    data = bytearray(path.read_bytes())
    payload = np.arange(6, dtype=np.float32).tobytes()
    at = bytes(data).index(payload)
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError) as e:
        jr.FlaxMsgpackFileRecorder(NATIVE).load_item(path)
    _assert_hex(str(e.value))


# -- the command line in a pipe ----------------------------------------------------------------


def test_inspect_into_a_pipe_closed_early_ends_quietly(tmp_path):
    item = {f"tensor_{i:05d}": TensorData.from_array(np.zeros(2, np.float32)) for i in range(3000)}
    path = NamedMpkFileRecorder().save_item(item, tmp_path / "many.mpk")
    proc = subprocess.Popen([sys.executable, "-m", "trainrec", "inspect", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(10)  # like `head`: read a little, then close
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == "", err


# -- devices ---------------------------------------------------------------------------------


def test_restoring_to_cuda_without_a_gpu_says_no_cuda_device_is_visible():
    torch = pytest.importorskip("torch")
    trt = pytest.importorskip("trainrec.adapters.torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradientsAccumulator()
    model(torch.ones(2)).sum().backward()
    acc.accumulate(model, trt.grads_from(model))

    @trainrec.record
    class S:
        micro: int

    rec = TrainingRecord.capture(model, opt, None, acc, S(1))
    before = model.weight.detach().clone()
    with pytest.raises(RecorderError, match="no CUDA device is visible") as e:
        rec.restore(model, opt, None, "cuda")
    assert "is not a torch device" not in str(e.value)
    assert torch.equal(model.weight, before)


def test_read_file_still_reads_a_plain_flax_dict_whatever_its_first_key(tmp_path):
    pytest.importorskip("trainrec.adapters.jax.recorder")
    import msgpack

    path = tmp_path / "plain.msgpack"
    path.write_bytes(msgpack.packb({"format": "mine", "step": 3}))
    header, item = trainrec.read_file(path)
    assert header.format == "flax.msgpack" and item == {"format": "mine", "step": 3}


@pytest.mark.parametrize("kind", ["mpk", "gz", "torch", "flax"])
def test_every_file_recorder_says_a_missing_path_or_a_directory_is_missing(kind, tmp_path):
    """One translation of read errors (`trainrec.errors.reading`) for every file recorder."""
    if kind == "torch":
        recorder = pytest.importorskip("trainrec.adapters.torch").TorchFileRecorder()
    elif kind == "flax":
        recorder = pytest.importorskip("trainrec.adapters.jax").FlaxMsgpackFileRecorder()
    else:
        recorder = {"mpk": trainrec.NamedMpkFileRecorder(), "gz": trainrec.NamedMpkGzFileRecorder()}[kind]
    for path in (tmp_path / "nope", tmp_path):
        with pytest.raises(trainrec.FileMissingError) as e:
            recorder.load_item(path)
        assert e.value.source == str(path) and isinstance(e.value, FileNotFoundError)
