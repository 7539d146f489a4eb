"""Attacks on the JAX adapter (issue 16): wrong gradient types and traced values."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
np = pytest.importorskip("numpy")

import trainrec.adapters.jax as trj  # noqa: E402
from trainrec import GradientsAccumulator, GradientsParams  # noqa: E402


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
