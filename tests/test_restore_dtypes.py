"""A restore never changes a value it was not asked to (issue 31, item 1).

Where the live object is only a template (JAX holders, flax nnx, equinox: a fresh
`tx.init` of bf16 params has bf16 moments where the saved run, with f32 gradients, held
f32), the restored leaf takes the recorded dtype. Where the live tensor keeps its dtype
(a torch parameter, buffer or optimizer state tensor), a cast that changes any value is a
`RecordMismatchError` naming the leaf, both dtypes and the first changed element, raised
before anything is written."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import trainrec
from trainrec import RecordMismatchError, StateRecord, TensorData, TrainingRecord


@trainrec.record
class Nothing:
    step: int = 0

# (recorded values, live dtype, what the unchecked cast gives): each one changes a value
CASES = {
    "f32 -> f16 overflow": (np.array([1.5, 1e6], np.float32), np.float16, "1000000.0 becomes inf"),
    "i32 -> i8 wraps": (np.array([7, 300], np.int32), np.int8, "300 becomes 44"),
    "i32 -> u8 wraps": (np.array([3, -5], np.int32), np.uint8, "-5 becomes 251"),
    "f32 -> bf16 rounds": (np.array([0.5, 1 + 2 ** -10], np.float32), ml_dtypes.bfloat16,
                           "1.0009765625 becomes 1.0"),
}


def _code(dtype) -> str:
    return {np.float16: "f16", np.int8: "i8", np.uint8: "u8", ml_dtypes.bfloat16: "bf16"}[dtype]


# -- torch: the live dtype is kept, so a lossy cast is refused ---------------------------------


def _torch_module(values, torch):
    class M(torch.nn.Module):
        def __init__(self, v):
            super().__init__()
            v = torch.from_numpy(np.asarray(v).astype(np.float32) if v.dtype == ml_dtypes.bfloat16 else v)
            if v.is_floating_point():
                self.w = torch.nn.Parameter(v.clone())
                self.register_buffer("n", torch.zeros(2, dtype=torch.int32))
            else:
                self.w = torch.nn.Parameter(torch.zeros(2))
                self.register_buffer("n", v.clone())

    return M(values)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_refuses_a_cast_that_changes_a_value_and_changes_nothing(case):
    torch = pytest.importorskip("torch")
    from trainrec.adapters.torch.backend import to_torch_dtype
    from trainrec.adapters.torch.bindings import TorchModule

    values, live_dtype, says = CASES[case]
    saved = _torch_module(values, torch)
    record = TorchModule(saved).into_record()
    live = _torch_module(values, torch)
    leaf = "w" if values.dtype.kind == "f" else "n"
    target = to_torch_dtype(_dtype_of(live_dtype))
    with torch.no_grad():
        setattr(live, leaf, torch.nn.Parameter(torch.full((2,), 2, dtype=target)) if leaf == "w"
                else torch.full((2,), 2, dtype=target))
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(RecordMismatchError) as e:
        TorchModule(live).load_record(record, "cpu")
    message = str(e.value)
    assert f"{leaf}: the record holds {_dtype_of(values.dtype).value}, the live dtype is {_code(live_dtype)}" \
        in message and "first at index [1]" in message
    assert says in message
    after = live.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


def _dtype_of(np_dtype):
    from trainrec import DType

    return DType.from_numpy(np.dtype(np_dtype))


def test_torch_takes_a_cast_that_keeps_every_value():
    torch = pytest.importorskip("torch")
    from trainrec.adapters.torch.bindings import TorchModule

    saved = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        saved.weight.copy_(torch.tensor([[0.5, -1.0, 2.0], [3.0, 0.25, -0.125]]))
    record = TorchModule(saved).into_record()
    live = torch.nn.Linear(3, 2, bias=False).to(torch.bfloat16)
    TorchModule(live).load_record(record, "cpu")
    assert live.weight.dtype == torch.bfloat16 and torch.equal(live.weight.float(), saved.weight)


def test_torch_gradients_pending_in_grad_are_checked_too():
    torch = pytest.importorskip("torch")
    from trainrec.adapters.torch.bindings import TorchModule

    saved = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        saved.weight.copy_(torch.tensor([[1.0, 2.0]]))
    saved.weight.grad = torch.tensor([[1e6, 0.5]])
    record = TorchModule(saved).into_record()
    live = torch.nn.Linear(2, 1, bias=False).half()
    before = live.weight.detach().clone()
    with pytest.raises(RecordMismatchError, match=r"^weight: the record holds f32, the live dtype is f16.*"
                                                  r"1000000\.0 becomes inf.*key 'model\.grads'"):
        TorchModule(live).load_record(record, "cpu")
    assert torch.equal(live.weight, before) and live.weight.grad is None


def test_torch_optimizer_state_a_cast_would_round_is_refused_before_anything_is_written():
    """Parameters whose values bf16 holds, Adam moments it does not: torch's own
    `load_state_dict` would round the moments to the parameter's dtype."""
    torch = pytest.importorskip("torch")
    from trainrec import GradientsAccumulator

    def build(dtype):
        model = torch.nn.Linear(2, 1, bias=False).to(dtype)
        with torch.no_grad():
            model.weight.fill_(1.0)
        return model, torch.optim.Adam(model.parameters(), lr=0.0)  # lr 0: weights stay 1.0

    model, opt = build(torch.float32)
    model.weight.grad = torch.tensor([[0.3, 0.7]])
    opt.step()
    model.weight.grad = None
    record = TrainingRecord.capture(model, opt, None, GradientsAccumulator(), Nothing())
    live, live_opt = build(torch.bfloat16)
    live.weight.grad = torch.tensor([[1.0, 1.0]], dtype=torch.bfloat16)
    live_opt.step()
    live.weight.grad = None
    before = {k: v.clone() for k, v in live_opt.state[live.weight].items()}
    with pytest.raises(RecordMismatchError, match=r"^exp_avg: the record holds f32, the parameter's dtype "
                                                  r".* is bf16.*first at index \[0, 0\].*key 'optimizer\.state\.weight'"):
        record.restore(live, live_opt, None, "cpu")
    after = live_opt.state[live.weight]
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


