"""Wrappers are transparent: `torch.compile`, DDP, DataParallel (nested, at the root or
inside the model) give the plain model's ParamIds, and a record moves between a wrapped
model and the plain one, optimizer state and pending gradients included; FSDP2's
sharded parameters are refused clearly. DDP and fully_shard run in a single-process
gloo group (`HashStore`: no port). torch.compile uses the "eager" backend: the wrapper
(`OptimizedModule`, `_orig_mod.`) is the real one, without inductor's C++ build."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402, N817

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
from trainrec import GradientsAccumulator, NamedMpkBytesRecorder, RecorderError, TrainingRecord  # noqa: E402

WINDOW, STEPS, CUT = 3, 8, 5  # 5 micro-steps in: 2 gradients of the second window pending


@trainrec.record
class State:
    micro: int


@pytest.fixture(scope="module", autouse=True)
def group():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def plain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def compiled(m: nn.Module) -> nn.Module:
    return torch.compile(m, backend="eager")


def inner_compiled(m: nn.Module) -> nn.Module:
    m[0] = compiled(m[0])  # a block compiled on its own: `0._orig_mod.weight`
    return m


WRAPPERS = {
    "compile": compiled,
    "ddp": DDP,
    "dataparallel": nn.DataParallel,
    "compile(ddp)": lambda m: compiled(DDP(m)),
    "ddp(compile)": lambda m: DDP(compiled(m)),
    "inner compile": inner_compiled,
    "ddp(inner compile)": lambda m: DDP(inner_compiled(m)),
}


def build(wrap=None):
    model = plain()
    if wrap is not None:
        model = WRAPPERS[wrap](model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, acc, state, until):
    while state.micro < until:
        g = torch.Generator().manual_seed(100 + state.micro)
        x = torch.randn(6, 4, generator=g)
        nn.functional.mse_loss(model(x), torch.ones(6, 3)).backward()
        acc.accumulate(model, trt.grads_from(model))
        state.micro += 1
        if state.micro % WINDOW == 0:
            trt.set_grads(model, acc.grads())
            opt.step()
            sched.step()
            opt.zero_grad()


def uninterrupted():
    model, opt, sched = build()
    train(model, opt, sched, GradientsAccumulator(), State(0), STEPS)
    return model


@pytest.mark.parametrize("wrap", WRAPPERS)
def test_param_ids_and_gradients_are_named_as_in_the_plain_model(wrap):
    model, _, _ = build(wrap)
    want = [n for n, _ in plain().named_parameters()]
    assert [n for n, _ in model.named_parameters()] != want  # the wrapper does rename
    assert trainrec.adapt(model).param_ids() == want
    assert list(trainrec.adapt(model).param_shapes()) == want
    assert trt.unwrap(model) is not model or wrap.startswith("inner")
    model(torch.randn(6, 4)).sum().backward()
    grads = trt.grads_from(model)
    assert list(grads) == want
    assert all(p.grad is None for p in model.parameters())
    trt.set_grads(model, grads)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("direction", ["wrapped->plain", "plain->wrapped"])
@pytest.mark.parametrize("wrap", WRAPPERS)
def test_a_record_moves_between_wrapped_and_plain_and_training_continues_bitwise(wrap, direction):
    src, dst = (wrap, None) if direction == "wrapped->plain" else (None, wrap)
    model, opt, sched = build(src)
    acc, state = GradientsAccumulator(), State(0)
    train(model, opt, sched, acc, state, CUT)
    last = list(model.parameters())[-1]
    last.grad = torch.full_like(last, 0.25)  # a .grad pending natively: recorded too
    blob = TrainingRecord.capture(model, opt, sched, acc, state).save(NamedMpkBytesRecorder())
    model.zero_grad(set_to_none=True)

    record = TrainingRecord.load(NamedMpkBytesRecorder(), blob, state_type=State)
    assert "0.weight" in record.model.item["tensors"] and "1.running_mean" in record.model.item["tensors"]
    assert set(record.optimizer.item["state"]) == {n for n, _ in plain().named_parameters()}
    model2, opt2, sched2 = build(dst)
    r = record.restore(model2, opt2, sched2, "cpu")
    assert r.model is model2
    assert torch.equal(list(model2.parameters())[-1].grad, torch.full((3,), 0.25))
    model2.zero_grad(set_to_none=True)
    train(model2, opt2, sched2, r.accumulator, r.state, STEPS)

    ref = uninterrupted().state_dict()
    got = trt.unwrap(model2).state_dict()  # inner wrappers keep their names here
    assert len(got) == len(ref)
    for (name, a), b in zip(ref.items(), got.values()):
        assert torch.equal(a, b), name


def test_a_resume_that_drops_the_optimizer_state_is_detected():
    """The bitwise comparison above can fail: restoring all but Adam's moments differs."""
    model, opt, sched = build("compile")
    acc, state = GradientsAccumulator(), State(0)
    train(model, opt, sched, acc, state, CUT)
    record = TrainingRecord.capture(model, opt, sched, acc, state)
    model2, opt2, sched2 = build()
    r = record.restore(model2, opt2, sched2, "cpu")
    opt2.state.clear()
    train(model2, opt2, sched2, r.accumulator, r.state, STEPS)
    ref = uninterrupted()
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), model2.parameters()))


def test_gradients_of_a_wrapped_model_accumulate_into_the_plain_one():
    wrapped = compiled(DDP(plain()))
    base = plain()
    x = torch.randn(6, 4)
    wrapped(x).sum().backward()
    acc = GradientsAccumulator()
    acc.accumulate(wrapped, trt.grads_from(wrapped))
    base(x).sum().backward()
    acc.accumulate(base, trt.grads_from(base))  # the same ParamIds: one pending sum
    assert len(acc.try_to_record().grads) == len(list(base.parameters()))
    trt.set_grads(base, acc.grads())
    for p in base.parameters():
        assert p.grad is not None


# -- FSDP2 -------------------------------------------------------------------------------


def sharded() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = plain()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def test_fully_shard_keeps_names_and_its_sharded_tensors_are_refused_clearly():
    model = sharded()
    assert trainrec.adapt(model).param_ids() == [n for n, _ in plain().named_parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(RecorderError, match=r"DTensor.*fully_shard.*DCPRecorder \(torch\.distributed\.checkpoint"):
        TrainingRecord.capture(model, opt, None, GradientsAccumulator(), State(0))
    model(torch.randn(6, 4)).sum().backward()
    with pytest.raises(RecorderError, match="gradient of '0.weight' is a DTensor"):
        trt.grads_from(model)
    assert all(p.grad is not None for p in model.parameters())  # nothing was taken


def test_a_plain_record_is_refused_by_a_fully_sharded_model_which_stays_unchanged():
    base, base_opt, _ = build()
    record = TrainingRecord.capture(base, base_opt, None, GradientsAccumulator(), State(0))
    model = sharded()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # differs from the record
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    with pytest.raises(RecorderError, match="DTensor"):
        record.restore(model, opt, None, "cpu")
    after = [p.detach().full_tensor() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(RecorderError, match="parameter '0.weight' is a DTensor"):
        trt.set_grads(model, _grads_of(base))


def _grads_of(model: nn.Module):
    model(torch.randn(6, 4)).sum().backward()
    return trt.grads_from(model)
