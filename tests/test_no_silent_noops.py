"""No silent no-ops: gradients that reach no parameter, and empty gradients set before a
step, raise instead of training on zeros."""

from __future__ import annotations

import numpy as np
import pytest

from trainrec import GradientsAccumulator, GradientsParams
from trainrec.adapters.numpy import MLP


def test_accumulate_with_no_gradient_for_the_module_raises_naming_some_of_each():
    model = MLP([3, 4, 2], seed=0)
    acc = GradientsAccumulator()
    acc.accumulate(model, GradientsParams({"layers.0.bias": np.ones(4, np.float32)}))
    before = {k: t.array.copy() for k, t in acc.try_to_record().grads.items()}
    stray = GradientsParams({f"Dense_{i}.kernel": np.ones(3, np.float32) for i in range(5)})
    with pytest.raises(ValueError) as e:
        acc.accumulate(model, stray)
    msg = str(e.value)
    assert "none of the 5 gradients" in msg
    assert "'Dense_0.kernel', 'Dense_1.kernel', 'Dense_2.kernel', ... (5 in all)" in msg
    assert "'layers.0.weight'" in msg
    after = {k: t.array for k, t in acc.try_to_record().grads.items()}
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)


def test_stray_gradients_beside_matching_ones_are_still_ignored():
    model = MLP([3, 2], seed=0)
    acc = GradientsAccumulator()
    g = GradientsParams({"layers.0.bias": np.ones(2, np.float32), "elsewhere": np.ones(1, np.float32)})
    acc.accumulate(model, g)
    assert list(acc.grads()) == ["layers.0.bias"]


def test_empty_gradients_are_accepted_by_accumulate():
    acc = GradientsAccumulator()
    acc.accumulate(MLP([3, 2], seed=0), GradientsParams())
    assert acc.grads().is_empty()


# -- torch ---------------------------------------------------------------------------------


def test_set_grads_with_empty_grads_raises_unless_allowed():
    torch = pytest.importorskip("torch")
    trt = pytest.importorskip("trainrec.adapters.torch")
    model = torch.nn.Linear(3, 2)
    acc = GradientsAccumulator()
    model(torch.ones(3)).sum().backward()
    acc.accumulate(model, trt.grads_from(model))
    trt.set_grads(model, acc.grads())
    assert model.weight.grad is not None
    with pytest.raises(ValueError, match="grads is empty"):
        trt.set_grads(model, acc.grads())  # taken twice: the step would do nothing
    assert model.weight.grad is not None  # unchanged
    trt.set_grads(model, acc.grads(), allow_empty=True)
    assert model.weight.grad is None


# -- JAX -------------------------------------------------------------------------------------


def _linen():
    jax = pytest.importorskip("jax")
    nn = pytest.importorskip("flax.linen")
    import jax.numpy as jnp

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.BatchNorm(use_running_average=not train)(x)
            return nn.Dense(2)(x)

    variables = Net().init(jax.random.key(0), jnp.ones((4, 3)))

    def loss(params, batch_stats):
        out = Net().apply({"params": params, "batch_stats": batch_stats}, jnp.ones((4, 3)))
        return (out ** 2).sum()

    grads = jax.grad(loss)(variables["params"], variables["batch_stats"])
    return variables, grads


@pytest.mark.parametrize("holder_kind", ["dict", "FrozenDict"])
@pytest.mark.parametrize("grads_kind", ["dict", "FrozenDict", "whole variables"])
def test_jax_grads_from_accepts_dicts_and_frozen_dicts_for_the_same_holder(holder_kind, grads_kind):
    variables, grads = _linen()
    import jax
    from flax.core import freeze, unfreeze

    import trainrec.adapters.jax as trj

    holder = freeze(variables) if holder_kind == "FrozenDict" else unfreeze(variables)
    model = trj.JaxModule(holder)
    assert sorted(model.param_ids()) == ["params.BatchNorm_0.bias", "params.BatchNorm_0.scale",
                                         "params.Dense_0.bias", "params.Dense_0.kernel"]
    tree = {"dict": unfreeze(grads), "FrozenDict": freeze(grads),
            "whole variables": {"params": unfreeze(grads)}}[grads_kind]
    g = trj.grads_from(tree, model)
    assert sorted(g) == sorted(model.param_ids())
    acc = GradientsAccumulator()
    acc.accumulate(model, g)
    out = trj.to_tree(acc.grads(), model)
    want = jax.tree_util.tree_leaves(grads)
    got = jax.tree_util.tree_leaves(out)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert any(np.abs(np.asarray(a)).sum() > 0 for a in got)  # optax gets the gradients, not zeros


