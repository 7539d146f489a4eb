"""Attacks on the issue-17 work (conversion rules, neutral forms, format registry, .pt
reader): each test names the defect it found, or the claim it holds the code to."""

from __future__ import annotations

import numpy as np
import pytest

import trainrec
from trainrec import GradientsAccumulator, NamedMpkBytesRecorder, TrainingRecord
from trainrec.adapters.numpy import MLP, Adam
from trainrec.conversion import rules as rules_mod
from trainrec.conversion.convert import ConversionError, convert
from trainrec.conversion.rules import Rule


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
    from trainrec.conversion import rule_plans, rule_syntax, transforms

    tables = {"TRANSFORMS": dict(transforms.TRANSFORMS), "_SHAPES": dict(transforms._SHAPES)}
    for mod in (transforms, rule_syntax, rule_plans):  # every module that reads a table: one copy
        for key, table in tables.items():
            if hasattr(mod, key):
                monkeypatch.setattr(mod, key, table)
    rules_mod.register_transform(name, fn, shape=shape)


# Defect 1: a registered transform whose result does not have the target's shape (its
# `shape` function lies, or its shape depends on the values) was written under the
# target's name with the wrong shape: a `.msgpack` kernel [8, 8] where the template has
# [8, 2, 4], no error. Now every plan's result is checked against the target's shape.
def test_a_transform_returning_the_wrong_shape_is_refused_not_written(monkeypatch):
    _transform(monkeypatch, "a17_liar", lambda a: a.T, shape=lambda s: s)
    out = convert(_numpy_record(0), _torch_template(), use_template=["lr"],  # the numpy run's rate is code
                  rules=[Rule(r"layers\.0\.weight", "layers.0.weight", transform="a17_liar")])
    with pytest.raises(ConversionError, match=r"layers\.0\.weight.*a17_liar.*\[4, 8\].*\[8, 4\]"):
        out.save(NamedMpkBytesRecorder())


def test_a_transform_whose_shape_depends_on_the_values_is_refused(monkeypatch):
    _transform(monkeypatch, "a17_datadep", lambda a: a if a.dtype == np.uint8 else a[1:])
    out = convert(_numpy_record(0), _torch_template(), use_template=["lr"],  # the numpy run's rate is code
                  rules=[Rule(r"layers\.0\.bias", "layers.0.bias", transform="a17_datadep")])
    # the shape probe (a uint8 array) sees the right shape; real values lose an element
    with pytest.raises(ConversionError, match=r"layers\.0\.bias.*a17_datadep"):
        out.save(NamedMpkBytesRecorder())


# Defect 1b: a transform that raises on real values escaped as its own exception
# (ZeroDivisionError) from the middle of a save; now a ConversionError naming the target.
def test_a_transform_that_raises_on_real_values_is_a_conversion_error(monkeypatch):
    _transform(monkeypatch, "a17_raiser", lambda a: a if a.dtype == np.uint8 else 1 / 0)
    out = convert(_numpy_record(0), _torch_template(), use_template=["lr"],  # the numpy run's rate is code
                  rules=[Rule(r"layers\.1\.weight", "layers.1.weight", transform="a17_raiser")])
    with pytest.raises(ConversionError, match=r"layers\.1\.weight.*a17_raiser.*ZeroDivisionError"):
        out.save(NamedMpkBytesRecorder())


