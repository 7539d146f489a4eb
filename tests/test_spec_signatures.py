"""The signatures spec/PROTOCOLS.md writes, and the calls /work/shared/API.md (the
normative API, kept as `API` below where it is not in the repository) mandates, are the
code's (issue 31, item 6: the recorders' `timeout=` was missing from the spec).

A signature the spec writes (`DCPRecorder(*, group=None, timeout=None)`) is parsed as a
Python parameter list and compared with `inspect.signature` of the code: the same
parameters in the same order, of the same kind (positional, keyword-only, `*args`,
`**kw`), with the same defaults (`...` in the spec: some default). Every backticked
`trainrec.…(…)` signature of the spec is compared, and those written with a bare name
inside a section (`restore(model, optimizer, scheduler, device, *, allow_changes=None)`)
by the table below. A call API.md writes (`acc.load_record(rec, device)`) must bind to the
code's signature, and a default it writes must be the code's."""

from __future__ import annotations

import ast
import inspect
import re
import signal
from pathlib import Path
from typing import Any

import pytest

import trainrec

ROOT = Path(__file__).resolve().parent.parent
PROTOCOLS = ROOT / "spec" / "PROTOCOLS.md"
API_FILE = Path("/work/shared/API.md")
_ANY = object()  # `...` as a default: the spec says there is one, not which
_NAMES = {"SIGTERM": signal.SIGTERM}  # names a spec default may use


def _text(path: Path) -> str:
    """The document with its line breaks inside backticks joined (signatures wrap)."""
    return re.sub(r"\s*\n\s*", " ", path.read_text())


def _default(node: ast.expr | None) -> Any:
    if node is None:
        return inspect.Parameter.empty
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return _ANY
    return eval(compile(ast.Expression(node), "<spec>", "eval"), {"__builtins__": {}}, dict(_NAMES))  # noqa: S307