@pytest.mark.parametrize("optimizer", ["NAdam", "ASGD"])
def test_torch_scalar_state_of_a_bf16_model_resumes_bitwise(optimizer):
    """NAdam's `mu_product`, ASGD's `eta` and `mu` are f32 whatever the parameters; torch's
    `load_state_dict` casts them to a bf16 parameter's dtype, and the resumed run drifted."""
    torch = pytest.importorskip("torch")
    from trainrec import GradientsAccumulator

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).to(torch.bfloat16)
        return model, getattr(torch.optim, optimizer)(model.parameters(), lr=1e-2)

    def step(model, opt, i):
        x = torch.linspace(-1, 1, 8, dtype=torch.bfloat16).reshape(2, 4) * (i + 1)
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()

    ref, ref_opt = build()
    for i in range(6):
        step(ref, ref_opt, i)
    model, opt = build()
    for i in range(3):
        step(model, opt, i)
    opt.zero_grad(set_to_none=True)
    record = TrainingRecord.capture(model, opt, None, GradientsAccumulator(), Nothing())
    model, opt = build()
    record.restore(model, opt, None, "cpu")
    for i in range(3, 6):
        step(model, opt, i)
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(ref.parameters(), model.parameters()):
        for key, a in ref_opt.state[p].items():
            b = opt.state[q][key]
            assert a.dtype == b.dtype and torch.equal(a, b), key


# -- JAX: the restored leaf takes the recorded dtype ------------------------------------------


