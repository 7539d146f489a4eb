"""Accumulation on JAX at jit speed: `accumulate` in one jitted dispatch (the backend's
`add_many`), bitwise what the per-leaf path gives; `accumulate_tree` inside a jitted step
with `GradientsAccumulator.adopt` for capture; `optax.MultiSteps` as the other exact path.
No timing here: benchmarks/accumulate.py measures the speed."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.jax as trj  # noqa: E402
from trainrec import (  # noqa: E402
    FloatDType,
    GradientsAccumulator,
    GradientsParams,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    TrainingRecord,
)
from trainrec.adapters.jax import backend, bindings  # noqa: E402


@trainrec.record
class Micro:
    micro: int


class PerLeaf(trj.JaxBackend):
    """The JAX backend without its `add_many`: the accumulator's pair-by-pair path."""

    add_many = None


def tree(seed: int, dtypes=(jnp.float32, jnp.float32, jnp.float32), big: bool = False) -> dict:
    """Three leaves; with `big`, a fourth of 2**18 elements (added in its own dispatch)."""
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    out = {"a": {"w": jax.random.normal(k[0], (4, 3)).astype(dtypes[0])},
           "b": jax.random.normal(k[1], (5,)).astype(dtypes[1]),
           "c": jax.random.normal(k[2], ()).astype(dtypes[2])}
    if big:
        out["d"] = jax.random.normal(k[3], (512, 512)).astype(dtypes[1])
    return out


def bits(x) -> tuple:
    a = np.asarray(x)
    return str(a.dtype), a.shape, a.tobytes()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bits(a[k]) == bits(b[k]) for k in a)


def pending(acc: GradientsAccumulator) -> dict:
    return {k: t.array.copy() for k, t in acc.try_to_record().grads.items()}


def roundtrip(rec: TrainingRecord) -> TrainingRecord:
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    return TrainingRecord.load(r, rec.save(r), "cpu", state_type=Micro)