def test_a_transform_returning_no_array_is_refused(monkeypatch):
    _transform(monkeypatch, "a17_objects", lambda a: a if a.dtype == np.uint8 else a.astype(object))
    out = convert(_numpy_record(0), _torch_template(), use_template=["lr"],  # the numpy run's rate is code
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
    from trainrec.recorders import formats

    monkeypatch.setattr(formats, "_registered", [])
    formats.register_format(formats.Format("a17.acme", (".acme",), lambda h: h.startswith(b"A17\n"),
                                           reader, "trainrec_a17:Nothing"))
    path = tmp_path / "f.acme"
    path.write_bytes(b"A17\nrest")
    return path


@pytest.mark.parametrize("returned", ["text", ("text", {}), ("header", {"x": {1, 2}})])
def test_a_third_party_reader_returning_garbage_is_refused(monkeypatch, tmp_path, returned):
    from trainrec.cli.commands import main
    from trainrec.errors import CorruptRecordError
    from trainrec.format.header import Header

    header = Header("a17.acme", (1, 0), "", trainrec.NativePrecisionSettings(), "X")
    got = (header, returned[1]) if returned[0] == "header" else returned
    path = _acme(monkeypatch, tmp_path, lambda p, mmap: got)
    with pytest.raises(CorruptRecordError, match=r"f\.acme"):
        trainrec.read_file(path)
    assert main(["verify", str(path)]) != 0
    assert main(["inspect", str(path)]) == 3


def test_a_third_party_reader_raising_is_a_corrupt_record_error(monkeypatch, tmp_path):
    from trainrec.cli.commands import main
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
    from trainrec.conversion.convert import _apply
    from trainrec.items.tensor import TensorData

    out = _apply(plans["t"], [TensorData.from_array(np.array(2.5, np.float32))])
    assert out.shape == () and out.read().shape == ()


@pytest.mark.parametrize("library", ["numpy", "array_api_strict", "torch"])
def test_array_api_backend_uploads_a_0d_array_as_0d(library):
    xp = pytest.importorskip(library)
    backend = trainrec.ArrayApiBackend(xp)
    out = backend.from_host(np.array(3.0, np.float32), "cpu")
    assert tuple(out.shape) == ()
    assert backend.to_host(out).shape == ()


# A new adapter author's neutral form, written from spec/ADAPTERS.md section 8 alone, with
# only `trainrec` and `trainrec.adapter_kit` imports: a toy framework whose dense layers
# keep `W` as [in, out] and `b`, under Adam (`count`, `m`, `v`). Converted to torch with
# no edit to trainrec: torch's `weight` is `W` transposed, moments included.
def test_a_toy_framework_form_written_from_the_guide_converts_to_torch_and_back(monkeypatch):
    pytest.importorskip("torch")
    from trainrec import StateRecord, TensorData
    from trainrec.adapter_kit import (
        GradientsParamsRecord,
        Neutral,
        NeutralOptimizer,
        as_count,
        as_map,
        register_neutral_form,
        tensors_of,
    )
    from trainrec.conversion import form_registry

    class ToyForm:
        name, kinds, keeps_rate, rng_markers = "toyfw", ("toyfw",), False, frozenset()

        def parameters(self, model, role):
            return tensors_of(model.item, f"{role}.model")

        def candidates(self, name, shape):
            path, _, leaf = name.rpartition(".")
            return {"W": [Neutral(path, "dense.kernel")], "b": [Neutral(path, "bias")]}.get(leaf, [])

        def preset_rules(self, source, target):
            return []

        def read_optimizer(self, record, role, force):
            item = as_map(record.optimizer.item, f"{role}.optimizer")
            m, v = tensors_of(item["m"], f"{role}.optimizer.m"), tensors_of(item["v"], f"{role}.optimizer.v")
            maths = {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "clip_norm": None, "clip_value": None}
            return NeutralOptimizer("adam", as_count(item["count"], f"{role}.optimizer.count"),
                                    {p: {"first_moment": m[p], "second_moment": v[p]} for p in m}, maths,
                                    unknown={"lr": "the toy framework's rate is its caller's"})

        def read_schedule(self, record, role, problems):
            return []

        def write_model(self, template, params):
            return {k: params.get(k, t) for k, t in as_map(template.item, "template.model").items()}

        def write_state(self, template, state):
            names = self.parameters(template.model, "template")
            item = as_map(template.optimizer.item, "template.optimizer")
            out = {"count": state.step, "m": dict(item["m"]), "v": dict(item["v"])}
            for p, like in names.items():
                for key, which in (("m", "first_moment"), ("v", "second_moment")):
                    got = state.moment(p, which, like, f"optimizer.{key}.{p}")
                    if got is not None:
                        out[key][p] = got
            return out, None

    monkeypatch.setattr(form_registry, "_registered", list(form_registry._registered))
    register_neutral_form(ToyForm())
    rng = np.random.default_rng(0)
    shapes = {"layers.0.W": (4, 8), "layers.0.b": (8,), "layers.1.W": (8, 3), "layers.1.b": (3,)}

    def toy_record(count, fill):
        arrays = {k: TensorData.from_array(fill(s)) for k, s in shapes.items()}
        moments = {key: {k: TensorData.from_array(fill(s)) for k, s in shapes.items()} for key in "mv"}
        return TrainingRecord(StateRecord("toyfw.MLP", arrays),
                              StateRecord("toyfw.Adam", {"count": count, **moments}),
                              None, GradientsParamsRecord({}), {"micro": 0})

    src = toy_record(3, lambda s: np.abs(rng.normal(size=s)).astype(np.float32))
    torch_tpl = _torch_template()
    out = convert(src, torch_tpl, use_template=["lr"])
    tensors = dict(out.model.item["tensors"]) if "tensors" in out.model.item else out.model.item
    w = src.model.item["layers.0.W"].read()
    assert np.array_equal(tensors["layers.0.weight"].read(), w.T)
    back = convert(out, toy_record(0, lambda s: np.zeros(s, np.float32)), use_template=["lr"])
    for k in shapes:
        assert np.array_equal(back.model.item[k].read(), src.model.item[k].read()), k
        for key in "mv":
            assert np.array_equal(back.optimizer.item[key][k].read(), src.optimizer.item[key][k].read()), k
    assert back.optimizer.item["count"] == 3


# Defect 4 (not fixed): a rule's regular expression is matched by Python's `re` with no
# time bound, against source names that come from the (possibly untrusted) record: a
# user's pattern with nested quantifiers backtracks exponentially on a crafted name
# (`(a+)+b` on 40 `a`s takes hours). Python's `re` has no timeout; a fix needs a linear
# engine (`re2`) or a bound on patterns. Documented in spec/CONVERSION.md ("Refusals").
@pytest.mark.xfail(strict=True, reason="regex matching of rules has no time bound (ReDoS)")
def test_a_rule_with_nested_quantifiers_is_bounded_in_time():
    import subprocess
    import sys

    code = ("from trainrec.conversion.rules import Rule, plan_rules\n"
            "plan_rules([Rule('(a+)+b', 't')], {'a' * 40: (1,)}, {'t': (1,)})\n")
    try:
        subprocess.run([sys.executable, "-c", code], timeout=5, check=True)
    except subprocess.TimeoutExpired:
        pytest.fail("plan_rules ran for more than 5 s on a 40-character name")


# Defect 5: `trainrec convert --to mpk` (a re-encoding) silently ignored the conversion's
# options: `--rules` (even a malformed file), `--template`, `--lr`, `--force`,
# `--drop-rng`, `--allow-lossy` all exited 0 having done nothing with them. Now exit 2
# naming them.
@pytest.mark.parametrize("extra", [["--rules", "{rules}"], ["--rules", "attention"], ["--template", "{src}"],
                                   ["--lr", "0.1"], ["--force"], ["--drop-rng"], ["--allow-lossy"],
                                   ["--map", "{rules}"]])
def test_convert_to_mpk_refuses_the_conversion_options(tmp_path, capsys, extra):
    from trainrec.cli.commands import main

    src = tmp_path / "a.mpk"
    _numpy_record(0).save(trainrec.DefaultRecorder(), src)
    rules = tmp_path / "bad.json"
    rules.write_text('{"rules": [{"match": "("}]}')
    args = [a.format(rules=rules, src=src) for a in extra]
    assert main(["convert", str(src), str(tmp_path / "b.mpk"), "--to", "mpk", *args]) == 2
    assert extra[0] in capsys.readouterr().err
    assert not (tmp_path / "b.mpk").exists()
    assert main(["convert", str(src), str(tmp_path / "b.mpk"), "--to", "mpk"]) == 0


# Defect 6: a rules file nested deeply (`[[[...]]]`) ended the CLI in a RecursionError
# traceback; a file that is not UTF-8 was refused without naming the file.
def test_a_deeply_nested_or_binary_rules_file_is_refused_naming_it(tmp_path, capsys):
    from trainrec.conversion.rules import load_rules

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match="deep.json"):
        load_rules(deep)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="binary.json"):
        load_rules(binary)


