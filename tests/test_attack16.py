"""Attacks on the JAX adapter (issue 16): wrong gradient types and traced values."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
np = pytest.importorskip("numpy")

optax = pytest.importorskip("optax")

from _shared_runs import xla_flags  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.jax as trj  # noqa: E402
from trainrec import (  # noqa: E402
    GradientsAccumulator,
    GradientsParams,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    RecordMismatchError,
    StateRecord,
    TrainingRecord,
)


def _bad_gradients() -> list[tuple[str, object, str]]:
    return [
        ("list", [1.0, 2.0], "is a list, not a JAX array"),
        ("int", jnp.ones(2, jnp.int32), "dtype int32"),
        ("bool", jnp.ones(2, bool), "dtype bool"),
        ("complex", jnp.ones(2, jnp.complex64), "dtype complex64"),
        ("float8", jnp.ones(2, jnp.float8_e4m3fn), "dtype float8_e4m3fn"),
        ("key", jax.random.split(jax.random.key(0), 2), "dtype key<fry>"),
    ]


@pytest.mark.parametrize("pending", [False, True])
def test_accumulate_refuses_non_float_or_non_array_gradients(pending: bool) -> None:
    module = trj.JaxModule({"x": jnp.ones(2)})
    for name, grad, message in _bad_gradients():
        acc = GradientsAccumulator()
        if pending:
            acc.accumulate(module, GradientsParams({"x": jnp.full(2, 3.0)}))
        with pytest.raises(TypeError, match=message):
            acc.accumulate(module, GradientsParams({"x": grad}))
        # nothing changed: the pending value (or none) is still there
        assert acc.pending_ids() == (["x"] if pending else []), name
        with pytest.raises((TypeError, ValueError)):
            acc.adopt(module, GradientsParams({"x": grad}))
        assert acc.pending_ids() == (["x"] if pending else []), name
        if pending:
            assert np.array_equal(np.asarray(acc.grads()["x"]), np.full(2, 3.0, np.float32))


def test_accumulate_and_adopt_inside_jit_are_refused() -> None:
    module = trj.JaxModule({"x": jnp.ones(2)})
    acc = GradientsAccumulator()

    @jax.jit
    def step(g: jax.Array) -> jax.Array:
        acc.accumulate(module, trj.grads_from({"x": g}, module))
        return g

    @jax.jit
    def adopt(g: jax.Array) -> jax.Array:
        acc.adopt(module, trj.grads_from({"x": g}, module))
        return g

    for fn in (step, adopt):
        with pytest.raises(TypeError, match="traced value.*accumulate_tree"):
            fn(jnp.ones(2))
    assert acc.pending_ids() == []  # no tracer leaked into the accumulator
    acc.accumulate(module, GradientsParams({"x": np.ones(2, np.float32)}))  # numpy still fine
    assert acc.grads()["x"].dtype == jnp.float32


def test_rng_capture_inside_jit_is_a_clear_type_error() -> None:
    @jax.jit
    def capture(key: jax.Array) -> jax.Array:
        trj.JaxRngRecord.capture(key)
        return key

    with pytest.raises(TypeError, match="traced value.*outside jax.jit"):
        capture(jax.random.key(0))


# optimizer identity: your own functions differ by their literals
@trainrec.record
class _Step:
    micro: int


@pytest.mark.parametrize("recorded,live,names", [
    (lambda: optax.MultiSteps(optax.adam(1e-3), lambda step: 4),
     lambda: optax.MultiSteps(optax.adam(1e-3), lambda step: 8), r"every_k_schedule\.#consts\.0: 4 in the record, 8 live"),
    (lambda: optax.adamw(1e-3, mask=lambda p: {"w": True, "b": True}),
     lambda: optax.adamw(1e-3, mask=lambda p: {"w": True, "b": False}), r"mask\.#consts: 3 entries in the record, 4 live"),
    (lambda: optax.adam(lambda step: 1e-3 * 0.5 ** (step // 10)),
     lambda: optax.adam(lambda step: 1e-3 * 0.5 ** (step // 20)), r"#consts.*10 in the record, 20 live"),
])
def test_own_functions_with_other_literals_are_other_optimizers(recorded, live, names):
    p = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    tx = recorded()
    rec = TrainingRecord.capture(trj.JaxModule(p), trj.JaxOptimizer(tx, tx.init(p)), None, GradientsAccumulator(),
                                 _Step(0))
    other = live()
    opt = trj.JaxOptimizer(other, other.init(p))
    before = opt.opt_state
    with pytest.raises(RecordMismatchError, match=names):
        rec.restore(trj.JaxModule(dict(p)), opt, None, "cpu")
    assert opt.opt_state is before
    same = recorded()  # the same source rebuilt: accepted, through a file
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    loaded = TrainingRecord.load(r, rec.save(r), "cpu", state_type=_Step)
    loaded.restore(trj.JaxModule(dict(p)), trj.JaxOptimizer(same, same.init(p)), None, "cpu")


def _strip_consts(item):
    if isinstance(item, dict):
        return {k: _strip_consts(v) for k, v in item.items() if k != "#consts"}
    if isinstance(item, list):
        return [_strip_consts(v) for v in item]
    return item


def test_records_without_function_literals_still_restore():
    p = {"w": jnp.ones(2)}
    tx = optax.MultiSteps(optax.adam(1e-3), lambda step: 4)
    rec = TrainingRecord.capture(trj.JaxModule(p), trj.JaxOptimizer(tx, tx.init(p)), None, GradientsAccumulator(),
                                 _Step(0))
    assert "#consts" in str(rec.optimizer.item["#identity"])
    old = TrainingRecord(rec.model, StateRecord(rec.optimizer.kind, _strip_consts(rec.optimizer.item)), None,
                         rec.grads, {"micro": 0}, _Step)
    live = optax.MultiSteps(optax.adam(1e-3), lambda step: 8)  # unknown then: not refused
    old.restore(trj.JaxModule(dict(p)), trj.JaxOptimizer(live, live.init(p)), None, "cpu")


_INDIVISIBLE = r'''
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import trainrec, trainrec.adapters.jax as trj
from trainrec import GradientsAccumulator, RecordMismatchError, TrainingRecord

@trainrec.record
class Step:
    micro: int

assert len(jax.devices()) == 8
p = {"w": jnp.arange(64.0).reshape(8, 8)}
tx = optax.adam(1e-3)
rec = TrainingRecord.capture(trj.JaxModule(p), trj.JaxOptimizer(tx, tx.init(p)), None, GradientsAccumulator(),
                             Step(1))
mesh5 = Mesh(np.array(jax.devices()[:5]), ("x",))  # 8 rows do not split over 5 devices
bad = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh5, P("x")))}
try:
    trj.restore_tree(rec.model, bad)
except RecordMismatchError as e:
    assert "'w'" in str(e) and "cannot hold an array of shape (8, 8)" in str(e), e
else:
    raise AssertionError("an indivisible target sharding was accepted")
module = trj.JaxModule(bad)
opt = trj.JaxOptimizer(tx, jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}))
try:
    rec.restore(module, opt, None, None)
except trainrec.RecorderError as e:
    assert "cannot hold an array of shape (8, 8)" in str(e), e
else:
    raise AssertionError("restore accepted an indivisible sharding")
assert module.params is bad  # the holders are left as they were
print("OK")
'''


def test_an_indivisible_target_sharding_is_a_record_mismatch(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=8"), "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", _INDIVISIBLE], capture_output=True, text=True, timeout=120,
                         env=env, cwd=tmp_path)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


def test_accumulate_tree_refuses_what_accumulate_refuses():
    pending = {"w": jnp.ones((2, 2))}
    for grads in ({"w": jnp.ones(2)}, {"w": jnp.float32(1.0)}):  # would broadcast silently
        with pytest.raises(ValueError, match=r"'w' has shape .*pending \(2, 2\)"):
            trj.accumulate_tree(pending, grads)
        with pytest.raises(ValueError, match=r"'w' has shape"):
            jax.jit(trj.accumulate_tree)(pending, grads)
    with pytest.raises(TypeError, match="'w' has dtype int32"):
        trj.accumulate_tree(None, {"w": jnp.ones(2, jnp.int32)})
    with pytest.raises(TypeError, match="float dtype"):
        trj.accumulate_tree(None, pending, jnp.int32)
    from trainrec import FloatDType

    # the accumulator's own dtype type is taken, as accumulate_with_dtype takes it
    out = trj.accumulate_tree(None, pending, FloatDType.BF16)
    assert out["w"].dtype == jnp.bfloat16
    acc = GradientsAccumulator()
    module = trj.JaxModule(pending)
    acc.accumulate_with_dtype(module, GradientsParams({"w": jnp.full((2, 2), 0.3)}), FloatDType.BF16)
    tree = trj.accumulate_tree(out, {"w": jnp.full((2, 2), 0.3)}, FloatDType.BF16)
    acc.accumulate_with_dtype(module, GradientsParams({"w": jnp.full((2, 2), 0.3)}), FloatDType.BF16)
    ref = trj.accumulate_tree(None, {"w": jnp.full((2, 2), 0.3)}, FloatDType.BF16)
    ref = trj.accumulate_tree(ref, {"w": jnp.full((2, 2), 0.3)}, FloatDType.BF16)
    assert tree["w"].dtype == acc.grads()["w"].dtype == ref["w"].dtype == jnp.bfloat16


def test_to_tree_refuses_a_gradient_of_another_shape():
    module = trj.JaxModule({"w": jnp.ones((2, 2)), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"'w' has shape \(3,\), parameter \(2, 2\)"):
        trj.to_tree(GradientsParams({"w": jnp.ones(3)}), module)


def test_a_donated_array_is_a_clear_error_naming_the_leaf():
    from flax import nnx

    donated = jnp.ones(3)
    donated.delete()  # what jax.jit(..., donate_argnums=0) does to the array it was given
    opt = trj.JaxOptimizer(optax.sgd(0.1), optax.sgd(0.1).init({}))
    with pytest.raises(ValueError, match=r"leaf 'w'.*deleted \(donated"):
        TrainingRecord.capture(trj.JaxModule({"w": donated}), opt, None, GradientsAccumulator(), _Step(0))
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    model.bias.get_value().delete()
    with pytest.raises(ValueError, match=r"leaf 'bias'.*deleted"):
        TrainingRecord.capture(model, opt, None, GradientsAccumulator(), _Step(0))
    acc = GradientsAccumulator()
    module = trj.JaxModule({"w": jnp.ones(3)})
    with pytest.raises(TypeError, match=r"gradient of 'w' was deleted"):
        acc.accumulate(module, GradientsParams({"w": donated}))
    assert acc.pending_ids() == []


def test_capture_names_a_missing_optimizer_or_accumulator():
    module = trj.JaxModule({"w": jnp.ones(2)})
    opt = trj.JaxOptimizer(optax.sgd(0.1), optax.sgd(0.1).init({"w": jnp.ones(2)}))
    with pytest.raises(TypeError, match="the optimizer is None"):
        TrainingRecord.capture(module, None, None, GradientsAccumulator(), _Step(0))
    with pytest.raises(TypeError, match="the model is None"):
        TrainingRecord.capture(None, opt, None, GradientsAccumulator(), _Step(0))
    with pytest.raises(TypeError, match="accumulator must be a GradientsAccumulator"):
        TrainingRecord.capture(module, opt, None, None, _Step(0))
    rec = TrainingRecord.capture(module, opt, None, GradientsAccumulator(), _Step(0))
    with pytest.raises(TypeError, match="the optimizer is None"):
        rec.restore(module, None, None, "cpu")
