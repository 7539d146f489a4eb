"""flax nnx and equinox models bound as they are: `nnx.Module` / `nnx.Optimizer`
(`NnxModule`, `NnxOptimizer`) and `eqx.Module` (`EqxModule`): what is trainable, what is
recorded, restore in place (nnx) or as a new module (equinox), refusals that change
nothing, and bitwise continuation in a fresh process mid accumulation window."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
import jax.numpy as jnp  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.jax as trj  # noqa: E402
from trainrec import (  # noqa: E402
    DefaultRecorder,
    GradientsAccumulator,
    NativePrecisionSettings,
    RecordMismatchError,
    TrainingRecord,
    read_file,
)
from trainrec.items.tree import compare_items  # noqa: E402

LOOPS = Path(__file__).with_name("jax_native_loops.py")


@trainrec.record
class Step:
    micro: int


def same(a, b) -> bool:
    """Bitwise equal array leaves, dtypes included (typed keys by their key data)."""
    def host(x):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    la = [host(x) for x in jax.tree.leaves(a) if eqx.is_array(x)]
    lb = [host(x) for x in jax.tree.leaves(b) if eqx.is_array(x)]
    return len(la) == len(lb) and all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
                                      for x, y in zip(la, lb))


def default_roundtrip(rec: TrainingRecord, tmp_path: Path) -> TrainingRecord:
    rec.save(DefaultRecorder(), tmp_path / "ckpt.mpk")
    return TrainingRecord.load(DefaultRecorder(), tmp_path / "ckpt.mpk", "cpu", state_type=Step)


# -- flax nnx -----------------------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, seed: int) -> None:
        rngs = nnx.Rngs(params=seed, dropout=seed + 1)
        self.linear = nnx.Linear(3, 4, rngs=rngs, param_dtype=jnp.bfloat16)
        self.norm = nnx.BatchNorm(4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.norm(self.linear(x).astype(jnp.float32)))


def nnx_loss(model, x):
    return jnp.sum(model(x) ** 2)


def nnx_trained(seed: int = 0, steps: int = 2):
    model = Net(seed)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    for i in range(steps):
        opt.update(model, nnx.grad(nnx_loss)(model, jnp.full((5, 3), float(i + 1))))
    return model, opt


def test_nnx_params_are_trainable_batch_stats_and_rngs_recorded_not_trained():
    model, _ = nnx_trained()
    bound = trainrec.adapt(model)
    assert isinstance(bound, trj.NnxModule) and bound.module is model
    assert bound.param_ids() == ["linear.bias", "linear.kernel", "norm.bias", "norm.scale"]
    item = bound.into_record().item
    assert {"norm.mean", "norm.var", "dropout.rngs.count", "dropout.rngs.key"} <= set(item)
    key = item["dropout.rngs.key"]  # the key item JaxRngRecord and JaxModule record too
    assert set(key) == {"impl", "data"} and key["impl"] == "threefry2x32" and key["data"].dtype.value == "u32"
    assert np.array_equal(key["data"].array, jax.random.key_data(model.dropout.rngs.key[...]))
    assert not any(k.startswith("#") for k in item)
    grads = trj.grads_from(nnx.grad(nnx_loss)(model, jnp.ones((2, 3))), model)
    assert list(grads) == bound.param_ids()  # nnx.grad's State: Params only, by the same ids
    assert isinstance(trainrec.adapt(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)), trj.NnxOptimizer)


def test_nnx_restore_updates_the_live_module_through_the_default_recorder(tmp_path):
    model, opt = nnx_trained(0)
    acc = GradientsAccumulator()
    acc.accumulate(model, trj.grads_from(nnx.grad(nnx_loss)(model, jnp.ones((2, 3))), model))
    rec = default_roundtrip(TrainingRecord.capture(model, opt, None, acc, Step(3)), tmp_path)
    other, other_opt = nnx_trained(5, steps=1)
    kernel = other.linear.kernel
    restored = rec.restore(other, other_opt, None, "cpu")
    assert restored.model is other and restored.optimizer is other_opt
    assert other.linear.kernel is kernel  # the same Variable, a new value
    assert other.linear.kernel[...].dtype == jnp.bfloat16 and other.dropout.rngs.count[...].dtype == jnp.uint32
    assert same(nnx.state(other), nnx.state(model)) and same(nnx.state(other_opt), nnx.state(opt))
    assert int(other_opt.step[...]) == 2
    assert same(trj.to_tree(restored.accumulator.grads(), other), trj.to_tree(acc.grads(), model))
    x = jnp.ones((2, 3))  # the restored Rngs draw the same dropout masks
    assert same(model(x), other(x))


def test_nnx_mismatched_shapes_are_refused_and_change_nothing():
    model, opt = nnx_trained(0)
    rec = TrainingRecord.capture(model, opt, None, GradientsAccumulator(), Step(0))

    class Wider(Net):
        def __init__(self, seed):
            super().__init__(seed)
            self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(seed))  # float32, and ...
            self.norm = nnx.BatchNorm(4, rngs=nnx.Rngs(seed))
            self.extra = nnx.BatchStat(jnp.zeros(2))  # ... a variable the record lacks

    wide = Wider(3)
    wide_opt = nnx.Optimizer(wide, optax.adamw(1e-2), wrt=nnx.Param)
    before, opt_before = nnx.clone(nnx.state(wide)), nnx.clone(nnx.state(wide_opt))
    with pytest.raises(RecordMismatchError, match=r"missing \['extra'\]"):
        rec.restore(wide, wide_opt, None, "cpu")
    small = Net(3)
    small.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    small.norm = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    small_before = nnx.clone(nnx.state(small))
    with pytest.raises(RecordMismatchError, match="linear.kernel: shape"):
        rec.restore(small, nnx.Optimizer(small, optax.adamw(1e-2), wrt=nnx.Param), None, "cpu")
    rbg = {**rec.model.item, "dropout.rngs.key": {**rec.model.item["dropout.rngs.key"], "impl": "rbg"}}
    with pytest.raises(RecordMismatchError, match=r"dropout.rngs.key: a rbg key array .* in the record, a "
                                                  r"threefry2x32 key array .* live"):
        trj.NnxModule(model).check_record(trainrec.StateRecord("flax.nnx.Module", rbg))
    bare = {**rec.model.item, "dropout.rngs.key": rec.model.item["dropout.rngs.key"]["data"]}
    with pytest.raises(RecordMismatchError, match=r"dropout.rngs.key: a u32 tensor in the record, a threefry2x32"):
        trj.NnxModule(model).check_record(trainrec.StateRecord("flax.nnx.Module", bare))
    assert same(nnx.state(wide), before) and same(nnx.state(wide_opt), opt_before)
    assert same(nnx.state(small), small_before)


def test_nnx_records_with_keys_in_the_earlier_form_still_restore_exactly():
    """Before nnx and equinox records shared JaxRngRecord's key item, a key was its bare
    key data with the implementation under `#rng_impl`: such records still restore."""
    model, opt = nnx_trained(0)
    item = dict(trj.NnxModule(model).into_record().item)
    key = item["dropout.rngs.key"]
    old = {**item, "dropout.rngs.key": key["data"], "#rng_impl": {"dropout.rngs.key": key["impl"]}}
    r = trainrec.NamedMpkBytesRecorder(NativePrecisionSettings())
    rec = TrainingRecord(trainrec.StateRecord("flax.nnx.Module", old), trainrec.adapt(opt).into_record(None),
                         None, trainrec.GradientsParamsRecord({}), {"micro": 0}, Step)
    rec = TrainingRecord.load(r, rec.save(r), "cpu", state_type=Step)
    other, other_opt = nnx_trained(5, steps=1)
    rec.restore(other, other_opt, None, "cpu")
    assert same(nnx.state(other), nnx.state(model))
    assert jax.random.key_impl(other.dropout.rngs.key[...]) == jax.random.key_impl(model.dropout.rngs.key[...])
    wrong = {**old, "#rng_impl": {"dropout.rngs.key": "rbg"}}  # the earlier form's refusal, kept
    with pytest.raises(RecordMismatchError, match="dropout.rngs.key: a rbg key array"):
        trj.NnxModule(other).check_record(trainrec.StateRecord("flax.nnx.Module", wrong))
    with pytest.raises(RecordMismatchError, match="#rng_impl"):
        trj.NnxModule(other).check_record(trainrec.StateRecord("flax.nnx.Module", {**old, "#rng_impl": {"norm.mean": 3}}))


# -- equinox ------------------------------------------------------------------------------


class Counted(eqx.Module):
    mlp: eqx.nn.MLP
    scale: jax.Array
    steps: jax.Array  # an integer array: recorded, not trained
    name: str = "counted"

    def __init__(self, seed: int, width: int = 4):
        self.mlp = eqx.nn.MLP(3, 2, width, 1, activation=jax.nn.relu, key=jax.random.key(seed))
        self.scale = jnp.ones((), jnp.bfloat16) * (seed + 1)
        self.steps = jnp.asarray(seed, jnp.int32)

    def __call__(self, x):
        return self.mlp(x) * self.scale.astype(jnp.float32)


def eqx_loss(model, x):
    return jnp.sum(jax.vmap(model)(x) ** 2)


def test_equinox_arrays_recorded_inexact_trainable_static_leaves_kept(tmp_path):
    model = Counted(0)
    bound = trainrec.adapt(model)
    assert isinstance(bound, trj.EqxModule)
    assert bound.param_ids() == ["mlp.layers.0.weight", "mlp.layers.0.bias", "mlp.layers.1.weight",
                                 "mlp.layers.1.bias", "scale"]
    assert set(bound.into_record().item) == {*bound.param_ids(), "steps"}  # no activation, no name
    grads = eqx.filter_grad(eqx_loss)(model, jnp.ones((2, 3)))
    acc = GradientsAccumulator()
    acc.accumulate(model, trj.grads_from(grads, model))
    tx = optax.adamw(1e-2)
    opt = trj.JaxOptimizer(tx, tx.init(eqx.filter(model, eqx.is_inexact_array)))
    rec = default_roundtrip(TrainingRecord.capture(model, opt, None, acc, Step(1)), tmp_path)
    fresh = Counted(7)
    fresh_opt = trj.JaxOptimizer(tx, tx.init(eqx.filter(fresh, eqx.is_inexact_array)))
    restored = rec.restore(fresh, fresh_opt, None, "cpu")
    new = restored.model
    assert isinstance(new, Counted) and new is not fresh and same(fresh, Counted(7))  # fresh untouched
    assert same(new, model) and new.scale.dtype == jnp.bfloat16 and new.steps.dtype == jnp.int32
    assert new.mlp.activation is fresh.mlp.activation and new.name == "counted"
    assert same(trj.to_tree(restored.accumulator.grads(), new), grads)
    held = trj.EqxModule(Counted(9))  # a holder passed in comes back, holding the new module
    assert rec.restore(held, fresh_opt, None, "cpu").model is held and same(held.model, model)


def test_an_equinox_key_leaf_is_the_shared_key_item_and_restores_exactly(tmp_path):
    class Noisy(eqx.Module):
        w: jax.Array
        key: jax.Array  # a typed key the model carries (an rbg one)

    model = Noisy(jnp.ones(3), jax.random.key(4, impl="rbg"))
    item = trj.EqxModule(model).into_record().item
    assert set(item) == {"w", "key"} and item["key"]["impl"] == "rbg"  # as JaxRngRecord records a key
    fresh = Noisy(jnp.zeros(3), jax.random.key(9, impl="rbg"))
    held = trj.EqxModule(fresh)
    held.load_record(trj.EqxModule(model).into_record(), "cpu")
    assert same(held.model, model) and jax.random.key_impl(held.model.key) == jax.random.key_impl(model.key)
    threefry = trj.EqxModule(Noisy(jnp.zeros(3), jax.random.key(9)))
    with pytest.raises(RecordMismatchError, match="key: a rbg key array .* in the record, a threefry2x32"):
        threefry.load_record(trj.EqxModule(model).into_record(), "cpu")


def test_equinox_mismatched_shapes_are_refused_and_change_nothing():
    model = Counted(0)
    rec = trj.EqxModule(model).into_record()
    held = trj.EqxModule(Counted(1, width=5))
    live = held.model
    with pytest.raises(RecordMismatchError, match=r"mlp.layers.0.weight: shape \(4, 3\) in the record, \(5, 3\) live"):
        held.load_record(rec, "cpu")
    assert held.model is live


def test_equinox_unrecordable_leaf_names_its_path_and_the_fix():
    class Complex(eqx.Module):
        w: jax.Array
        phase: jax.Array

    m = Complex(jnp.ones(2), jnp.ones(2, jnp.complex64))
    with pytest.raises(TypeError, match=r"leaf 'phase' .*eqx.partition"):
        trj.EqxModule(m).into_record()


# -- fresh-process continuation -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nnx", "equinox"])
def test_resume_mid_window_in_a_fresh_process_is_bitwise_identical(kind, tmp_path):
    import jax_native_loops as loops

    model, optimizer, acc, state, data = loops.build(kind)
    model = loops.train(model, optimizer, acc, state, data, loops.STEPS)
    reference = loops.final(model, optimizer).into_item(NativePrecisionSettings())
    at = loops.WINDOW + 2  # 2 micro-steps of the second window pending
    loops.checkpoint(kind, at, tmp_path / "ckpt.mpk")
    assert len(TrainingRecord.load(DefaultRecorder(), tmp_path / "ckpt.mpk").grads.grads) > 0
    done = subprocess.run([sys.executable, str(LOOPS), kind, str(tmp_path / "ckpt.mpk"), str(tmp_path / "out.mpk")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    exact, diff, paths = compare_items(reference, read_file(tmp_path / "out.mpk")[1])
    assert exact, f"{kind}: differs at {paths[:5]} (max {diff})"
    # the pending gradients matter: the same resume without them does not match
    model, optimizer, _, _, data = loops.build(kind)
    rec = TrainingRecord.load(DefaultRecorder(), tmp_path / "ckpt.mpk", "cpu", state_type=loops.State)
    restored = rec.restore(model, optimizer, None, "cpu")
    restored.state.rng.apply(data)
    model = loops.train(restored.model, optimizer, GradientsAccumulator(), restored.state, data, loops.STEPS)
    exact, diff, _ = compare_items(reference, loops.final(model, optimizer).into_item(NativePrecisionSettings()))
    assert not exact and diff > 0


def test_a_pytree_holder_names_the_unrecordable_leaf_and_the_fix():
    with pytest.raises(TypeError, match=r"leaf 'mlp.activation' \(custom_jvp\).*EqxModule"):
        trj.JaxModule({"mlp": {"w": jnp.ones(2), "activation": jax.nn.relu}}).into_record()


def test_nnx_optimizer_of_another_state_is_refused_and_changes_nothing():
    model, opt = nnx_trained(0)
    rec = trainrec.adapt(opt).into_record(trainrec.adapt(model))
    assert rec.kind == "flax.nnx.Optimizer" and rec.item["#transforms"][0].startswith("scale_by_adam")
    other = Net(1)
    sgd = nnx.Optimizer(other, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    before = nnx.clone(nnx.state(sgd))
    with pytest.raises(RecordMismatchError, match="optimizer"):
        trj.NnxOptimizer(sgd).load_record(rec, trj.NnxModule(other), "cpu")
    assert same(nnx.state(sgd), before)