def _live_like(values, live_dtype):
    return np.full(values.shape, 2, live_dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_jax_holders_take_the_recorded_dtype(case):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    import trainrec.adapters.jax as trj

    values, live_dtype, _ = CASES[case]
    record = trj.JaxModule({"w": jnp.asarray(values)}).into_record()
    live = trj.JaxModule({"w": jnp.asarray(_live_like(values, live_dtype))})
    live.load_record(record, None)
    got = live.params["w"]
    assert got.dtype == values.dtype and np.array_equal(np.asarray(got), values)
    assert trj.restore_tree(record, {"w": jax.ShapeDtypeStruct(values.shape, live_dtype)})["w"].dtype == values.dtype

    tx = optax.trace(decay=0.9)  # a state that holds whatever the tree holds
    saved = trj.JaxOptimizer(tx, optax.TraceState(trace={"w": jnp.asarray(values)}))
    opt = trj.JaxOptimizer(tx, optax.TraceState(trace={"w": jnp.asarray(_live_like(values, live_dtype))}))
    opt.load_record(saved.into_record(None), None, None)
    got = opt.opt_state.trace["w"]
    assert got.dtype == values.dtype and np.array_equal(np.asarray(got), values)


@pytest.mark.parametrize("case", list(CASES))
def test_nnx_takes_the_recorded_dtype(case):
    pytest.importorskip("jax")
    nnx = pytest.importorskip("flax.nnx")
    import jax.numpy as jnp

    values, live_dtype, _ = CASES[case]

    class M(nnx.Module):
        def __init__(self, v):
            self.w = nnx.Param(jnp.asarray(v)) if v.dtype.kind == "f" else nnx.Variable(jnp.asarray(v))

    from trainrec.adapters.jax import NnxModule

    record = NnxModule(M(values)).into_record()
    live = M(_live_like(values, live_dtype))
    NnxModule(live).load_record(record, None)
    assert live.w[...].dtype == values.dtype and np.array_equal(np.asarray(live.w[...]), values)


@pytest.mark.parametrize("case", list(CASES))
def test_equinox_takes_the_recorded_dtype(case):
    jax = pytest.importorskip("jax")
    eqx = pytest.importorskip("equinox")
    import jax.numpy as jnp

    from trainrec.adapters.jax import EqxModule

    values, live_dtype, _ = CASES[case]

    class M(eqx.Module):
        w: jax.Array

    record = EqxModule(M(jnp.asarray(values))).into_record()
    bound = EqxModule(M(jnp.asarray(_live_like(values, live_dtype))))
    bound.load_record(record, None)
    assert bound.model.w.dtype == values.dtype and np.array_equal(np.asarray(bound.model.w), values)


def test_jax_refuses_64_bit_values_it_would_narrow_without_x64():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import trainrec.adapters.jax as trj

    if jax.config.jax_enable_x64:
        pytest.skip("64-bit JAX holds f64")
    record = StateRecord(trj.JaxModule.kind, {"w": TensorData.from_array(np.array([1.0, 1 + 2 ** -40]))})
    live = trj.JaxModule({"w": jnp.zeros(2)})
    before = live.params
    with pytest.raises(RecordMismatchError, match=r"model\.w: the record holds f64, what JAX holds without "
                                                  r"jax_enable_x64 is f32.*jax_enable_x64', True"):
        live.load_record(record, None)
    assert live.params is before
    exact = StateRecord(trj.JaxModule.kind, {"w": TensorData.from_array(np.array([1.0, 0.5]))})
    live.load_record(exact, None)  # every value survives: JAX's f32
    assert live.params["w"].dtype == jnp.float32


def test_the_issue_bf16_adam_with_f32_gradients_restores_f32_moments():
    """The issue's seven lines: one update with f32 gradients makes adam's mu f32."""
    pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp

    import trainrec.adapters.jax as trj

    tx = optax.adam(1e-2)
    p = {"w": jnp.ones(4, jnp.bfloat16)}
    _, state = tx.update({"w": jnp.full(4, 0.1234567, jnp.float32)}, tx.init(p), p)
    record = trj.JaxOptimizer(tx, state).into_record(None)
    live = trj.JaxOptimizer(tx, tx.init(p))
    live.load_record(record, None, None)
    mu = live.opt_state[0].mu["w"]
    assert mu.dtype == jnp.float32 and bool(jnp.all(mu == state[0].mu["w"]))


# -- the fresh-process resume: bf16 params, f32 accumulation, adam --------------------------

_RUN = """
import sys
import jax, jax.numpy as jnp, numpy as np, optax
import trainrec, trainrec.adapters.jax as trj
from trainrec import DefaultRecorder, FloatDType, GradientsAccumulator, TrainingRecord

kind, role, path, out = sys.argv[1:5]
WINDOW, STEPS, AT = 2, 8, 5

@trainrec.record
class State:
    micro: int

def data(i):
    return jnp.asarray(np.random.default_rng(i).normal(size=(4, 3)).astype(np.float32))

if kind == "pytree":
    def build():
        p = {"w": jnp.asarray(np.linspace(-1, 1, 6).reshape(3, 2), jnp.bfloat16), "b": jnp.zeros(2, jnp.bfloat16)}
        tx = optax.adam(1e-2)
        return trj.JaxModule(p), trj.JaxOptimizer(tx, tx.init(p))

    def grads(model, x):
        f = lambda p: jnp.mean((x @ p["w"].astype(jnp.float32) + p["b"].astype(jnp.float32)) ** 2)
        return jax.grad(f)(model.params)

    def update(model, opt, acc):
        g = trj.to_tree(acc.grads(), model)
        updates, opt.opt_state = opt.tx.update(g, opt.opt_state, model.params)
        model.params = optax.apply_updates(model.params, updates)

    def leaves(model, opt):
        return jax.tree.leaves((model.params, opt.opt_state))
else:
    from flax import nnx

    def build():
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    def grads(model, x):
        return nnx.grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(model)

    def update(model, opt, acc):
        opt.update(model, trj.to_tree(acc.grads(), model))

    def leaves(model, opt):
        return jax.tree.leaves((nnx.state(model), nnx.state(opt)))

def train(model, opt, acc, state, until):
    while state.micro < until:
        acc.accumulate_with_dtype(model, trj.grads_from(grads(model, data(state.micro)), model), FloatDType.F32)
        state.micro += 1
        if state.micro % WINDOW == 0:
            update(model, opt, acc)

model, opt = build()
acc, state = GradientsAccumulator(), State(0)
if role == "checkpoint":
    train(model, opt, acc, state, AT)
    TrainingRecord.capture(model, opt, None, acc, state).save(DefaultRecorder(), path)
    sys.exit(0)
if role == "resume":
    restored = TrainingRecord.load(DefaultRecorder(), path, "cpu", state_type=State).restore(model, opt, None, "cpu")
    model, acc, state = restored.model, restored.accumulator, restored.state
    model = getattr(model, "native", model)
train(model, opt, acc, state, STEPS)
np.savez(out, *[np.asarray(x).astype(np.float32) for x in leaves(model, opt)],
         dtypes=np.array([str(x.dtype) for x in leaves(model, opt)]))
"""


@pytest.mark.parametrize("kind", ["pytree", "nnx"])
def test_bf16_params_f32_accumulation_adam_resume_bitwise_in_a_fresh_process(kind, tmp_path):
    pytest.importorskip("optax")
    if kind == "nnx":
        pytest.importorskip("flax.nnx")
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(_RUN))
    ckpt = tmp_path / "ckpt.mpk"

    def role(name, out=""):
        done = subprocess.run([sys.executable, str(script), kind, name, str(ckpt), out],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr

    role("reference", str(tmp_path / "ref.npz"))
    role("checkpoint")
    role("resume", str(tmp_path / "res.npz"))
    ref, res = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "res.npz")
    assert list(ref["dtypes"]) == list(res["dtypes"]) and "float32" in list(ref["dtypes"])
    for k in ref.files:
        assert np.array_equal(ref[k], res[k]), k


