"""Conversion through neutral forms: the numpy reference adapter and the third-party
array-api-strict adapter (whose form is found only through its entry point) convert to
and from torch and JAX with no edit to core. Each run stops mid-window, converts,
continues in the other framework, and its losses and parameters match an uninterrupted
run of the first (1e-5 relative)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import trainrec
from trainrec import GradientsAccumulator, GradientsParams, NamedMpkBytesRecorder, TrainingRecord
from trainrec.adapters.numpy import MLP, SGD, Adam, AdamW, LinearWarmupCosineLr, StepLr
from trainrec.conversion.convert import (
    ConversionError,
    Neutral,
    convert,
    form_for,
    framework_of,
    register_neutral_form,
)

WINDOW, K, M = 2, 5, 8  # stop after micro-step 5: one gradient pending
SIZES = (4, 8, 3)
PEAK, WARM, TOTAL = 1e-2, 2, 8


@trainrec.record
class S:
    micro: int


def via_file(record):
    r = NamedMpkBytesRecorder(trainrec.NativePrecisionSettings())
    return TrainingRecord.load(r, record.save(r), state_type=S)


def batches(n_in=SIZES[0], n_out=SIZES[-1]):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(K + M, 6, n_in)).astype(np.float32),
            rng.normal(size=(K + M, 6, n_out)).astype(np.float32))


def rate(count):
    return LinearWarmupCosineLr(PEAK, WARM, TOTAL).lr_at(count)


# -- numpy reference runs ----------------------------------------------------------------------


class NumpyRun:
    def __init__(self, opt="adamw", seed=0, scheduler=True):
        self.model = MLP(SIZES, seed=seed)
        self.opt = {"adamw": AdamW, "adam": Adam, "sgd": lambda: SGD(momentum=0.9)}[opt]()
        self.sched = LinearWarmupCosineLr(PEAK, WARM, TOTAL) if scheduler else None
        self.acc, self.losses = GradientsAccumulator(), []

    def train(self, start, stop, x, y):
        for i in range(start, stop):
            loss, grads = self.model.loss_and_grads(x[i], y[i])
            self.losses.append(loss)
            self.acc.accumulate(self.model, grads)
            if (i + 1) % WINDOW == 0:
                g = self.acc.grads()
                self.opt.step(self.sched.step(), self.model, GradientsParams({k: v / WINDOW for k, v in g.items()}))

    def record(self, micro):
        return TrainingRecord.capture(self.model, self.opt, self.sched, self.acc, S(micro))

    def restore(self, record):
        self.acc = record.restore(self.model, self.opt, self.sched, "cpu").accumulator


def test_numpy_records_claim_the_reference_form_through_its_entry_point():
    assert framework_of(NumpyRun().record(0)) == "trainrec.numpy"


def test_a_record_no_form_claims_names_its_kinds_and_how_to_register_one():
    record = NumpyRun().record(0)
    alien = TrainingRecord(trainrec.StateRecord("alien.Net", {}), record.optimizer, record.scheduler,
                           record.grads, record.state, None)
    with pytest.raises(ConversionError) as e:
        convert(alien, record)
    for said in ("'alien.Net'", "'trainrec.numpy.AdamW'", "register_neutral_form", "trainrec.neutral"):
        assert said in str(e.value)
    with pytest.raises(ConversionError, match="nothing to convert"):
        convert(record, NumpyRun(seed=1).record(0))
    with pytest.raises(TypeError, match="neutral form"):
        register_neutral_form(object())  # type: ignore[arg-type]


def test_a_registered_form_claims_before_entry_points(monkeypatch):
    from trainrec.adapters.numpy.neutral import NumpyForm
    from trainrec.conversion import form_registry

    class Mine(NumpyForm):
        name = "mine"

    monkeypatch.setattr(form_registry, "_registered", [])
    register_neutral_form(Mine())
    assert framework_of(NumpyRun().record(0)) == "mine"


def test_neutral_layouts_round_trip():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    attention = Neutral("attn.query", "dense.kernel", shape=(2, 12))
    assert attention.neutral_shape(a.shape) == (2, 12)
    np.testing.assert_array_equal(attention.from_neutral(attention.to_neutral(a), a.shape), a)
    conv = Neutral("conv", "conv.kernel", (2, 1, 0))
    assert conv.neutral_shape((5, 4, 3)) == (3, 4, 5)
    b = np.arange(60).reshape(5, 4, 3)
    np.testing.assert_array_equal(conv.from_neutral(conv.to_neutral(b), b.shape), b)
    with pytest.raises(ValueError, match="unknown neutral role"):
        Neutral("x", "kernel")


# -- numpy <-> torch and flax/optax ------------------------------------------------------------


def _torch():
    torch = pytest.importorskip("torch")
    import trainrec.adapters.torch as trt

    class TorchMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Linear(SIZES[1], SIZES[2])])

        def forward(self, x):
            return self.layers[1](torch.relu(self.layers[0](x)))

    class TorchRun:
        def __init__(self, opt="adamw", seed=1):
            torch.manual_seed(seed)
            self.model = TorchMLP()
            p = self.model.parameters()
            self.opt = {"adamw": lambda: torch.optim.AdamW(p, lr=PEAK, eps=1e-8, weight_decay=1e-2),
                        "adam": lambda: torch.optim.Adam(p, lr=PEAK),
                        "sgd": lambda: torch.optim.SGD(p, lr=PEAK, momentum=0.9)}[opt]()
            self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda n: rate(n) / PEAK)
            self.acc, self.losses = GradientsAccumulator(), []

        def train(self, start, stop, x, y):
            for i in range(start, stop):
                loss = torch.nn.functional.mse_loss(self.model(torch.from_numpy(x[i])), torch.from_numpy(y[i]))
                loss.backward()
                self.losses.append(loss.item())
                self.acc.accumulate(self.model, trt.grads_from(self.model))
                if (i + 1) % WINDOW == 0:
                    g = self.acc.grads()
                    trt.set_grads(self.model, GradientsParams({k: v / WINDOW for k, v in g.items()}))
                    self.opt.step()
                    self.opt.zero_grad(set_to_none=True)
                    self.sched.step()

        def record(self, micro):
            return TrainingRecord.capture(self.model, self.opt, self.sched, self.acc, S(micro))

        def restore(self, record):
            self.acc = record.restore(self.model, self.opt, self.sched, "cpu").accumulator

        def params(self):
            return {k: v.detach().numpy() for k, v in self.model.state_dict().items()}

    return TorchRun


def _jax():
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    fnn = pytest.importorskip("flax.linen")
    import jax.numpy as jnp

    import trainrec.adapters.jax as trj

    class FlaxMLP(fnn.Module):
        def setup(self):
            self.layers = [fnn.Dense(SIZES[1]), fnn.Dense(SIZES[2])]  # flax names them layers_0, layers_1

        def __call__(self, x):
            return self.layers[1](fnn.relu(self.layers[0](x)))

    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK, WARM, TOTAL)  # the record holds its constants

    class JaxRun:
        def __init__(self, opt="adamw", seed=1):
            self.net = FlaxMLP()
            variables = self.net.init(jax.random.PRNGKey(seed), jnp.zeros((1, SIZES[0])))
            self.model = trj.JaxModule(variables)
            tx = {"adamw": lambda: optax.adamw(schedule, eps=1e-8, weight_decay=1e-2),
                  "adam": lambda: optax.adam(schedule),
                  "sgd": lambda: optax.sgd(schedule, momentum=0.9)}[opt]()
            self.opt = trj.JaxOptimizer(tx, tx.init(variables["params"]))
            self.acc, self.losses = GradientsAccumulator(), []

        def train(self, start, stop, x, y):
            def loss_fn(p, xb, yb):
                return jnp.mean((self.net.apply({"params": p}, xb) - yb) ** 2)

            for i in range(start, stop):
                loss, g = jax.value_and_grad(loss_fn)(self.model.params["params"], jnp.asarray(x[i]),
                                                      jnp.asarray(y[i]))
                self.losses.append(float(loss))
                self.acc.accumulate(self.model, trj.grads_from(g, self.model))
                if (i + 1) % WINDOW == 0:
                    g = self.acc.grads()
                    tree = trj.to_tree(GradientsParams({k: v / WINDOW for k, v in g.items()}), self.model)
                    params = self.model.params["params"]
                    updates, self.opt.opt_state = self.opt.tx.update(tree, self.opt.opt_state, params)
                    self.model.params = {"params": optax.apply_updates(params, updates)}

        def record(self, micro):
            return TrainingRecord.capture(self.model, self.opt, None, self.acc, S(micro))

        def restore(self, record):
            self.acc = record.restore(self.model, self.opt, None, "cpu").accumulator

        def params(self):
            p = self.model.params["params"]
            return {f"layers.{i}.{leaf}": np.asarray(p[f"layers_{i}"][leaf]).T if leaf == "kernel"
                    else np.asarray(p[f"layers_{i}"][leaf]) for i in range(2) for leaf in ("kernel", "bias")}

    return JaxRun


def _native(kind):
    """A flax nnx (`nnx.Optimizer`) or equinox (optax `JaxOptimizer`) run of the numpy MLP:
    parameters `layers.{i}.kernel` / `layers.{i}.weight`, recorded as they are."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    import trainrec.adapters.jax as trj

    schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK, WARM, TOTAL)  # the record holds its constants

    def make_tx(opt):
        return {"adamw": lambda: optax.adamw(schedule, eps=1e-8, weight_decay=1e-2),
                "adam": lambda: optax.adam(schedule)}[opt]()

    if kind == "nnx":
        nnx = pytest.importorskip("flax.nnx")

        class NnxMLP(nnx.Module):
            def __init__(self, rngs):
                self.layers = nnx.List([nnx.Linear(SIZES[0], SIZES[1], rngs=rngs),
                                        nnx.Linear(SIZES[1], SIZES[2], rngs=rngs)])

            def __call__(self, x):
                return self.layers[1](jax.nn.relu(self.layers[0](x)))

        def build(opt, seed):
            model = NnxMLP(nnx.Rngs(seed))
            return model, nnx.Optimizer(model, make_tx(opt), wrt=nnx.Param)

        def step(run, grads):
            run.opt.update(run.model, grads)

        def params(model):
            return {f"layers.{i}.{leaf}": np.asarray(getattr(model.layers[i], name)[...]).T if name == "kernel"
                    else np.asarray(getattr(model.layers[i], name)[...])
                    for i in range(2) for leaf, name in (("weight", "kernel"), ("bias", "bias"))}
    else:
        eqx = pytest.importorskip("equinox")

        class EqxMLP(eqx.Module):
            layers: list

            def __init__(self, key):
                k0, k1 = jax.random.split(key)
                self.layers = [eqx.nn.Linear(SIZES[0], SIZES[1], key=k0), eqx.nn.Linear(SIZES[1], SIZES[2], key=k1)]

            def __call__(self, x):
                return jax.vmap(lambda v: self.layers[1](jax.nn.relu(self.layers[0](v))))(x)

        def build(opt, seed):
            model = EqxMLP(jax.random.key(seed))
            tx = make_tx(opt)
            return model, trj.JaxOptimizer(tx, tx.init(eqx.filter(model, eqx.is_inexact_array)))

        def step(run, grads):
            params = eqx.filter(run.model, eqx.is_inexact_array)
            updates, run.opt.opt_state = run.opt.tx.update(grads, run.opt.opt_state, params)
            run.model = eqx.apply_updates(run.model, updates)

        def params(model):
            return {f"layers.{i}.{leaf}": np.asarray(getattr(model.layers[i], leaf)) for i in range(2)
                    for leaf in ("weight", "bias")}

    def mse(model, xb, yb):
        return jnp.mean((model(xb) - yb) ** 2)

    class NativeRun:
        def __init__(self, opt="adamw", seed=1):
            self.model, self.opt = build(opt, seed)
            self.acc, self.losses = GradientsAccumulator(), []

        def train(self, start, stop, x, y):
            for i in range(start, stop):
                value_and_grad = nnx.value_and_grad if kind == "nnx" else eqx.filter_value_and_grad
                loss, g = value_and_grad(mse)(self.model, jnp.asarray(x[i]), jnp.asarray(y[i]))
                self.losses.append(float(loss))
                self.acc.accumulate(self.model, trj.grads_from(g, self.model))
                if (i + 1) % WINDOW == 0:
                    g = self.acc.grads()
                    step(self, trj.to_tree(GradientsParams({k: v / WINDOW for k, v in g.items()}), self.model))

        def record(self, micro):
            return TrainingRecord.capture(self.model, self.opt, None, self.acc, S(micro))

        def restore(self, record):
            restored = record.restore(self.model, self.opt, None, "cpu")
            self.model, self.acc = restored.model, restored.accumulator

        def params(self):
            return params(self.model)

    return NativeRun