def test_jax_grads_from_accepts_nnx_state_and_pure_dicts_for_the_same_holder():
    nnx = pytest.importorskip("flax.nnx")
    import jax.numpy as jnp

    import trainrec.adapters.jax as trj

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            return self.l(x)

    net = Net(nnx.Rngs(0))
    model = trj.JaxModule(nnx.state(net, nnx.Param))
    grads = nnx.grad(lambda m: (m(jnp.ones((1, 3))) ** 2).sum())(net)
    for tree in (grads, nnx.to_pure_dict(grads)):
        g = trj.grads_from(tree, model)
        assert sorted(g) == sorted(model.param_ids()) == ["l.bias", "l.kernel"]


def test_jax_grads_from_a_tree_of_another_model_raises():
    variables, _ = _linen()
    import jax.numpy as jnp

    import trainrec.adapters.jax as trj

    model = trj.JaxModule(variables)
    with pytest.raises(ValueError, match="none of the gradient tree's 1 leaves"):
        trj.grads_from({"Conv_0": {"kernel": jnp.ones(2)}}, model)
    acc = GradientsAccumulator()
    with pytest.raises(ValueError, match="none of the 1 gradients"):
        acc.accumulate(model, GradientsParams({"Conv_0.kernel": jnp.ones(2)}))


def test_set_grads_with_no_gradient_for_the_model_raises_naming_some_of_each():
    torch = pytest.importorskip("torch")
    trt = pytest.importorskip("trainrec.adapters.torch")
    model = torch.nn.Linear(3, 1)
    wrapped = torch.nn.Sequential(model)  # ParamIds "0.weight", "0.bias"
    acc = GradientsAccumulator()
    model(torch.ones(1, 3)).sum().backward()
    acc.accumulate(wrapped, trt.grads_from(wrapped))
    model.weight.grad = torch.full_like(model.weight, 5.0)
    with pytest.raises(ValueError) as e:
        trt.set_grads(model, acc.grads())  # model's ParamIds: "weight", "bias"
    msg = str(e.value)
    assert "none of the 2 gradients" in msg and "'0.weight'" in msg and "'weight'" in msg
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 5.0))  # unchanged
    with pytest.raises(ValueError, match="none of the 2"):
        trt.set_grads(model, GradientsParams({"0.weight": torch.ones(1, 3), "x": torch.ones(1)}),
                      allow_empty=True)  # allow_empty is for empty grads, not for strays


def test_set_grads_writes_nothing_when_a_gradient_does_not_fit():
    torch = pytest.importorskip("torch")
    trt = pytest.importorskip("trainrec.adapters.torch")
    model = torch.nn.Linear(3, 1)  # "weight" comes before "bias"
    with pytest.raises(ValueError, match="'bias'"):
        trt.set_grads(model, GradientsParams({"weight": torch.ones(1, 3), "bias": torch.ones(7)}))
    assert model.weight.grad is None and model.bias.grad is None


def test_jax_to_tree_refuses_empty_and_unmatched_gradients():
    jnp = pytest.importorskip("jax.numpy")
    trj = pytest.importorskip("trainrec.adapters.jax")
    module = trj.JaxModule({"w": jnp.ones(3), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match="grads is empty"):
        trj.to_tree(GradientsParams(), module)  # e.g. acc.grads() taken twice
    zeros = trj.to_tree(GradientsParams(), module, allow_empty=True)
    assert all((np.asarray(v) == 0).all() for v in zeros.values())
    with pytest.raises(ValueError) as e:
        trj.to_tree(GradientsParams({"x": jnp.ones(3), "params.w": jnp.ones(3)}), module,
                    allow_empty=True)
    assert "none of the 2 gradients" in str(e.value) and "'params.w'" in str(e.value)
    assert "'w'" in str(e.value)
    partial = trj.to_tree(GradientsParams({"w": jnp.full(3, 2.0), "x": jnp.ones(1)}), module)
    assert np.asarray(partial["w"]).tolist() == [2.0] * 3 and np.asarray(partial["b"]).tolist() == [0.0] * 2
