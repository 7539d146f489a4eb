"""Attacks on the issue-17 work (conversion rules, neutral forms, format registry, .pt
reader): each test names the defect it found, or the claim it holds the code to."""

from __future__ import annotations

import numpy as np
import pytest

import trainrec
from trainrec import GradientsAccumulator, NamedMpkBytesRecorder, TrainingRecord
from trainrec import rules as rules_mod
from trainrec.adapters.numpy import MLP, Adam
from trainrec.convert import ConversionError, convert
from trainrec.rules import Rule


@trainrec.record
class S:
    micro: int


def _numpy_record(seed=0):
    return TrainingRecord.capture(MLP((4, 8, 3), seed=seed), Adam(), None, GradientsAccumulator(), S(0))


def _torch_template():
    """A fresh torch run with the numpy MLP's names and shapes, under Adam."""
    torch = pytest.importorskip("torch")
    net = torch.nn.Module()
    net.layers = torch.nn.ModuleList([torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)])
    return TrainingRecord.capture(net, torch.optim.Adam(net.parameters()), None, GradientsAccumulator(), S(0))


def _transform(monkeypatch, name, fn, shape=None):
    """`register_transform`, undone after the test (a name can be registered only once)."""
    monkeypatch.setattr(rules_mod, "TRANSFORMS", dict(rules_mod.TRANSFORMS))
    monkeypatch.setattr(rules_mod, "_SHAPES", dict(rules_mod._SHAPES))
    rules_mod.register_transform(name, fn, shape=shape)


# Defect 1: a registered transform whose result does not have the target's shape (its
# `shape` function lies, or its shape depends on the values) was written under the
# target's name with the wrong shape: a `.msgpack` kernel [8, 8] where the template has
# [8, 2, 4], no error. Now every plan's result is checked against the target's shape.
def test_a_transform_returning_the_wrong_shape_is_refused_not_written(monkeypatch):
    _transform(monkeypatch, "a17_liar", lambda a: a.T, shape=lambda s: s)
    out = convert(_numpy_record(0), _torch_template(),
                  rules=[Rule(r"layers\.0\.weight", "layers.0.weight", transform="a17_liar")])
    with pytest.raises(ConversionError, match=r"layers\.0\.weight.*a17_liar.*\[4, 8\].*\[8, 4\]"):
        out.save(NamedMpkBytesRecorder())


def test_a_transform_whose_shape_depends_on_the_values_is_refused(monkeypatch):
    _transform(monkeypatch, "a17_datadep", lambda a: a if a.dtype == np.uint8 else a[1:])
    out = convert(_numpy_record(0), _torch_template(),
                  rules=[Rule(r"layers\.0\.bias", "layers.0.bias", transform="a17_datadep")])
    # the shape probe (a uint8 array) sees the right shape; real values lose an element
    with pytest.raises(ConversionError, match=r"layers\.0\.bias.*a17_datadep"):
        out.save(NamedMpkBytesRecorder())


# Defect 1b: a transform that raises on real values escaped as its own exception
# (ZeroDivisionError) from the middle of a save; now a ConversionError naming the target.
def test_a_transform_that_raises_on_real_values_is_a_conversion_error(monkeypatch):
    _transform(monkeypatch, "a17_raiser", lambda a: a if a.dtype == np.uint8 else 1 / 0)
    out = convert(_numpy_record(0), _torch_template(),
                  rules=[Rule(r"layers\.1\.weight", "layers.1.weight", transform="a17_raiser")])
    with pytest.raises(ConversionError, match=r"layers\.1\.weight.*a17_raiser.*ZeroDivisionError"):
        out.save(NamedMpkBytesRecorder())


def test_a_transform_returning_no_array_is_refused(monkeypatch):
    _transform(monkeypatch, "a17_objects", lambda a: a if a.dtype == np.uint8 else a.astype(object))
    out = convert(_numpy_record(0), _torch_template(),
                  rules=[Rule(r"layers\.1\.bias", "layers.1.bias", transform="a17_objects")])
    with pytest.raises(ConversionError, match=r"layers\.1\.bias.*a17_objects.*object"):
        out.save(NamedMpkBytesRecorder())