MIXED = [(jnp.float32, jnp.bfloat16, jnp.float16), (jnp.bfloat16, jnp.float16, jnp.float32),
         (jnp.float16, jnp.float32, jnp.bfloat16)]


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("first", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_one_dispatch_is_bitwise_the_per_leaf_path(first, big):
    """Pending f32 / bf16 / f16, incoming of mixed dtypes, then `accumulate_with_dtype`
    (which casts both): the jitted path, the per-leaf path and `accumulate_tree` agree bit
    for bit, dtypes included."""
    module = trj.JaxModule(tree(0, big=big))
    fast, slow = GradientsAccumulator(), GradientsAccumulator(backend=PerLeaf())
    steps = [(tree(1, (first,) * 3, big), None)] + [(tree(2 + i, d, big), None) for i, d in enumerate(MIXED)]
    steps += [(tree(9, MIXED[0], big), FloatDType.F32), (tree(10, MIXED[1], big), None),
              (tree(11, MIXED[2], big), FloatDType.BF16)]
    pure = None
    for g, dtype in steps:
        for acc in (fast, slow):
            grads = trj.grads_from(g, module)
            if dtype is None:
                acc.accumulate(module, grads)
            else:
                acc.accumulate_with_dtype(module, grads, dtype)
        pure = jax.jit(trj.accumulate_tree, static_argnums=2)(pure, g, None if dtype is None else dtype.dtype)
        assert same(pending(fast), pending(slow))
        assert same(pending(fast), {k: np.asarray(v) for k, v in bindings.flatten(pure)[0].items()})
    assert {str(v.dtype) for v in pending(fast).values()} == {"bfloat16"}


def test_a_bad_gradient_anywhere_changes_nothing():
    """Shape mismatch (one that would broadcast, on the last leaf) and gradients for no
    parameter raise before any pending value changes, on both paths."""
    module = trj.JaxModule(tree(0))
    for acc in (GradientsAccumulator(), GradientsAccumulator(backend=PerLeaf())):
        acc.accumulate(module, trj.grads_from(tree(1), module))
        before = pending(acc)
        bad = tree(2)
        bad["c"] = jnp.ones((5,), jnp.float32)  # () + (5,) would broadcast
        with pytest.raises(ValueError, match=r"'c' has shape \(5,\), parameter \(\)"):
            acc.accumulate(module, trj.grads_from(bad, module))
        assert same(pending(acc), before)
        with pytest.raises(ValueError, match="none of the 1 gradients"):
            acc.accumulate(module, GradientsParams({"nope": jnp.ones(3)}))
        assert same(pending(acc), before)
        fresh = GradientsAccumulator()
        with pytest.raises(ValueError):
            fresh.accumulate(module, trj.grads_from(bad, module))
        assert fresh.pending_ids() == [] and fresh.backend is None


def test_a_restored_pending_of_another_shape_is_refused_before_adding():
    module = trj.JaxModule(tree(0))
    src = trj.JaxModule({"a": {"w": jnp.ones((1, 3))}, "b": jnp.ones(5), "c": jnp.ones(())})
    other = GradientsAccumulator()
    other.accumulate(src, trj.grads_from(src.params, src))
    acc = GradientsAccumulator(backend=trj.JaxBackend())
    acc.load_record(other.try_to_record(), "cpu")
    before = pending(acc)
    with pytest.raises(ValueError, match=r"'a.w' has shape \(4, 3\).*pending \(1, 3\)"):
        acc.accumulate(module, trj.grads_from(tree(1), module))  # (1, 3) + (4, 3) would broadcast
    assert same(pending(acc), before)


def test_a_module_that_changed_mid_window_is_checked_again():
    """Later calls with the same module skip walking it; a reshaped parameter, another
    module, or a gradient for a parameter not pending still meets every check."""
    module = trj.JaxModule(tree(0))
    acc = GradientsAccumulator()
    acc.accumulate(module, trj.grads_from(tree(1), module))
    acc.accumulate(module, trj.grads_from(tree(2), module))
    before = pending(acc)
    module.params = {**tree(0), "b": jnp.ones(1)}  # same object, parameter 'b' reshaped
    bad = GradientsParams({**bindings.flatten(tree(3))[0], "b": jnp.ones(1)})
    with pytest.raises(ValueError, match=r"'b' has shape \(1,\), parameter \(1,\), pending \(5,\)"):
        acc.accumulate(module, bad)
    assert same(pending(acc), before)
    other = trj.JaxModule({**tree(0), "b": jnp.ones(1)})
    with pytest.raises(ValueError, match="pending"):
        acc.accumulate(other, bad)
    assert same(pending(acc), before)
    module.params = tree(0)
    extra = GradientsParams({**bindings.flatten(tree(3))[0], "zzz": jnp.ones(2)})
    acc.accumulate(module, extra)  # a gradient for no parameter is still ignored
    assert sorted(acc.pending_ids()) == ["a.w", "b", "c"]


def test_snapshots_and_the_callers_gradients_are_never_aliased():
    module = trj.JaxModule(tree(0))
    acc = GradientsAccumulator()
    g = tree(1)
    kept = {k: bits(v) for k, v in bindings.flatten(g)[0].items()}
    acc.accumulate(module, trj.grads_from(g, module))  # pending may be the caller's arrays
    rec = acc.try_to_record()
    snap = {k: bits(t.array) for k, t in rec.grads.items()}
    for i in range(3):
        acc.accumulate(module, trj.grads_from(tree(2 + i), module))
    assert {k: bits(t.array) for k, t in rec.grads.items()} == snap
    assert {k: bits(v) for k, v in bindings.flatten(g)[0].items()} == kept  # not donated, not deleted
    assert not any(v.is_deleted() for v in jax.tree.leaves(g))
    out = acc.grads()
    acc.accumulate(module, trj.grads_from(tree(7), module))
    assert not any(v.is_deleted() for v in out.values())


def test_the_jit_cache_does_not_grow_for_a_fixed_structure():
    module = trj.JaxModule(tree(0, (jnp.float16, jnp.float32, jnp.bfloat16)))
    acc = GradientsAccumulator()
    start = backend.TRACES[0]
    for i in range(12):
        acc.accumulate(module, trj.grads_from(tree(i, (jnp.float16, jnp.float32, jnp.bfloat16)), module))
    assert backend.TRACES[0] - start <= 2  # the first call (nothing pending) and the rest
    for i in range(12):
        acc.accumulate_with_dtype(module, trj.grads_from(tree(i), module), FloatDType.F32)
    assert backend.TRACES[0] - start <= 4
    module.params = tree(5)  # new arrays, same structure: no new names, no new compilations
    for i in range(5):
        acc.accumulate(module, trj.grads_from(tree(i), module))
    assert backend.TRACES[0] - start <= 4
    big, acc = trj.JaxModule(tree(0, big=True)), GradientsAccumulator()
    start = backend.TRACES[0]
    for i in range(6):
        acc.accumulate(big, trj.grads_from(tree(i, big=True), big))
    assert backend.TRACES[0] - start <= 4  # the small leaves' program and the big leaf's, each twice


def test_adopt_validates_everything_and_changes_nothing_on_error():
    module = trj.JaxModule(tree(0))
    acc = GradientsAccumulator()
    acc.accumulate(module, trj.grads_from(tree(1), module))
    before = pending(acc)
    good = bindings.flatten(tree(2))[0]
    bad_cases = [
        (ValueError, "not parameters", {**good, "zzz": jnp.ones(3)}),
        (ValueError, r"'b' has shape \(4,\)", {**good, "b": jnp.ones(4)}),
        (ValueError, "non-float dtype", {**good, "c": jnp.ones((), jnp.int32)}),
        (TypeError, "not a jax tensor", {**good, "b": np.ones(5, np.float32)}),
    ]
    for exc, msg, grads in bad_cases:
        with pytest.raises(exc, match=msg):
            acc.adopt(module, GradientsParams(grads))
        assert same(pending(acc), before)
    with pytest.raises(TypeError):
        acc.adopt(module, good)
    acc.adopt(module, GradientsParams({"b": good["b"].astype(jnp.bfloat16)}))
    assert acc.pending_ids() == ["b"] and str(pending(acc)["b"].dtype) == "bfloat16"


def loss(params, x):
    h = jnp.tanh(x @ params["a"]["w"]) * params["b"][:3].sum()
    return jnp.mean(h ** 2) + params["c"] ** 2


@jax.jit
def micro_step(pending, params, x):
    """A fully jitted micro-step that keeps its own running sum."""
    g = jax.grad(loss)(params, x)
    return trj.accumulate_tree(pending, jax.tree.map(lambda v: v / 4, g))


@jax.jit
def apply(params, opt_state, grads):
    updates, opt_state = optax.adam(1e-2).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def data(i: int):
    return jax.random.normal(jax.random.PRNGKey(100 + i), (6, 4))


def run(module, opt, acc, start, stop, pending_tree, stop_at=None):
    """Micro-steps `start..stop` (window of 4); stops mid-way at `stop_at`, adopting the
    running sum so a capture holds it."""
    for i in range(start, stop):
        pending_tree = micro_step(pending_tree, module.params, data(i))
        if (i + 1) % 4 == 0:
            module.params, opt.opt_state = apply(module.params, opt.opt_state, pending_tree)
            pending_tree = None
        if stop_at == i + 1:
            acc.adopt(module, trj.grads_from(pending_tree, module))
            return pending_tree
    return pending_tree


def fresh():
    module = trj.JaxModule(tree(0))
    tx = optax.adam(1e-2)
    return module, trj.JaxOptimizer(tx, tx.init(module.params)), GradientsAccumulator()


def test_adopted_pending_of_a_jitted_step_checkpoints_mid_window_bitwise():
    ref, ref_opt, ref_acc = fresh()
    run(ref, ref_opt, ref_acc, 0, 12, None)

    src, src_opt, src_acc = fresh()
    src_pending = run(src, src_opt, src_acc, 0, 12, None, stop_at=6)  # mid-window: 2 of 4 micro-steps summed
    assert len(src_acc.pending_ids()) == 3
    rec = roundtrip(TrainingRecord.capture(src, src_opt, None, src_acc, Micro(6)))

    dst, dst_opt, _ = fresh()
    r = rec.restore(dst, dst_opt, None, "cpu")
    assert r.state.micro == 6
    resumed = trj.to_tree(r.accumulator.grads(), dst)
    assert same(bindings.flatten(resumed)[0], bindings.flatten(src_pending)[0])
    run(dst, dst_opt, r.accumulator, 6, 12, resumed)
    assert same(bindings.flatten(dst.params)[0], bindings.flatten(ref.params)[0])
    assert same(bindings.flatten(dst_opt.opt_state)[0], bindings.flatten(ref_opt.opt_state)[0])


def test_multisteps_resumes_bitwise_mid_window():
    """`optax.MultiSteps` keeps the running sum in the optimizer state: a capture mid-window
    (mini_step 2 of 4, acc_grads non-zero) restores and continues bit for bit."""
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4)

    @jax.jit
    def step(params, opt_state, x):
        updates, opt_state = tx.update(jax.grad(loss)(params, x), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def go(module, opt, start, stop):
        for i in range(start, stop):
            module.params, opt.opt_state = step(module.params, opt.opt_state, data(i))

    def new():
        module = trj.JaxModule(tree(0))
        return module, trj.JaxOptimizer(tx, tx.init(module.params))

    ref, ref_opt = new()
    go(ref, ref_opt, 0, 12)
    src, src_opt = new()
    go(src, src_opt, 0, 6)
    assert int(src_opt.opt_state.mini_step) == 2
    assert any(bool(jnp.any(v != 0)) for v in jax.tree.leaves(src_opt.opt_state.acc_grads))
    rec = roundtrip(TrainingRecord.capture(src, src_opt, None, GradientsAccumulator(), Micro(6)))
    dst, dst_opt = new()
    rec.restore(dst, dst_opt, None, "cpu")
    go(dst, dst_opt, 6, 12)
    assert same(bindings.flatten(dst.params)[0], bindings.flatten(ref.params)[0])
    assert same(bindings.flatten(dst_opt.opt_state)[0], bindings.flatten(ref_opt.opt_state)[0])
