"""The JAX adapter's messages and its `jax` extra alone (issue 31, item 6): `JaxRngRecord`
works with flax blocked from import, and flax containers that are no model or optimizer
(a linen `TrainState`, a bare `nnx.State`) are refused with what to pass instead."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")

_NO_FLAX = """
import sys

class NoFlax:  # as if only the `jax` extra were installed
    def find_spec(self, name, path=None, target=None):
        if name == "flax" or name.startswith("flax."):
            raise ImportError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, NoFlax())
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_NO_FLAX) + textwrap.dedent(code)],
                          capture_output=True, text=True)


def test_jax_rng_record_captures_and_applies_with_flax_blocked():
    done = _run("""
        import jax, numpy as np
        import trainrec
        import trainrec.adapters.jax as trj
        from trainrec import NamedMpkBytesRecorder, NativePrecisionSettings

        @trainrec.record
        class State:
            rng: trj.JaxRngRecord | None = None

        key, raw, gen = jax.random.key(3), jax.random.PRNGKey(4), np.random.default_rng(5)
        state = State(trj.JaxRngRecord.capture(key, raw, gen))
        r = NamedMpkBytesRecorder(NativePrecisionSettings())
        back = r.load(r.record(state, None), None, State)
        expected = gen.normal(size=3)
        new_key, new_raw = back.rng.apply(jax.random.key(0), jax.random.PRNGKey(0), gen)
        assert (jax.random.key_data(new_key) == jax.random.key_data(key)).all()
        assert (new_raw == raw).all() and (gen.normal(size=3) == expected).all()
        assert not any(m == "flax" or m.startswith("flax.") for m in sys.modules)
        print("ok")
        """)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_blocker_blocks_flax():
    """The test above means something only if flax cannot be imported under the blocker."""
    pytest.importorskip("flax")
    done = _run("import flax\n")
    assert done.returncode != 0 and "blocked" in done.stderr


def test_a_flax_train_state_is_refused_naming_what_to_pass():
    pytest.importorskip("flax")
    optax = pytest.importorskip("optax")
    import jax.numpy as jnp
    from flax.training.train_state import TrainState

    import trainrec
    from trainrec import GradientsAccumulator, TrainingRecord

    @trainrec.record
    class S:
        step: int = 0

    state = TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1))
    for call in (lambda: trainrec.adapt(state),
                 lambda: TrainingRecord.capture(state, state, None, GradientsAccumulator(), S())):
        with pytest.raises(TypeError, match=r"TrainState holds the model's params and the optimizer's state "
                                            r"together: pass trainrec\.adapters\.jax\.JaxModule\(state\.params\) "
                                            r"as the model and JaxOptimizer\(state\.tx, state\.opt_state\)") as e:
            call()
        assert "install the adapter" not in str(e.value)


def test_a_bare_nnx_state_is_refused_naming_the_module():
    nnx = pytest.importorskip("flax.nnx")

    import trainrec
    import trainrec.adapters.jax as trj

    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    state = nnx.state(model)
    with pytest.raises(TypeError, match=r"a bare nnx\.State says nothing of which variables are trainable: "
                                        r"pass the nnx\.Module") as e:
        trainrec.adapt(state)
    assert "install the adapter" not in str(e.value)
    assert trj.JaxModule(state).param_ids() == ["bias", "kernel"]  # held, it is a pytree like any
