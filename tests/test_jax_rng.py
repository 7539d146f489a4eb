"""`JaxRngRecord`: typed and raw JAX keys and flax nnx `Rngs`, restored exactly through
every recorder; typed keys in module trees; misuse refused; a fresh-process continuation
of a jitted dropout step is bitwise equal to the uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _zygote import Zygote

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.jax as trj  # noqa: E402
from trainrec import (  # noqa: E402
    CompactRecorder,
    CorruptRecordError,
    DefaultRecorder,
    GradientsAccumulator,
    NamedMpkFileRecorder,
    NamedMpkGzFileRecorder,
    NativePrecisionSettings,
    RecordMismatchError,
    RngRecord,
    TrainingRecord,
)


@trainrec.record
class State:
    raw: jax.Array  # a raw key as a plain field: uint32 under every recorder
    rng: trj.JaxRngRecord | None = None


def _keys():
    return [jax.random.key(1), jax.random.key(2, impl="rbg"), jax.random.key(3, impl="unsafe_rbg"),
            jax.random.split(jax.random.key(4), 3), jax.random.split(jax.random.key(5, impl="rbg"), (2, 2)),
            jax.random.PRNGKey(6), jax.random.split(jax.random.PRNGKey(7), 4)]


def _fresh_keys():
    """Live keys of the same kinds and shapes, other values."""
    return [jax.random.key(0), jax.random.key(0, impl="rbg"), jax.random.key(0, impl="unsafe_rbg"),
            jax.random.split(jax.random.key(0), 3), jax.random.split(jax.random.key(0, impl="rbg"), (2, 2)),
            jax.random.PRNGKey(0), jax.random.split(jax.random.PRNGKey(0), 4)]


def _bits(key):
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return str(jax.random.key_impl(key)), key.shape, np.asarray(jax.random.key_data(key)).tobytes()
    return str(key.dtype), key.shape, np.asarray(key).tobytes()


def _components():
    module = trj.JaxModule({"w": jnp.ones((2, 2))})
    tx = optax.sgd(0.1)
    return module, trj.JaxOptimizer(tx, tx.init(module.params))


def _torch_recorder():
    pytest.importorskip("torch")
    from trainrec.adapters.torch import TorchFileRecorder

    return TorchFileRecorder()


RECORDERS = {
    "default": (DefaultRecorder, "c.mpk"),
    "compact": (CompactRecorder, "c.mpk"),
    "native": (lambda: NamedMpkFileRecorder(NativePrecisionSettings()), "c.mpk"),
    "gz": (NamedMpkGzFileRecorder, "c.mpk.gz"),
    "pt": (_torch_recorder, "c.pt"),
    "flax": (trj.FlaxMsgpackFileRecorder, "c.msgpack"),
}


@pytest.mark.parametrize("name", list(RECORDERS))
def test_every_key_kind_and_nnx_rngs_round_trip_exactly(tmp_path, name):
    make, filename = RECORDERS[name]
    recorder = make()
    data = np.random.default_rng(3)
    rngs = nnx.Rngs(0, dropout=jax.random.key(9, impl="rbg"))
    rngs.dropout()
    rngs.dropout()
    keys = _keys()
    module, optimizer = _components()
    state = State(raw=jax.random.PRNGKey(11), rng=trj.JaxRngRecord.capture(data, *keys, rngs))
    expected_draw = np.random.default_rng(3).random()
    TrainingRecord.capture(module, optimizer, None, GradientsAccumulator(), state).save(recorder, tmp_path / filename)

    back = TrainingRecord.load(recorder, tmp_path / filename, "cpu", state_type=State).state
    assert back.raw.dtype == jnp.uint32 and _bits(back.raw) == _bits(jax.random.PRNGKey(11))
    data.random()  # moves on: apply must put it back
    live_rngs = nnx.Rngs(5, dropout=jax.random.key(1, impl="rbg"))
    restored = back.rng.apply(data, *_fresh_keys(), live_rngs)
    assert [_bits(k) for k in restored] == [_bits(k) for k in keys]
    assert all(r.dtype == k.dtype for r, k in zip(restored, keys))  # key<fry>, key<rbg>, uint32 ...
    assert data.random() == expected_draw
    assert int(live_rngs.dropout.count[...]) == 2 and int(live_rngs.default.count[...]) == 0
    assert _bits(live_rngs.dropout()) == _bits(rngs.dropout()) and _bits(live_rngs.default()) == _bits(rngs.default())


def test_typed_keys_in_module_trees_round_trip_and_refuse_another_impl():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    src = Net(nnx.Rngs(0, dropout=jax.random.key(1, impl="rbg")))
    src.drop.rngs()
    module = trj.JaxModule(nnx.state(src))
    recorder = trainrec.NamedMpkBytesRecorder(NativePrecisionSettings())
    captured = TrainingRecord.capture(module, _components()[1], None, GradientsAccumulator(),
                                      State(raw=jax.random.PRNGKey(0)))
    rec = TrainingRecord.load(recorder, captured.save(recorder), "cpu", state_type=State)
    assert rec.model.item["drop.rngs.key"]["impl"] == "rbg"
    dst = Net(nnx.Rngs(5, dropout=jax.random.key(6, impl="rbg")))
    target = trj.JaxModule(nnx.state(dst))
    target.load_record(rec.model, "cpu")
    nnx.update(dst, target.params)
    assert _bits(dst.drop.rngs.key[...]) == _bits(src.drop.rngs.key[...])
    assert int(dst.drop.rngs.count[...]) == 1

    other = Net(nnx.Rngs(5, dropout=jax.random.key(6)))  # threefry, not rbg
    live = trj.JaxModule(nnx.state(other))
    before = live.params
    with pytest.raises(RecordMismatchError, match="drop.rngs.key: a rbg key"):
        live.load_record(rec.model, "cpu")
    assert live.params is before


def test_misuse_is_refused_clearly():
    with pytest.raises(TypeError, match="not a JAX key|JaxRngRecord takes"):
        trj.JaxRngRecord.capture(jnp.ones(2))  # a float array is no key
    with pytest.raises(TypeError, match="JaxRngRecord takes"):
        trj.JaxRngRecord.capture(42)
    with pytest.raises(TypeError, match="JaxRngRecord"):
        RngRecord.capture(jax.random.PRNGKey(0))
    module, optimizer = _components()
    with pytest.raises(TypeError, match="'raw'.*typed JAX key.*JaxRngRecord"):
        TrainingRecord.capture(module, optimizer, None, GradientsAccumulator(), State(raw=jax.random.key(0)))

    data, rngs = np.random.default_rng(0), nnx.Rngs(0)
    rec = trj.JaxRngRecord.capture(data, jax.random.key(0), rngs)
    with pytest.raises(ValueError, match="1 JAX keys, 0 given"):
        rec.apply(data, rngs)
    draw_state = data.bit_generator.state
    rngs.default()
    count = int(rngs.default.count[...])
    for wrong, match in [(jax.random.key(0, impl="rbg"), "threefry2x32 key .* in the record, a rbg key"),
                         (jax.random.PRNGKey(0), "in the record, a raw uint32 key"),
                         (jax.random.split(jax.random.key(0), 2), r"shape \(2,\)\) in the record.*shape \(2, 2\)\) live")]:
        data.random()
        draw_state = data.bit_generator.state
        with pytest.raises(RecordMismatchError, match=match):
            rec.apply(data, wrong, rngs)
        assert data.bit_generator.state == draw_state and int(rngs.default.count[...]) == count  # unchanged
    with pytest.raises(RecordMismatchError, match="streams differ"):
        rec.apply(data, jax.random.key(0), nnx.Rngs(0, dropout=1))
    assert data.bit_generator.state == draw_state

    item = rec.into_item(NativePrecisionSettings())
    item["keys"][0]["data"] = trainrec.TensorData.from_array(np.zeros(2, np.int32))
    with pytest.raises(CorruptRecordError, match="uint32"):
        trj.JaxRngRecord.from_item(item)
    item["keys"][0] = {"impl": "no_such_impl", "data": trainrec.TensorData.from_array(np.zeros(2, np.uint32))}
    with pytest.raises((CorruptRecordError, RecordMismatchError)):
        trj.JaxRngRecord.from_item(item).apply(data, jax.random.key(0), rngs)


def test_fresh_process_continuation_of_a_jitted_dropout_step_is_bitwise(tmp_path):
    script = str(Path(__file__).with_name("jax_rng_run.py"))
    # each run a process of its own forked from a zygote that imported jax, optax and flax
    # once: the reference and the checkpoint from one, the resumes from another (no resume
    # shares an interpreter with the run that wrote its checkpoint)
    preload = ["jax", "jax.numpy", "optax", "flax.nnx", "trainrec.adapters.jax"]
    with Zygote(preload) as first, Zygote(preload) as second:
        def run(zygote, *args):
            (res,) = zygote.run([{"argv": [script, *map(str, args)]}])
            assert res.returncode == 0, res.stderr

        run(first, "reference", tmp_path / "ref.npz")
        run(first, "checkpoint", tmp_path / "ckpt.mpk", 4)
        run(second, "resume", tmp_path / "ckpt.mpk", tmp_path / "resumed.npz")
        run(second, "resume-without-rng", tmp_path / "ckpt.mpk", tmp_path / "fresh-keys.npz")
    ref, resumed = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(ref.files) == sorted(resumed.files)
    for k in ref.files:
        assert ref[k].dtype == resumed[k].dtype and ref[k].tobytes() == resumed[k].tobytes(), k
    assert str(resumed["dropout_impl"]) == "rbg" and resumed["data"].dtype == np.uint32
    assert np.load(tmp_path / "fresh-keys.npz")["p_w1"].tobytes() != ref["p_w1"].tobytes()  # the test can fail