def _documented(params: str) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of a documented parameter list, `a, b=1, *, c=None, **kw`."""
    args = ast.parse(f"def _({params}): pass").body[0].args  # type: ignore[attr-defined]
    param = inspect.Parameter
    out = []
    plain = args.posonlyargs + args.args
    defaults = [None] * (len(plain) - len(args.defaults)) + list(args.defaults)
    out += [(a.arg, param.POSITIONAL_OR_KEYWORD, _default(d)) for a, d in zip(plain, defaults)]
    if args.vararg:
        out.append((args.vararg.arg, param.VAR_POSITIONAL, param.empty))
    out += [(a.arg, param.KEYWORD_ONLY, _default(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, param.VAR_KEYWORD, param.empty))
    return out


def _code(obj: Any) -> list[tuple[str, Any, Any]]:
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and not inspect.isclass(obj):
        params = params[1:]  # a method taken from its class
    kinds = {inspect.Parameter.POSITIONAL_ONLY: inspect.Parameter.POSITIONAL_OR_KEYWORD}
    return [(p.name, kinds.get(p.kind, p.kind), p.default) for p in params]


def _same_default(doc: Any, code: Any) -> bool:
    if doc is _ANY or code is Ellipsis:  # `...` in the spec, or a Protocol's stub
        return code is not inspect.Parameter.empty and doc is not inspect.Parameter.empty
    return type(doc) is type(code) and doc == code or (doc is code)


def _compare(doc: list[tuple[str, Any, Any]], code: list[tuple[str, Any, Any]]) -> list[str]:
    problems = []
    if [(n, k) for n, k, _ in doc] != [(n, k) for n, k, _ in code]:
        problems.append(f"parameters {[(n, k.name) for n, k, _ in doc]} documented, "
                        f"{[(n, k.name) for n, k, _ in code]} in the code")
    for (name, _, d), (_, _, c) in zip(doc, code):
        if not _same_default(d, c):
            problems.append(f"{name}: default {d!r} documented, {c!r} in the code")
    return problems


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = __import__(".".join(parts[:i]), fromlist=["_"])
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(dotted)


def _qualified_signatures() -> list[tuple[str, str]]:
    """Every backticked `trainrec.X(...)` the spec writes: (dotted name, parameters)."""
    found = re.findall(r"`(trainrec(?:\.\w+)+)\(([^`()]*(?:\([^`()]*\)[^`()]*)*)\)`", _text(PROTOCOLS))
    return sorted(set(found))


def test_the_spec_writes_qualified_signatures():
    names = [n for n, _ in _qualified_signatures()]
    assert "trainrec.adapters.torch.DCPRecorder" in names and "trainrec.adapters.torch.DistributedRecorder" in names


@pytest.mark.parametrize("name, params", _qualified_signatures(), ids=lambda v: v if "(" not in v else None)
def test_every_qualified_signature_of_the_spec_is_the_code_s(name, params):
    if ".torch" in name:
        pytest.importorskip("torch")
    for extra in ("accelerate", "lightning", "transformers"):
        if f".{extra}." in name + ".":
            pytest.importorskip({"lightning": "lightning.pytorch"}.get(extra, extra))
    if ".jax" in name:
        pytest.importorskip("jax")
    problems = _compare(_documented(params), _code(_resolve(name)))
    assert not problems, f"{name}({params}): " + "; ".join(problems)


# signatures the spec writes by a bare name inside a section: (the text, what it documents)
def _spec_table() -> list[tuple[str, str]]:
    return [
        ("restore(model, optimizer, scheduler, device, *, allow_changes=None)", "trainrec.TrainingRecord.restore"),
        ("capture(model, optimizer, scheduler, accumulator, state)", "trainrec.TrainingRecord.capture"),
        ("save(recorder, args=None, *, allow_lossy=False)", "trainrec.TrainingRecord.save"),
        ("load(recorder, args, device=None, *, state_type=None, **load_kw)", "trainrec.TrainingRecord.load"),
        ("from_item(item, device=None, state_type=None)", "trainrec.TrainingRecord.from_item"),
        ("into_item(settings)", "trainrec.TrainingRecord.into_item"),
        ("accumulate(module, grads)", "trainrec.GradientsAccumulator.accumulate"),
        ("accumulate_with_dtype(module, grads, dtype)", "trainrec.GradientsAccumulator.accumulate_with_dtype"),
        ("adopt(module, grads)", "trainrec.GradientsAccumulator.adopt"),
        ("load_record(record, device, *, placements=None)", "trainrec.GradientsAccumulator.load_record"),
        ("try_to_record()", "trainrec.GradientsAccumulator.try_to_record"),
        ("grads()", "trainrec.GradientsAccumulator.grads"),
        ("save(step, record, *, metrics=None, block=False)", "trainrec.CheckpointManager.save"),
        ("load(step=None, device=None, *, state_type=None)", "trainrec.CheckpointManager.load"),
        ("CheckpointManager(directory, recorder=None, *, keep_last=3, keep_every=None, best=None, read_only=False)",
         "trainrec.CheckpointManager"),
        ("record(record, args, *, allow_lossy=False)", "trainrec.Recorder.record"),
        ("load(args, device, record_type)", "trainrec.Recorder.load"),
        ('save_item(item, args, record_type="Item", *, allow_lossy=False)', "trainrec.Recorder.save_item"),
        ("load_item(args)", "trainrec.Recorder.load_item"),
        ("read(args)", "trainrec.Recorder.read"),
        ('store_tensor(t, settings, *, key="", allow_lossy=False, recorder="NamedMpkFileRecorder")',
         "trainrec.adapter_kit.store_tensor"),
        ("is_lossless(t, target)", "trainrec.is_lossless"),
        ("first_lossy(item, settings)", "trainrec.first_lossy"),
        ("restore_tensor(t, saved)", "trainrec.precision.restore_tensor"),
        ("RngRecord.capture(*generators)", "trainrec.RngRecord.capture"),
        ("apply(*generators)", "trainrec.RngRecord.apply"),
        ('load(path, model, optimizer, scheduler=None, *, state_type=None, rank_state="own", verify=True, '
         'allow_changes=None)', "trainrec.adapters.torch.DCPRecorder.load"),
        ("save(path, model, optimizer, scheduler=None, state=None, *, async_save=False)",
         "trainrec.adapters.torch.DCPRecorder.save"),
    ]


@pytest.mark.parametrize("text, target", _spec_table(), ids=[t for _, t in _spec_table()])
def test_every_signature_the_spec_writes_in_its_sections_is_the_code_s(text, target):
    assert f"`{text}" in _text(PROTOCOLS), f"spec/PROTOCOLS.md no longer writes {text}"
    if ".torch" in target:
        pytest.importorskip("torch")
    params = text[text.index("(") + 1:text.rindex(")")]
    problems = _compare(_documented(params), _code(_resolve(target)))
    assert not problems, f"{text}: " + "; ".join(problems)


# calls API.md mandates: (the text as API.md writes it, the callable); one with `*` is a
# signature, whose parameters and defaults the code has
def _api_table() -> list[tuple[str, str]]:
    return [
        ("GradientsAccumulator()", "trainrec.GradientsAccumulator"),
        ("GradientsAccumulator.new()", "trainrec.GradientsAccumulator.new"),
        ("acc.accumulate(module, grads)", "trainrec.GradientsAccumulator.accumulate"),
        ("acc.accumulate_with_dtype(module, grads, FloatDType.F32)",
         "trainrec.GradientsAccumulator.accumulate_with_dtype"),
        ("acc.try_to_record()", "trainrec.GradientsAccumulator.try_to_record"),
        ("acc.to_record_async()", "trainrec.GradientsAccumulator.to_record_async"),
        ("acc.load_record(rec, device)", "trainrec.GradientsAccumulator.load_record"),
        ("acc.grads()", "trainrec.GradientsAccumulator.grads"),
        ("TrainingRecord.capture(model, optimizer, scheduler, accumulator, state)", "trainrec.TrainingRecord.capture"),
        ("TrainingRecord.capture_async(model, optimizer, scheduler, accumulator, state)",
         "trainrec.TrainingRecord.capture_async"),
        ("rec.save(recorder, args, allow_lossy=False)", "trainrec.TrainingRecord.save"),
        ("TrainingRecord.load(recorder, args, device, state_type=MyState)", "trainrec.TrainingRecord.load"),
        ("rec.restore(model, optimizer, scheduler, device)", "trainrec.TrainingRecord.restore"),
        ("rec.into_item(settings)", "trainrec.TrainingRecord.into_item"),
        ("TrainingRecord.from_item(item, device)", "trainrec.TrainingRecord.from_item"),
        ("CheckpointManager(directory, recorder=None, *, keep_last=3, keep_every=None, best=None)",
         "trainrec.CheckpointManager"),
        ("mgr.save(step, record, *, metrics=None, block=False)", "trainrec.CheckpointManager.save"),
        ("mgr.wait()", "trainrec.CheckpointManager.wait"),
        ("mgr.steps()", "trainrec.CheckpointManager.steps"),
        ("mgr.latest_step()", "trainrec.CheckpointManager.latest_step"),
        ("mgr.load(step=None, device=None, *, state_type=None)", "trainrec.CheckpointManager.load"),
        ("NamedMpkFileRecorder(settings)", "trainrec.NamedMpkFileRecorder"),
        ("NamedMpkGzFileRecorder(settings)", "trainrec.NamedMpkGzFileRecorder"),
        ("NamedMpkBytesRecorder(settings)", "trainrec.NamedMpkBytesRecorder"),
        ("DefaultRecorder()", "trainrec.DefaultRecorder"),
        ("CompactRecorder()", "trainrec.CompactRecorder"),
        ("record(record, args)", "trainrec.Recorder.record"),
        ("load(args, device, record_type)", "trainrec.Recorder.load"),
        ("save_item(item, args)", "trainrec.Recorder.save_item"),
        ("load_item(args)", "trainrec.Recorder.load_item"),
        ("trainrec.adapt(obj)", "trainrec.adapt"),
        ("trt.grads_from(model)", "trainrec.adapters.torch.grads_from"),
        ("trt.set_grads(model, grads)", "trainrec.adapters.torch.set_grads"),
        ("trainrec.adapters.torch.TorchFileRecorder(settings)", "trainrec.adapters.torch.TorchFileRecorder"),
        ("trj.JaxModule(params)", "trainrec.adapters.jax.JaxModule"),
        ("trj.JaxOptimizer(tx, opt_state)", "trainrec.adapters.jax.JaxOptimizer"),
        ("trj.JaxLrScheduler(schedule, count=0)", "trainrec.adapters.jax.JaxLrScheduler"),
        ("trj.grads_from(grad_tree, module)", "trainrec.adapters.jax.grads_from"),
        ("trj.to_tree(grads, module)", "trainrec.adapters.jax.to_tree"),
        ("trainrec.adapters.jax.FlaxMsgpackFileRecorder(settings)", "trainrec.adapters.jax.FlaxMsgpackFileRecorder"),
    ]


@pytest.mark.skipif(not API_FILE.is_file(), reason="the normative API.md is not on this machine")
@pytest.mark.parametrize("text, target", _api_table(), ids=[t for t, _ in _api_table()])
def test_every_call_api_md_mandates_binds_to_the_code(text, target):
    assert text in _text(API_FILE), f"API.md no longer writes {text}"
    if ".torch" in target:
        pytest.importorskip("torch")
    if ".jax" in target:
        pytest.importorskip("optax")
    obj = _resolve(target)
    sig = inspect.signature(obj)
    method = not inspect.isclass(obj) and next(iter(sig.parameters), None) == "self"
    args = text[text.index("(") + 1:text.rindex(")")]
    if "*" in args:  # a signature: its parameters, of their kinds, with the defaults it names
        code = {n: (k, d) for n, k, d in _code(obj)}
        for name, kind, default in _documented(args):
            assert name in code, f"{text}: the code has no parameter {name}"
            assert code[name][0] == kind, f"{text}: {name} is {code[name][0].name} in the code"
            assert default is inspect.Parameter.empty or _same_default(default, code[name][1]), \
                f"{text}: {name}={code[name][1]!r} in the code"
        return
    call = ast.parse(f"f({args})", mode="eval").body
    assert isinstance(call, ast.Call)
    positional = [None] * (len(call.args) + method)
    sig.bind(*positional, **{k.arg: None for k in call.keywords if k.arg})


def test_the_comparison_finds_a_missing_keyword_and_a_wrong_default():
    """The check can fail: the spec's old DistributedRecorder line, and a wrong default."""
    pytest.importorskip("torch")
    import trainrec.adapters.torch as trt

    assert _compare(_documented("recorder=None, *, group=None"), _code(trt.DistributedRecorder))
    assert _compare(_documented("recorder=None, *, group=1, timeout=None"), _code(trt.DistributedRecorder))
    assert not _compare(_documented("recorder=None, *, group=None, timeout=None"), _code(trt.DistributedRecorder))
    assert _compare(_documented("model, optimizer, scheduler, device"), _code(trainrec.TrainingRecord.restore))