# -- accumulate_with_dtype takes what users write -----------------------------------------


@pytest.mark.parametrize("name", ["FloatDType", "np.float32", "jnp.float32", "'float32'", "'f32'", "torch.float32"])
def test_accumulate_with_dtype_takes_numpy_jax_torch_dtypes_and_names(name):
    np_ = np
    jnp = pytest.importorskip("jax.numpy") if "jnp" in name else None
    torch = pytest.importorskip("torch") if "torch" in name else None
    from trainrec import FloatDType, GradientsAccumulator, GradientsParams
    from trainrec.adapters.numpy.mlp import MLP

    dtype = {"FloatDType": FloatDType.F32, "np.float32": np_.float32, "'float32'": "float32", "'f32'": "f32",
             "jnp.float32": jnp and jnp.float32, "torch.float32": torch and torch.float32}[name]
    model = MLP([3, 2], seed=0)
    pid, shape = next(iter(model.param_shapes().items()))
    acc = GradientsAccumulator()
    acc.accumulate_with_dtype(model, GradientsParams({pid: np_.ones(shape, np_.float16)}), dtype)
    assert acc.try_to_record().grads[pid].dtype.value == "f32"


@pytest.mark.parametrize("dtype", ["int8", "float8", None, 3, np.int32])
def test_accumulate_with_dtype_refuses_what_is_no_float_dtype_saying_where_floatdtype_lives(dtype):
    from trainrec import GradientsAccumulator, GradientsParams
    from trainrec.adapters.numpy.mlp import MLP

    model = MLP([3, 2], seed=0)
    pid, shape = next(iter(model.param_shapes().items()))
    acc = GradientsAccumulator()
    with pytest.raises(TypeError, match=r"from trainrec import FloatDType.*np\.float32.*'float32'"):
        acc.accumulate_with_dtype(model, GradientsParams({pid: np.ones(shape, np.float32)}), dtype)
    assert acc.pending_ids() == []