# Defect 7: a registered transform whose `shape` function returns no shape (an int) made
# `plan_rules` raise TypeError ("'int' object is not iterable") instead of stating the
# problem with the rule.
def test_a_transform_shape_function_returning_no_shape_is_a_problem(monkeypatch):
    _transform(monkeypatch, "a17_badshape", lambda a: a, shape=lambda s: 5)
    plans, problems = rules_mod.plan_rules([Rule("a", "t", transform="a17_badshape")], {"a": (2,)}, {"t": (2,)})
    assert not plans and len(problems) == 1 and "a17_badshape" in problems[0]


# Defect 8: `trainrec inspect` on a plain `torch.save(model.state_dict())` file said only
# "SETITEM on _Hooks, not a dict (pickle byte 234)": a new user reading README ("`.pt` ...
# files are all read without torch") could not tell that only TorchFileRecorder's `.pt`
# files are read. Now the message says what the file is and what reads it.
def test_a_plain_torch_save_file_is_refused_saying_what_it_is(tmp_path):
    torch = pytest.importorskip("torch")
    from trainrec.errors import CorruptRecordError

    path = tmp_path / "plain.pt"
    torch.save(torch.nn.Linear(2, 3).state_dict(), path)
    with pytest.raises(CorruptRecordError, match=r"not a trainrec \.pt record.*TorchFileRecorder.*torch\.load"):
        trainrec.read_file(path)


# Defect 9: `convert(..., rules="attention")` (a preset's name, as `--rules` takes it), a
# single `Rule`, or a list holding something else failed deep inside the engine with
# AttributeError / "'Rule' object is not iterable". Now a TypeError saying what to pass.
@pytest.mark.parametrize("rules", ["attention", Rule("a", "b"), [Rule("a", "b"), "attention"]])
def test_convert_refuses_rules_that_are_not_a_list_of_rules(rules):
    with pytest.raises(TypeError, match="load_rules"):
        convert(_numpy_record(0), _numpy_record(1), rules=rules)
