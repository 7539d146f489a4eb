"""Restore into abstract targets (`jax.ShapeDtypeStruct` leaves, as `jax.eval_shape`,
`nnx.eval_shape` and `eqx.filter_eval_shape` give: the Orbax pattern): the targets come
back holding concrete `jax.Array`s placed by their shardings, a mismatch is refused with
the error a concrete target gets and changes nothing, and training continues bitwise.
Shardings over several devices: tests/test_jax_sharded.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.jax as trj  # noqa: E402
from trainrec import (  # noqa: E402
    GradientsAccumulator,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    RecorderError,
    RecordMismatchError,
    TrainingRecord,
)

K = 3  # micro-steps per window
RECORDER = NamedMpkFileRecorder(NativePrecisionSettings())


@trainrec.record
class Step:
    micro: int


def init(key):
    k1, k2 = jax.random.split(key)
    return {"params": {"dense": {"kernel": jax.random.normal(k1, (4, 8)), "bias": jnp.zeros(8, jnp.bfloat16)},
                       "out": {"kernel": jax.random.normal(k2, (8, 2))}},
            "rng": {"key": jax.random.key(9)}}


def trainable(variables):
    return variables["params"]


def make_tx():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-3))


def loss(p, x):
    h = jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"].astype(jnp.float32))
    return jnp.mean((h @ p["out"]["kernel"]) ** 2)


grad_fn = jax.jit(jax.grad(loss))
TX = make_tx()
update = jax.jit(TX.update)  # one compilation, not one per eager op


class Run:
    """A JaxModule of flax-style variables, a typed key (recorded, not trained) next to
    the parameters, adamw on a schedule, accumulation over K micro-steps."""

    def __init__(self, model, optimizer, acc, state):
        self.model, self.optimizer, self.acc, self.state = model, optimizer, acc, state

    @classmethod
    def fresh(cls, seed=0):
        params = init(jax.random.key(seed))
        return cls(trj.JaxModule(params), trj.JaxOptimizer(TX, TX.init(trainable(params))),
                   GradientsAccumulator(), Step(0))

    def train(self, until):
        while self.state.micro < until:
            x = jnp.asarray(np.random.default_rng(self.state.micro).normal(size=(6, 4)), jnp.float32)
            g = grad_fn(trainable(self.model.params), x)
            self.acc.accumulate(self.model, trj.grads_from(g, self.model))
            self.state.micro += 1
            if self.state.micro % K == 0:
                grads = trj.to_tree(self.acc.grads(), self.model)
                p = trainable(self.model.params)
                assert self.optimizer.tx is TX
                updates, self.optimizer.opt_state = update(grads, self.optimizer.opt_state, p)
                self.model.params = {**self.model.params, "params": optax.apply_updates(p, updates)}
        return self


def abstract_targets():
    abstract = jax.eval_shape(init, jax.random.key(0))
    return trj.JaxModule(abstract), trj.JaxOptimizer(TX, jax.eval_shape(TX.init, trainable(abstract)))


def leaves_equal(a, b):
    def host(x):
        return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        host(x).dtype == host(y).dtype and host(x).tobytes() == host(y).tobytes() for x, y in zip(la, lb))


def test_training_record_restores_into_eval_shape_targets_and_continues_bitwise(tmp_path: Path):
    reference = Run.fresh().train(5)  # mid-window: 2 of 3 micro-steps pending
    assert reference.acc.pending_ids()
    TrainingRecord.capture(reference.model, reference.optimizer, None, reference.acc, reference.state).save(
        RECORDER, tmp_path / "ckpt.mpk")
    reference.train(12)

    model, optimizer = abstract_targets()
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves((model.params, optimizer.opt_state)))
    rec = TrainingRecord.load(RECORDER, tmp_path / "ckpt.mpk", state_type=Step)
    r = rec.restore(model, optimizer, None, None)
    assert r.model is model and r.optimizer is optimizer
    for leaf in jax.tree.leaves((model.params, optimizer.opt_state, dict(r.accumulator._pending))):
        assert isinstance(leaf, jax.Array), type(leaf)
    assert model.params["params"]["dense"]["bias"].dtype == jnp.bfloat16
    assert str(jax.random.key_impl(model.params["rng"]["key"])) == "threefry2x32"
    assert sorted(r.accumulator.pending_ids()) == ["params.dense.bias", "params.dense.kernel", "params.out.kernel"]
    resumed = Run(model, optimizer, r.accumulator, r.state).train(12)
    assert leaves_equal(resumed.model.params, reference.model.params)
    assert leaves_equal(resumed.optimizer.opt_state, reference.optimizer.opt_state)


def test_restore_tree_gives_each_component_as_a_concrete_tree():
    run = Run.fresh().train(4)  # one window applied, one micro-step pending
    rec = TrainingRecord.capture(run.model, run.optimizer, None, run.acc, run.state)
    abstract = jax.eval_shape(init, jax.random.key(0))
    params = trj.restore_tree(rec.model, abstract)
    assert leaves_equal(params, run.model.params) and all(isinstance(v, jax.Array) for v in jax.tree.leaves(params))
    tx = make_tx()
    opt_state = trj.restore_tree(rec.optimizer, jax.eval_shape(tx.init, trainable(abstract)), tx=tx)
    assert leaves_equal(opt_state, run.optimizer.opt_state)
    pending = trj.restore_tree(rec.grads, None, module=trj.JaxModule(abstract))
    assert leaves_equal(pending, trj.to_tree(GradientsAccumulator.grads(run.acc), run.model))
    empty = TrainingRecord.capture(run.model, run.optimizer, None, GradientsAccumulator(), run.state)
    assert trj.restore_tree(empty.grads, None, module=trj.JaxModule(abstract)) is None  # accumulate_tree's start

    with pytest.raises(TypeError, match="needs tx="):
        trj.restore_tree(rec.optimizer, jax.eval_shape(tx.init, trainable(abstract)))
    with pytest.raises(TypeError, match="needs module="):
        trj.restore_tree(rec.grads, None)
    with pytest.raises(TypeError, match="component of a TrainingRecord"):
        trj.restore_tree(rec, abstract)
    with pytest.raises(RecordMismatchError, match="hyperparameters of the live optax optimizer differ"):  # identity still checked
        trj.restore_tree(rec.optimizer, jax.eval_shape(tx.init, trainable(abstract)), tx=optax.chain(
            optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-3)))


def _reshaped(tree, path, shape=None, dtype=None):
    """`tree` with the leaf at `path` (a tuple of keys) of another shape or dtype."""
    def change(p, leaf):
        if tuple(k.key for k in p) != path:
            return leaf
        new_shape, new_dtype = shape or leaf.shape, dtype or leaf.dtype
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(new_shape, new_dtype)
        return jnp.zeros(new_shape, new_dtype)
    return jax.tree_util.tree_map_with_path(change, tree)


@pytest.mark.parametrize("change", [dict(shape=(5, 8)), dict(dtype=jnp.int32)], ids=["shape", "dtype"])
def test_a_mismatch_is_refused_as_for_concrete_targets_and_changes_nothing(change):
    run = Run.fresh().train(2)
    rec = TrainingRecord.capture(run.model, run.optimizer, None, run.acc, run.state)
    errors = []
    for make in (lambda: init(jax.random.key(1)), lambda: jax.eval_shape(init, jax.random.key(0))):
        tree = _reshaped(make(), ("params", "dense", "kernel"), **change)
        tx = make_tx()
        opt_state = jax.eval_shape(tx.init, trainable(tree)) if change.get("shape") is None else \
            jax.eval_shape(tx.init, trainable(make()))
        model, optimizer = trj.JaxModule(tree), trj.JaxOptimizer(tx, opt_state)
        with pytest.raises(RecordMismatchError) as e:
            rec.restore(model, optimizer, None, None)
        assert model.params is tree and optimizer.opt_state is opt_state  # nothing assigned
        with pytest.raises(RecordMismatchError) as e2:
            trj.restore_tree(rec.model, tree)
        errors.append((str(e.value), str(e2.value)))
    assert errors[0] == errors[1]  # the same error, word for word, concrete or abstract
    assert "params.dense.kernel" in errors[0][0]


def test_capturing_an_abstract_target_is_a_type_error_naming_the_leaf():
    model, optimizer = abstract_targets()
    with pytest.raises(TypeError, match=r"leaf 'params.dense.bias' is abstract .* restore a record into it first"):
        model.into_record()
    with pytest.raises(TypeError, match=r"leaf '1.0.count' is abstract"):
        optimizer.into_record(model)


def test_a_failed_write_puts_abstract_targets_back(monkeypatch):
    run = Run.fresh().train(2)
    rec = TrainingRecord.capture(run.model, run.optimizer, None, run.acc, run.state)
    model, optimizer = abstract_targets()
    tree, opt_state = model.params, optimizer.opt_state

    def fail(self, record, module, device):
        self.opt_state = "half written"
        raise OSError("device lost")

    monkeypatch.setattr(trj.JaxOptimizer, "load_record", fail)
    with pytest.raises(RecorderError, match="rolled back"):
        rec.restore(model, optimizer, None, None)
    assert model.params is tree and optimizer.opt_state is opt_state


def test_a_device_that_is_not_there_is_refused_before_anything_changes():
    run = Run.fresh().train(2)
    rec = TrainingRecord.capture(run.model, run.optimizer, None, run.acc, run.state)
    model, optimizer = abstract_targets()
    tree = model.params
    with pytest.raises(RecordMismatchError, match="cannot restore onto device 'cpu:9'"):
        rec.restore(model, optimizer, None, "cpu:9")
    assert model.params is tree


def test_a_target_without_sharding_goes_to_the_device_given():
    rec = trj.JaxModule({"w": jnp.arange(6.0).reshape(2, 3)}).into_record()
    target = trj.JaxModule({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)})
    target.load_record(rec, "cpu:0")
    assert target.params["w"].devices() == {jax.devices("cpu")[0]}
    sharded = jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert trj.restore_tree(rec, {"w": sharded})["w"].sharding == sharded.sharding


def test_nnx_module_from_eval_shape_is_restored_in_place():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, seed):
            rngs = nnx.Rngs(params=seed, dropout=seed + 1)
            self.linear = nnx.Linear(3, 4, rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.norm(self.linear(x)))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    model = Net(0)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    opt.update(model, nnx.grad(loss)(model, jnp.ones((2, 3))))
    acc = GradientsAccumulator()
    acc.accumulate(model, trj.grads_from(nnx.grad(loss)(model, jnp.ones((2, 3))), model))
    rec = TrainingRecord.capture(model, opt, None, acc, Step(1))

    abstract = nnx.eval_shape(lambda: Net(5))
    abstract_opt = nnx.eval_shape(lambda: nnx.Optimizer(Net(5), optax.adam(1e-2), wrt=nnx.Param))
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(nnx.state(abstract)))
    with pytest.raises(TypeError, match="is abstract"):
        trj.NnxModule(abstract).into_record()
    def fail(self, record, module, device):
        raise OSError("device lost")

    with pytest.MonkeyPatch.context() as mp:  # a failed write puts the abstract state back
        mp.setattr(trj.NnxOptimizer, "load_record", fail)
        with pytest.raises(RecorderError, match="rolled back"):
            rec.restore(abstract, abstract_opt, None, None)
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(nnx.state(abstract)))
    r = rec.restore(abstract, abstract_opt, None, None)
    assert r.model is abstract
    for leaf in jax.tree.leaves((nnx.state(abstract), nnx.state(abstract_opt))):
        assert isinstance(leaf, jax.Array), type(leaf)
    assert leaves_equal(nnx.state(abstract), nnx.state(model))
    assert leaves_equal(nnx.state(abstract_opt), nnx.state(opt))
    x = jnp.ones((2, 3))
    assert np.array_equal(np.asarray(abstract(x)), np.asarray(model(x)))  # dropout keys too


def test_equinox_module_from_filter_eval_shape_is_restored_as_a_concrete_module():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.relu, key=jax.random.key(0))
    rec = trj.EqxModule(model).into_record()
    abstract = eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 4, 1, activation=jax.nn.relu, key=jax.random.key(7))
    bound = trj.EqxModule(abstract)
    assert bound.param_ids() == trj.EqxModule(model).param_ids()  # abstract inexact leaves are trainable
    restored = trj.restore_tree(rec, abstract)
    assert restored.activation is jax.nn.relu
    assert leaves_equal(eqx.filter(restored, eqx.is_array), eqx.filter(model, eqx.is_array))
    x = jnp.ones(3)
    assert np.array_equal(np.asarray(restored(x)), np.asarray(model(x)))
    wide = eqx.filter_eval_shape(eqx.nn.MLP, 3, 2, 5, 1, key=jax.random.key(7))
    with pytest.raises(RecordMismatchError, match="shape"):
        trj.restore_tree(rec, wide)