# Defect 2: `read_file` trusted a registered format's reader. A reader returning something
# else than `(Header, Item)` made `trainrec verify` print OK (0 tensors) and `inspect`
# crash with an AttributeError traceback; a reader raising KeyError escaped as a
# traceback from the CLI; an item with a set in it was printed as a tree. Now the
# result is checked (a third party's tree with `check_item`) and a reader's
# non-RecorderError failure is a CorruptRecordError naming the format and the file.
def _acme(monkeypatch, tmp_path, reader):
    from trainrec import formats

    monkeypatch.setattr(formats, "_registered", [])
    formats.register_format(formats.Format("a17.acme", (".acme",), lambda h: h.startswith(b"A17\n"),
                                           reader, "trainrec_a17:Nothing"))
    path = tmp_path / "f.acme"
    path.write_bytes(b"A17\nrest")
    return path


@pytest.mark.parametrize("returned", ["text", ("text", {}), ("header", {"x": {1, 2}})])
def test_a_third_party_reader_returning_garbage_is_refused(monkeypatch, tmp_path, returned):
    from trainrec.cli import main
    from trainrec.errors import CorruptRecordError
    from trainrec.format import Header

    header = Header("a17.acme", (1, 0), "", trainrec.NativePrecisionSettings(), "X")
    got = (header, returned[1]) if returned[0] == "header" else returned
    path = _acme(monkeypatch, tmp_path, lambda p, mmap: got)
    with pytest.raises(CorruptRecordError, match=r"f\.acme"):
        trainrec.read_file(path)
    assert main(["verify", str(path)]) != 0
    assert main(["inspect", str(path)]) == 3


def test_a_third_party_reader_raising_is_a_corrupt_record_error(monkeypatch, tmp_path):
    from trainrec.cli import main
    from trainrec.errors import CorruptRecordError

    def reader(path, mmap):
        raise KeyError("boom")

    path = _acme(monkeypatch, tmp_path, reader)
    with pytest.raises(CorruptRecordError, match=r"a17.acme.*KeyError"):
        trainrec.read_file(path)
    assert main(["inspect", str(path)]) == 3
    assert main(["verify", str(path)]) != 0


# Defect 3: 0-d tensors became 1-d. `np.ascontiguousarray` returns at least one dimension,
# and the rules' plans, the conversion's reads and `ArrayApiBackend.from_host` used it: a
# scalar parameter (a learned temperature) converted by a rule was written as f32[1]
# (with its Adam moments) under a tensor that says shape [], and restored into flax as
# shape (1,); the numpy, array-api-strict and torch backends uploaded a 0-d host array
# as shape (1,).
def test_a_rule_keeps_a_0d_tensor_0d():
    plans, problems = rules_mod.plan_rules([Rule("s", "t")], {"s": ()}, {"t": ()})
    assert not problems
    assert plans["t"].fn([np.array(2.5, np.float32)]).shape == ()


def test_a_scalar_parameter_converts_as_a_scalar(monkeypatch):
    _transform(monkeypatch, "a17_keep", lambda a: a)
    plans, _ = rules_mod.plan_rules([Rule("s", "t", transform="a17_keep")], {"s": ()}, {"t": ()})
    from trainrec.convert import _apply
    from trainrec.tensor import TensorData

    out = _apply(plans["t"], [TensorData.from_array(np.array(2.5, np.float32))])
    assert out.shape == () and out.read().shape == ()


@pytest.mark.parametrize("library", ["numpy", "array_api_strict", "torch"])
def test_array_api_backend_uploads_a_0d_array_as_0d(library):
    xp = pytest.importorskip(library)
    backend = trainrec.ArrayApiBackend(xp)
    out = backend.from_host(np.array(3.0, np.float32), "cpu")
    assert tuple(out.shape) == ()
    assert backend.to_host(out).shape == ()
