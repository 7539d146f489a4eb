"""Conversion is never silent (issue 23): the optimizer's maths must match or be refused
(`use_template` takes the template's value, and the report says so), pending gradients
take the target's accumulation dtype, the caller's state comes back typed, and the
command line names its own flags. Schedules at the position: tests/test_convert.py."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
pytest.importorskip("flax.linen")
import jax.numpy as jnp  # noqa: E402
from test_convert import FlaxMLPBf16, JaxRun, K, M, S, TorchRun, batches, via_file  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
from trainrec import NamedMpkBytesRecorder, TrainingRecord  # noqa: E402
from trainrec.conversion.convert import MATHS, ConversionError, convert, convert_with_report  # noqa: E402

NATIVE = trainrec.NativePrecisionSettings()


def _bytes(record):
    return record.save(NamedMpkBytesRecorder(NATIVE))


def _torch_state(run):
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}, \
        [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in run.opt.state.values()]


# (torch optimizer, optax optimizer, the fields refused with both values)
MISMATCHES = {
    "adam-l2-into-adamw": (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.01),
                           lambda: optax.adamw(1e-2, weight_decay=0.01),
                           ["decoupled_weight_decay: the source's False, the template's True"]),
    "adamw-into-adam": (lambda p: torch.optim.AdamW(p, lr=1e-2), lambda: optax.adam(1e-2),
                        ["weight_decay: the source's 0.01, the template's 0\n"]),
    "adamw-into-adamw-default-decay": (lambda p: torch.optim.AdamW(p, lr=1e-2), lambda: optax.adamw(1e-2),
                                       ["weight_decay: the source's 0.01, the template's 0.0001"]),
    "betas": (lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99)),
              lambda: optax.adamw(1e-2, weight_decay=0.01),
              ["b1: the source's 0.8, the template's 0.9", "b2: the source's 0.99, the template's 0.999"]),
    "eps": (lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-6), lambda: optax.adamw(1e-2, weight_decay=0.01),
            ["eps: the source's 1e-06, the template's 1e-08"]),
    "lr": (lambda p: torch.optim.AdamW(p, lr=1e-3), lambda: optax.adamw(1e-2, weight_decay=0.01),
           ["lr: the source's 0.001, the template's 0.01"]),
    "clipping": (lambda p: torch.optim.AdamW(p, lr=1e-2),
                 lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.01)),
                 ["clip_norm: the source's None, the template's 1"]),
    "sgd-momentum": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), lambda: optax.sgd(0.05, momentum=0.8),
                     ["momentum: the source's 0.9, the template's 0.8"]),
    "sgd-nesterov": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                     lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
                     ["nesterov: the source's False, the template's True"]),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_optimizer_maths_that_differ_are_refused_naming_the_field_and_both_values(case):
    opt, tx, lines = MISMATCHES[case]
    x, y = batches("mlp-adamw")
    src = TorchRun("mlp-adamw")
    src.opt = opt(src.model.parameters())
    src.train(0, K, x, y)
    record = via_file(src.record(K))
    before, live = _bytes(record), _torch_state(src)
    target = JaxRun("mlp-adamw", seed=1, tx=tx()).record(0)
    template_bytes = _bytes(target)
    for force in (False, True):  # force converts what does not carry, never different maths
        with pytest.raises(ConversionError) as refused:
            convert(record, target, force=force)
        text = str(refused.value)
        assert "maths differ" in text and all(line in text for line in lines), text
        assert text.count("\n  ") == len(lines), text  # those fields, no other
    assert _bytes(record) == before and _bytes(target) == template_bytes
    state, moments = _torch_state(src)
    assert all(torch.equal(state[k], live[0][k]) for k in state)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(moments, live[1]) for k in a)
    fields = [line.split(":")[0] for line in lines]
    out, report = convert_with_report(record, target, use_template=fields)
    assert sorted(report.template_values) == sorted(fields)
    assert all("the template's" in report.template_values[f] for f in fields)
    assert [n for n in report.notes() if "the template's value is used" in n]


def test_use_template_names_fields_of_the_maths():
    src, target = TorchRun("mlp-adamw").record(0), JaxRun("mlp-adamw").record(0)
    with pytest.raises(ValueError, match=r"use_template: \['beta1'\] are not fields of the optimizer's maths"):
        convert(src, target, use_template=["beta1"])
    with pytest.raises(TypeError, match="use_template must be a list"):
        convert(src, target, use_template="eps")
    assert {"lr", "b1", "b2", "eps", "weight_decay", "decoupled_weight_decay", "clip_norm"} <= set(MATHS)


@pytest.mark.parametrize("direction", ["torch->jax", "jax->torch"])
def test_l2_weight_decay_converts_to_optax_decay_before_adam_and_continues(direction):
    """torch Adam(weight_decay) adds L2 to the gradient: optax's chain(add_decayed_weights,
    adam) does the same, and the run continues within 1e-5 (into optax.adamw it is
    refused, above: 0.26 relative off in the parameters)."""
    def torch_run(seed=0):
        run = TorchRun("mlp-adamw", seed)
        run.opt = torch.optim.Adam(run.model.parameters(), lr=1e-2, weight_decay=0.01)
        return run

    def jax_run(seed=0):
        return JaxRun("mlp-adamw", seed, tx=optax.chain(optax.add_decayed_weights(0.01), optax.adam(1e-2)))

    first, second = (torch_run, jax_run) if direction == "torch->jax" else (jax_run, torch_run)
    x, y = batches("mlp-adamw")
    ref = first()
    ref.train(0, K + M, x, y)
    src = first()
    src.train(0, K, x, y)
    dst = second(seed=1)
    dst.restore(via_file(convert(via_file(src.record(K)), dst.record(0))))
    dst.train(K, K + M, x, y)
    np.testing.assert_allclose(dst.losses, ref.losses[K:], rtol=1e-5)
    with pytest.raises(ConversionError, match="decoupled_weight_decay: the source's False, the template's True"):
        if direction == "torch->jax":
            convert(src.record(K), JaxRun("mlp-adamw", tx=optax.adamw(1e-2, weight_decay=0.01)).record(0))
        else:
            wrong = TorchRun("mlp-adamw")  # AdamW(lr=1e-2, weight_decay=0.01): decoupled
            convert(src.record(K), wrong.record(0))


def test_pending_gradients_take_the_targets_accumulation_dtype():
    """bf16 torch into an f32 flax template: parameters, moments and the pending sum come
    back f32 (it was left bf16, so the rest of the window accumulated rounded); into a
    template whose pending sum is kept in bf16, bf16; f32 into bf16 is refused unless
    allow_lossy, as parameters are."""
    x, y = batches("mlp-adamw")
    src = TorchRun("mlp-adamw")
    src.model.to(torch.bfloat16)
    src.opt = torch.optim.AdamW(src.model.parameters(), lr=1e-2)
    for i in range(K):  # the loop of TorchRun, in bf16
        out = src.model(torch.from_numpy(x[i]))
        torch.nn.functional.mse_loss(out, torch.from_numpy(y[i]).to(torch.bfloat16)).backward()
        src.acc.accumulate(src.model, trt.grads_from(src.model))
        if (i + 1) % 2 == 0:
            trt.set_grads(src.model, src.acc.grads())
            src.opt.step()
            src.opt.zero_grad(set_to_none=True)
    record = via_file(src.record(K))
    pending = record.grads.grads
    assert pending and all(t.dtype is trainrec.DType.BF16 for t in pending.values())
    target = JaxRun("mlp-adamw", tx=optax.adamw(1e-2, weight_decay=0.01)).record(0)
    out = convert(record, target)
    got = out.grads.grads
    assert got and all(t.dtype is trainrec.DType.F32 for t in got.values())
    np.testing.assert_array_equal(got["params.fc1.kernel"].array,
                                  pending["fc1.weight"].array.astype(np.float32).T)
    assert all(t.dtype is trainrec.DType.F32 for k, t in out.optimizer.item.items()
               if isinstance(t, trainrec.TensorData) and ".mu." in f".{k}")
    # a template keeping its pending sum in bf16 (f32 parameters): bf16
    bf16_pending = trainrec.GradientsParamsRecord({k: trainrec.TensorData.from_array(
        np.zeros(t.shape, t.dtype.numpy).astype(trainrec.DType.BF16.numpy)) for k, t in got.items()})
    keeps = TrainingRecord(target.model, target.optimizer, None, bf16_pending, target.into_item(NATIVE)[4], S)
    assert all(t.dtype is trainrec.DType.BF16 for t in convert(record, keeps).grads.grads.values())
    # f32 pending into a bf16 template: refused, named, unless allow_lossy
    f32 = TorchRun("mlp-adamw")
    f32.train(0, K, x, y)
    run = JaxRun("mlp-adamw")
    variables = FlaxMLPBf16().init(jax.random.PRNGKey(0), jnp.asarray(x[0]))
    run.model, tx = trainrec.adapters.jax.JaxModule(variables), optax.adamw(1e-2, weight_decay=0.01)
    run.opt = trainrec.adapters.jax.JaxOptimizer(tx, tx.init(variables["params"]))
    with pytest.raises(ConversionError, match=r"grads\.params\.fc1\.kernel \(f32 -> bf16\)"):
        convert(f32.record(K), run.record(0))
    lossy = convert(f32.record(K), run.record(0), allow_lossy=True).grads.grads
    assert all(t.dtype is trainrec.DType.BF16 for t in lossy.values())


def test_convert_returns_the_callers_state_typed():
    x, y = batches("mlp-adamw")
    src = TorchRun("mlp-adamw")
    src.train(0, K, x, y)
    target = JaxRun("mlp-adamw").record(0)
    out, report = convert_with_report(src.record(K), target)
    assert out.state.micro == K and isinstance(out.state, S) and report.state == "S"
    r = NamedMpkBytesRecorder(NATIVE)
    untyped = TrainingRecord.load(r, src.record(K).save(r))  # no state_type: the template's
    assert convert(untyped, target).state.micro == K

    @trainrec.record
    class WithRng:
        micro: int
        rng: trt.TorchRngRecord

    with_rng = TrainingRecord.capture(src.model, src.opt, None, src.acc, WithRng(K, trt.TorchRngRecord.capture()))
    out, report = convert_with_report(with_rng, target, drop_rng=True)  # None where WithRng wants a record
    assert out.state == {"micro": K, "rng": None}  # neither type rebuilds it: the report says why
    assert report.state.startswith("not ") and "WithRng (" in report.state, report.state
    assert report.state.endswith("left untyped"), report.state
    assert "not S (" in report.state


def test_the_command_line_names_its_flags(tmp_path):
    """The refusals name --use-template, --force, --lr, --allow-lossy, --drop-rng, never
    the API's spellings."""
    import json

    x, y = batches("mlp-adamw")
    src = TorchRun("mlp-adamw")
    src.opt = torch.optim.AdamW(src.model.parameters(), lr=1e-2, eps=1e-6)
    src.train(0, K, x, y)
    jax_src = JaxRun("mlp-adamw", tx=optax.adamw(optax.exponential_decay(1e-2, 1, 0.5), weight_decay=0.01))
    jax_src.train(0, K, x, y)

    def cli(tmp, source, template, *extra):
        native = trainrec.NamedMpkFileRecorder(NATIVE)
        source.save(native, tmp / "s.mpk")
        template.save(native, tmp / "t.mpk")
        return subprocess.run([sys.executable, "-m", "trainrec", "convert", str(tmp / "s.mpk"), str(tmp / "d.mpk"),
                               "--to", trainrec.conversion.convert.framework_of(template), "--template", str(tmp / "t.mpk"),
                               *extra], capture_output=True, text=True)

    tmp = tmp_path
    eps = cli(tmp, src.record(K), JaxRun("mlp-adamw", tx=optax.adamw(1e-2, weight_decay=0.01)).record(0))
    assert eps.returncode == 4 and "--use-template eps" in eps.stderr and "use_template" not in eps.stderr
    lr = cli(tmp, jax_src.record(K), TorchRun("mlp-adamw", scheduler=lambda o: torch.optim.lr_scheduler.
                                              ExponentialLR(o, 0.5)).record(0))
    assert lr.returncode == 4 and "pass --lr RATE" in lr.stderr and "lr=" not in lr.stderr, lr.stderr
    assert "--force converts anyway" in lr.stderr and "force=True" not in lr.stderr
    bad = cli(tmp, src.record(K), JaxRun("mlp-adamw").record(0), "--lr", "0.1")
    assert bad.returncode == 3 and bad.stderr.startswith("trainrec convert: --lr is for torch targets"), \
        bad.stderr
    done = cli(tmp, src.record(K), JaxRun("mlp-adamw", tx=optax.adamw(1e-2, weight_decay=0.01)).record(0),
               "--use-template", "eps", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["notes"][0].startswith("eps: the template's value is used")


SCHEDULES = {
    "warmup_cosine": lambda: optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10),
    "long_warmup_cosine": lambda: optax.warmup_cosine_decay_schedule(0.0, 1e-2, 100, 10000),
    "cosine_onecycle": lambda: optax.cosine_onecycle_schedule(6, 1e-2),
    "linear_onecycle": lambda: optax.linear_onecycle_schedule(10, 1e-2),
    "exponential_staircase": lambda: optax.exponential_decay(1e-2, 2, 0.5, staircase=True),
    "exponential_clipped": lambda: optax.exponential_decay(1e-2, 3, 0.7, transition_begin=2, end_value=3e-3),
    "piecewise_constant": lambda: optax.piecewise_constant_schedule(1e-2, {2: 0.5, 5: 0.1}),
    "constant": lambda: optax.constant_schedule(3e-3),
    "linear": lambda: optax.linear_schedule(0.0, 1e-2, 4),
    "polynomial": lambda: optax.polynomial_schedule(1e-2, 1e-4, 2, 7, 1),
    "cosine_alpha": lambda: optax.cosine_decay_schedule(1e-2, 10, alpha=0.1, exponent=2),
    "warmup_exponential": lambda: optax.warmup_exponential_decay_schedule(0.0, 1e-2, 2, 3, 0.5),
    "sgdr": lambda: optax.sgdr_schedule([dict(init_value=0.0, peak_value=1e-2, warmup_steps=2, decay_steps=4),
                                         dict(init_value=0.0, peak_value=5e-3, warmup_steps=1, decay_steps=3)]),
    "join": lambda: optax.join_schedules([optax.constant_schedule(1e-3), optax.linear_schedule(1e-3, 0.0, 5)], [3]),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_optax_schedules_are_evaluated_from_the_record_as_optax_computes_them(name):
    """The rate a JAX record's schedule gives at a count, read from its `#identity`
    without JAX: within 1e-6 of the schedule's scale of optax's float32 value (measured
    worst 7.4e-8), at every count tried; a function of the caller's is unknown."""
    from trainrec.adapters.jax.identity import identity_of
    from trainrec.adapters.jax.optax_maths import schedule_scale, schedule_value

    schedule = SCHEDULES[name]()
    spec = identity_of(optax.adam(schedule))[1]["step_size_fn"]["learning_rate"]
    scale = schedule_scale(spec)
    for count in [*range(14), 50, 99, 101, 9990, 9999, 10000, 20000]:
        got, want = schedule_value(spec, count), float(schedule(count))
        assert got is not None and abs(got - want) <= 1e-6 * scale, (count, got, want)
    mine = identity_of(optax.adam(lambda count: 1e-2))[1]["step_size_fn"]["learning_rate"]
    assert schedule_value(mine, 3) is None


def test_the_injected_factories_defaults_are_optaxs():
    import inspect

    from trainrec.adapters.jax.optax_maths import FACTORY_DEFAULTS

    for name, defaults in FACTORY_DEFAULTS.items():
        params = inspect.signature(getattr(optax, name)).parameters
        assert {k: params[k].default for k in defaults} == defaults, name