# numpy's SGD keeps no step count, so into optax's sgd(schedule), which counts updates, it
# is refused unless forced (test_an_sgd_without_a_step_count_...)
@pytest.mark.parametrize(("other", "opt"), [("torch", "adamw"), ("torch", "adam"), ("torch", "sgd"),
                                            ("jax", "adamw"), ("jax", "adam"), ("nnx", "adamw"),
                                            ("equinox", "adam")])
def test_numpy_run_continues_in_torch_and_jax_and_back(other, opt):
    other_run = {"torch": _torch, "jax": _jax}.get(other, functools.partial(_native, other))()
    x, y = batches()
    ref = NumpyRun(opt)
    ref.train(0, K + M, x, y)
    src = NumpyRun(opt)
    src.train(0, K, x, y)
    dst = other_run(opt)
    converted = via_file(convert(via_file(src.record(K)), dst.record(0)))  # numpy's rate needs no lr=
    assert converted.grads.grads, "the pending gradient is carried over"
    dst.restore(converted)
    middle = K + 3  # stop again mid-window
    dst.train(K, middle, x, y)
    np.testing.assert_allclose(dst.losses, ref.losses[K:middle], rtol=1e-5)
    back = NumpyRun(opt, seed=2)
    back.restore(via_file(convert(via_file(dst.record(middle)), back.record(0))))
    back.train(middle, K + M, x, y)
    np.testing.assert_allclose(back.losses, ref.losses[middle:], rtol=1e-5)
    for k, v in ref.model.params.items():
        np.testing.assert_allclose(back.model.params[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    if other in ("torch", "nnx", "equinox"):
        ahead = other_run(opt)
        ahead.restore(convert(via_file(ref.record(K + M)), ahead.record(0)))
        for k, v in ahead.params().items():
            np.testing.assert_allclose(v, ref.model.params[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_numpy_optimizer_maths_without_a_counterpart_are_refused_unless_the_template_value_is_asked_for():
    jax_run = _jax()
    x, y = batches()
    src = NumpyRun("sgd")
    src.opt = SGD(momentum=0.9, dampening=0.5)
    src.train(0, K, x, y)
    for force in (False, True):
        with pytest.raises(ConversionError, match="dampening: the source's 0.5, the template's 0"):
            convert(src.record(K), jax_run("sgd").record(0), force=force)
    convert(src.record(K), jax_run("sgd").record(0), use_template=["dampening"], force=True)  # SGD: no step count
    adamw = NumpyRun("adamw")
    adamw.train(0, K, x, y)
    with pytest.raises(ConversionError, match="source optimizer keeps adam state"):
        convert(adamw.record(K), jax_run("sgd").record(0))
    with pytest.raises(ValueError, match="lr is for torch targets"):
        convert(jax_run("adamw").record(0), NumpyRun().record(0), lr=0.1)


def test_a_numpy_schedule_position_without_a_place_is_refused_unless_forced():
    torch_run = _torch()
    x, y = batches()
    src = NumpyRun("adamw")
    src.sched = StepLr(PEAK, 2)
    src.train(0, K, x, y)
    target = torch_run("adamw")
    target.sched = None
    template = TrainingRecord.capture(target.model, target.opt, None, target.acc, S(0))
    with pytest.raises(ConversionError, match="schedule does not carry over"):
        convert(src.record(K), template)
    convert(src.record(K), template, force=True)


# -- the array-api-strict third-party adapter ----------------------------------------------------


def _strict():
    xp = pytest.importorskip("array_api_strict")
    strict = pytest.importorskip("trainrec_arraystrict")
    lr, every, gamma = 0.05, 2, 0.5

    class StrictRun:
        def __init__(self, seed=0):
            self.model, self.opt = strict.Linear(5, 3, seed), strict.SGD(0.9)
            self.sched = strict.StepSchedule(lr, every, gamma)
            self.acc, self.losses = GradientsAccumulator(), []

        def train(self, start, stop, x, y):
            for i in range(start, stop):
                loss, grads = self.model.loss_and_grads(xp.asarray(x[i]), xp.asarray(y[i]))
                self.losses.append(loss)
                self.acc.accumulate(self.model, grads)
                if (i + 1) % WINDOW == 0:
                    g = self.acc.grads()
                    self.opt.step(self.sched.step(), self.model, GradientsParams({k: v / WINDOW for k, v in g.items()}))

        def record(self, micro):
            return TrainingRecord.capture(self.model, self.opt, self.sched, self.acc, S(micro))

        def restore(self, record):
            self.acc = record.restore(self.model, self.opt, self.sched, "cpu").accumulator

    return StrictRun, (lr, every, gamma)


def _strict_torch(lr, every, gamma):
    torch = pytest.importorskip("torch")
    import trainrec.adapters.torch as trt

    class TorchLinear:
        def __init__(self, seed=1):
            torch.manual_seed(seed)
            self.model = torch.nn.Linear(5, 3)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, every, gamma)
            self.acc, self.losses = GradientsAccumulator(), []

        def train(self, start, stop, x, y):
            for i in range(start, stop):
                loss = torch.nn.functional.mse_loss(self.model(torch.from_numpy(x[i])), torch.from_numpy(y[i]))
                loss.backward()
                self.losses.append(loss.item())
                self.acc.accumulate(self.model, trt.grads_from(self.model))
                if (i + 1) % WINDOW == 0:
                    g = self.acc.grads()
                    trt.set_grads(self.model, GradientsParams({k: v / WINDOW for k, v in g.items()}))
                    self.opt.step()
                    self.opt.zero_grad(set_to_none=True)
                    self.sched.step()

        def record(self, micro):
            return TrainingRecord.capture(self.model, self.opt, self.sched, self.acc, S(micro))

        def restore(self, record):
            self.acc = record.restore(self.model, self.opt, self.sched, "cpu").accumulator

    return TorchLinear


def _strict_jax(lr, every, gamma):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    import trainrec.adapters.jax as trj

    class JaxLinear:
        """A linear model as a plain pytree; optax's sgd with its rate from a JaxLrScheduler."""

        def __init__(self, seed=1):
            key = jax.random.PRNGKey(seed)
            self.model = trj.JaxModule({"params": {"kernel": jax.random.normal(key, (5, 3)),
                                                   "bias": jnp.zeros((3,))}})
            tx = optax.sgd(1.0, momentum=0.9)
            self.opt = trj.JaxOptimizer(tx, tx.init(self.model.params["params"]))
            self.sched = trj.JaxLrScheduler(optax.exponential_decay(lr, every, gamma, staircase=True))
            self.acc, self.losses = GradientsAccumulator(), []

        def train(self, start, stop, x, y):
            def loss_fn(p, xb, yb):
                return jnp.mean((xb @ p["kernel"] + p["bias"] - yb) ** 2)

            for i in range(start, stop):
                loss, g = jax.value_and_grad(loss_fn)(self.model.params["params"], jnp.asarray(x[i]),
                                                      jnp.asarray(y[i]))
                self.losses.append(float(loss))
                self.acc.accumulate(self.model, trj.grads_from(g, self.model))
                if (i + 1) % WINDOW == 0:
                    g = self.acc.grads()
                    tree = trj.to_tree(GradientsParams({k: v / WINDOW for k, v in g.items()}), self.model)
                    params = self.model.params["params"]
                    updates, self.opt.opt_state = self.opt.tx.update(tree, self.opt.opt_state, params)
                    scaled = jax.tree_util.tree_map(functools.partial(jnp.multiply, self.sched.step()), updates)
                    self.model.params = {"params": optax.apply_updates(params, scaled)}

        def record(self, micro):
            return TrainingRecord.capture(self.model, self.opt, self.sched, self.acc, S(micro))

        def restore(self, record):
            self.acc = record.restore(self.model, self.opt, self.sched, "cpu").accumulator

    return JaxLinear


@pytest.mark.parametrize("other", ["torch", "jax"])
def test_third_party_arraystrict_run_continues_in_torch_and_jax_and_back(other):
    strict_run, (lr, every, gamma) = _strict()
    other_run = (_strict_torch if other == "torch" else _strict_jax)(lr, every, gamma)
    x, y = batches(5, 3)
    ref = strict_run()
    ref.train(0, K + M, x, y)
    src = strict_run()
    src.train(0, K, x, y)
    record = via_file(src.record(K))
    assert framework_of(record) == "arraystrict" and type(form_for(record)).__module__ == "trainrec_arraystrict.neutral"
    dst = other_run()
    position = K // WINDOW
    rate = lr * gamma ** (position // every)  # the schedule is code: a torch target is told its rate
    # its rate is not in its record: a torch target is told it (unchecked), a JAX one applies
    # a JaxLrScheduler's rate in the caller's code, which nothing can check
    converted = convert(record, dst.record(0), lr=rate) if other == "torch" else \
        convert(record, dst.record(0), use_template=["lr"])
    dst.restore(via_file(converted))
    middle = K + 3
    dst.train(K, middle, x, y)
    np.testing.assert_allclose(dst.losses, ref.losses[K:middle], rtol=1e-5)
    back = strict_run(seed=2)
    back.restore(via_file(convert(via_file(dst.record(middle)), back.record(0), use_template=["lr"])))
    back.train(middle, K + M, x, y)
    np.testing.assert_allclose(back.losses, ref.losses[middle:], rtol=1e-5)
    for k, v in ref.model.params.items():
        np.testing.assert_allclose(np.asarray(back.model.params[k]), np.asarray(v), rtol=1e-5, atol=1e-6)


def test_an_sgd_without_a_step_count_into_a_schedule_counting_updates_is_refused_unless_forced():
    """array-api-strict's SGD keeps no step count: whether its schedule was stepped once
    per update cannot be shown, and optax's schedule inside the optimizer counts updates."""
    strict_run, (lr, every, gamma) = _strict()
    optax = pytest.importorskip("optax")
    import trainrec.adapters.jax as trj

    jax_linear = _strict_jax(lr, every, gamma)
    x, y = batches(5, 3)
    src = strict_run()
    src.train(0, K, x, y)
    dst = jax_linear()
    tx = optax.sgd(optax.exponential_decay(lr, every, gamma, staircase=True), momentum=0.9)
    dst.opt = trj.JaxOptimizer(tx, tx.init(dst.model.params["params"]))
    template = TrainingRecord.capture(dst.model, dst.opt, None, dst.acc, S(0))
    with pytest.raises(ConversionError, match="keeps no step count"):
        convert(src.record(K), template)
    forced = convert(src.record(K), template, force=True, use_template=["lr"]).optimizer.item
    assert [int(v.array) for k, v in forced.items() if k.endswith("count")] == [K // WINDOW]


def test_a_plan_from_several_sources_needs_each_ones_moment(monkeypatch):
    """A many-to-one plan (as rules make) takes its moments and pending gradients from all
    its sources; where one of them has none, the conversion says which."""
    strict = pytest.importorskip("trainrec_arraystrict")
    from trainrec.conversion import convert as conversion
    from trainrec.conversion import tensor_plans
    from trainrec.conversion.rules import Plan, RulesResult

    def plans(rules, source, target, *, frameworks=None, strict=True):
        if not rules:
            return RulesResult()
        return RulesResult({"w": Plan("w", ("layers.0.weight", "layers.0.bias"), (5, 3), lambda a: a[0].T, "packed"),
                            "b": Plan("b", ("layers.0.bias",), (3,), lambda a: a[0], "bias")})

    monkeypatch.setattr(tensor_plans, "apply_rules", plans)  # where the plans are made
    run = NumpyRun("sgd")
    run.model, run.opt, run.sched = MLP((5, 3)), SGD(momentum=0.9), StepLr(0.05, 2)
    x, y = batches(5, 3)
    run.train(0, K, x, y)
    record = run.record(K)
    template = TrainingRecord.capture(strict.Linear(5, 3), strict.SGD(0.9), strict.StepSchedule(0.05, 2, 0.5),
                                      GradientsAccumulator(), S(0))
    rules = [conversion.Rule("unused", "unused")]
    out = convert(record, template, rules=rules, use_template=["lr"])  # its rate is not in its record
    np.testing.assert_array_equal(out.optimizer.item["buffers"]["w"].array,
                                  run.opt.state["layers.0.weight"]["momentum_buffer"].T)
    np.testing.assert_array_equal(out.grads.grads["w"].array, record.grads.grads["layers.0.weight"].array.T)
    del run.opt.state["layers.0.bias"]
    with pytest.raises(ConversionError, match=r"w is made from \['layers.0.weight', 'layers.0.bias'\], "
                                              r"and \['layers.0.bias'\] have no momentum"):
        convert(run.record(K), template, rules=rules, use_template=["lr"])


def test_the_bundled_forms_come_through_entry_points(monkeypatch):
    """Issue 30: the torch, JAX and numpy forms are declared in trainrec's entry points
    (group `trainrec.neutral`), as a third party's are; core builds in only its own Burn
    form. With the installation metadata they are found; without it (a source tree on
    PYTHONPATH, a stale egg-info) only Burn's is, and the refusal says how to declare one.
    (Before issue 30 core named the adapters' forms in a default table.)"""
    from importlib import metadata
    from types import SimpleNamespace

    import trainrec.conversion.convert as tc
    import trainrec.conversion.form_registry as form_registry

    kinds = [("torch.nn.Module", "torch"), ("jax.pytree", "jax"), ("trainrec.numpy.MLP", "trainrec.numpy"),
             ("flax.nnx.Module", "flax.nnx"), ("equinox.Module", "equinox")]
    declared = {ep.name: ep.value for ep in metadata.entry_points(group=tc.ENTRY_POINT_GROUP)}
    for kind, name in kinds:
        assert declared[name].startswith("trainrec.adapters.")
        assert tc.form_for(SimpleNamespace(model=SimpleNamespace(kind=kind))).name == name
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: [])
    monkeypatch.setattr(form_registry, "_loaded", {})
    assert tc.form_for(SimpleNamespace(model=SimpleNamespace(kind="burn.Module"))).name == "burn"
    torch = SimpleNamespace(model=SimpleNamespace(kind="torch.nn.Module"), optimizer=SimpleNamespace(kind="torch.optim.SGD"),
                            scheduler=None)
    with pytest.raises(tc.ConversionError, match="torch.nn.Module.*entry-point group 'trainrec.neutral'"):
        tc.form_for(torch)


def test_the_cli_converts_a_third_party_record_to_any_form(tmp_path):
    """`trainrec convert --to NAME` takes any neutral form's name (here the array-api-strict
    adapter's, found by its entry point, and torch): the file it writes loads equal to what
    the API converts, and a form name the template is not is refused."""
    import subprocess
    import sys

    from same_items import same

    from trainrec import DefaultRecorder
    from trainrec.recorders.read import read_file

    strict_run, (lr, every, gamma) = _strict()
    x, y = batches(5, 3)
    src = strict_run()
    src.train(0, K, x, y)
    rate = lr * gamma ** ((K // WINDOW) // every)
    template = _strict_torch(lr, every, gamma)().record(0)
    paths = {n: tmp_path / f"{n}.mpk" for n in ("src", "template", "out")}
    src.record(K).save(DefaultRecorder(), paths["src"])
    template.save(DefaultRecorder(), paths["template"])
    cli = [sys.executable, "-m", "trainrec", "convert", str(paths["src"]), str(paths["out"]),
           "--template", str(paths["template"]), "--lr", str(rate)]
    done = subprocess.run([*cli, "--to", "torch"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = convert(TrainingRecord.load(DefaultRecorder(), paths["src"], None),
                       TrainingRecord.load(DefaultRecorder(), paths["template"], None), lr=rate)
    want = tmp_path / "want.mpk"
    expected.save(DefaultRecorder(), want)
    assert same(read_file(paths["out"])[1], read_file(want)[1])
    wrong = subprocess.run([*cli, "--to", "arraystrict"], capture_output=True, text=True, timeout=120)
    assert wrong.returncode == 2 and "the template is a torch record, not arraystrict" in wrong.stderr


def test_an_nnx_model_with_batch_norm_and_dropout_converts_to_torch_and_back():
    """BatchNorm's statistics go with the parameters; the Dropout's `Rngs` (a key and a
    count) are the framework's own: the target keeps its template's."""
    torch = pytest.importorskip("torch")
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    class Net(nnx.Module):
        def __init__(self, seed):
            rngs = nnx.Rngs(params=seed, dropout=seed + 1)
            self.linear = nnx.Linear(4, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.dropout = nnx.Dropout(0.25, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.norm(self.linear(x)))

    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm = torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)

    @nnx.jit
    def update(model, opt, x):
        opt.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

    def nnx_run(seed, steps):  # built and trained under jit: one compilation, not one per op
        model = nnx.jit(lambda: Net(seed))()
        opt = nnx.jit(lambda m: nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param))(model)
        for i in range(steps):
            update(model, opt, jnp.full((6, 4), i + 1.0) * jnp.arange(4.0))
        return model, opt, TrainingRecord.capture(model, opt, None, GradientsAccumulator(), S(steps))

    model, opt, record = nnx_run(0, 3)
    net = TorchNet()
    template = TrainingRecord.capture(net, torch.optim.Adam(net.parameters(), lr=1e-2), None,
                                      GradientsAccumulator(), S(0))
    assert framework_of(record) == "flax.nnx"
    torch_rec = via_file(convert(via_file(record), via_file(template), lr=1e-2))
    sd = torch_rec.model.item["tensors"]
    np.testing.assert_array_equal(sd["linear.weight"].array, np.asarray(model.linear.kernel[...]).T)
    np.testing.assert_array_equal(sd["norm.running_mean"].array, np.asarray(model.norm.mean[...]))
    np.testing.assert_array_equal(sd["norm.weight"].array, np.asarray(model.norm.scale[...]))
    _, _, fresh = nnx_run(5, 0)
    back = via_file(convert(torch_rec, via_file(fresh)))
    assert framework_of(back) == "flax.nnx"
    other, other_opt, _ = nnx_run(5, 0)
    back.restore(other, other_opt, None, "cpu")
    for name in ("linear.kernel", "linear.bias", "norm.scale", "norm.bias", "norm.mean", "norm.var"):
        a, b = (np.asarray(nnx.state(m)[name.split(".")[0]][name.split(".")[1]][...]) for m in (model, other))
        np.testing.assert_array_equal(a, b, err_msg=name)
    mu, other_mu = (jax_leaves(o.opt_state[0].mu) for o in (opt, other_opt))
    assert all(np.array_equal(a, b) for a, b in zip(mu, other_mu)) and int(other_opt.step[...]) == 3
    assert int(other.dropout.rngs.count[...]) == 0  # the template's own RNG stream


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_jax_pytree_of_an_nnx_state_is_refused_saying_to_capture_the_module_itself():
    """`trj.JaxModule(nnx.state(model))` names its parameters `linear.kernel`: not flax linen
    variables, so the jax form cannot read them; the refusal says what converts."""
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    import trainrec.adapters.jax as trj

    model = nnx.Linear(SIZES[0], SIZES[2], rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    tx = optax.adam(1e-2)
    record = TrainingRecord.capture(trj.JaxModule(state), trj.JaxOptimizer(tx, tx.init(state)), None,
                                    GradientsAccumulator(), S(0))
    with pytest.raises(ConversionError, match=r"source.model: a jax.pytree record converts as flax linen "
                                              r"variables.*\(bias, kernel\).*Capture an nnx.Module or eqx.Module"):
        convert(record, NumpyRun("adam").record(0))
    native = TrainingRecord.capture(model, nnx.Optimizer(model, tx, wrt=nnx.Param), None, GradientsAccumulator(), S(0))
    assert framework_of(native) == "flax.nnx"  # what the message says to do
