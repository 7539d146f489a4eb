"""The PyTorch adapter: backend, bindings, every optimizer and scheduler, recorder, RNG."""

from __future__ import annotations

import asyncio
import copy
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import trainrec  # noqa: E402
import trainrec.adapters.torch as trt  # noqa: E402
from trainrec import (  # noqa: E402
    CorruptRecordError,
    DType,
    GradientsAccumulator,
    NamedMpkBytesRecorder,
    NativePrecisionSettings,
    RecordMismatchError,
    TensorData,
    TrainingRecord,
)

lr_sched = torch.optim.lr_scheduler


@trainrec.record
class Step:
    micro: int


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def train(model, opt, sched, steps: int, seed: int = 1, acc: GradientsAccumulator | None = None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=g)
        nn.functional.mse_loss(model(x), torch.ones(5, 3)).backward()
        if acc is not None:
            acc.accumulate(model, trt.grads_from(model))
            trt.set_grads(model, acc.grads())
        opt.step()
        opt.zero_grad()
        if sched is not None:
            if isinstance(sched, lr_sched.ReduceLROnPlateau):
                sched.step(1.0)
            else:
                sched.step()


def assert_state_equal(a: nn.Module, b: nn.Module, oa=None, ob=None):
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    if oa is not None:
        sa, sb = oa.state_dict(), ob.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert sa["state"].keys() == sb["state"].keys()
        for i in sa["state"]:
            for k, v in sa["state"][i].items():
                w = sb["state"][i][k]
                assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)


def roundtrip(rec: TrainingRecord, state_type=Step) -> TrainingRecord:
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    return TrainingRecord.load(r, rec.save(r), "cpu", state_type=state_type)


# -- backend ------------------------------------------------------------------------------


def test_adapt_resolves_native_types_without_importing_jax():
    assert isinstance(trainrec.adapt(mlp()), trt.TorchModule)
    opt = torch.optim.SGD(mlp().parameters(), lr=0.1)
    assert isinstance(trainrec.adapt(opt), trt.TorchOptimizer)
    assert isinstance(trainrec.adapt(lr_sched.StepLR(opt, 2)), trt.TorchLrScheduler)
    assert isinstance(trainrec.adapt(lr_sched.ReduceLROnPlateau(opt)), trt.TorchLrScheduler)
    assert isinstance(trainrec.adapt(torch.zeros(1)), trt.TorchBackend)
    assert isinstance(trainrec.adapt(torch.device("cpu")), trt.TorchBackend)
    b = trainrec.adapt(mlp())
    assert isinstance(b, trainrec.AutodiffModule) and isinstance(b.backend, trainrec.AutodiffBackend)


def test_devices():
    b = trt.TorchBackend()
    assert b.device("cpu") == torch.device("cpu") == b.device(torch.device("cpu")) == b.device(None)
    if not torch.cuda.is_available():
        for spec in ("cuda", "cuda:1", torch.device("cuda:0")):
            with pytest.raises(ValueError, match="CUDA"):
                b.device(spec)
    with pytest.raises(ValueError):
        b.device("tpu:0")
    with pytest.raises(ValueError):
        b.device("meta")


@pytest.mark.parametrize("dtype", list(DType))
def test_host_roundtrip_every_dtype(dtype):
    b = trt.TorchBackend()
    t = (torch.arange(6).reshape(2, 3) % 2).to(trt.backend.to_torch_dtype(dtype))
    host = b.to_host(t)
    assert host.dtype == dtype.numpy and host.shape == (2, 3)
    back = b.from_host(host, "cpu")
    assert back.dtype == t.dtype and torch.equal(back, t)
    assert b.dtype_of(t) is dtype
    assert np.array_equal(asyncio.run(b.to_host_async(t)).astype(np.float64), host.astype(np.float64))


def test_host_copies_never_alias():
    b = trt.TorchBackend()
    t = torch.zeros(3)
    host = b.to_host(t)
    t.add_(1)
    assert host.sum() == 0
    arr = np.zeros(3, np.float32)
    back = b.from_host(arr, "cpu")
    arr += 1
    assert back.sum() == 0


# -- module binding -----------------------------------------------------------------------


def test_module_record_holds_buffers_and_tied_parameters_once():
    bn = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    bn(torch.randn(4, 3))
    tensors = trainrec.adapt(bn).into_record().item["tensors"]
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(tensors)
    assert tensors["1.num_batches_tracked"].dtype is DType.I64
    tied = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight
    rec = trainrec.adapt(tied).into_record()
    assert list(rec.item["tensors"]) == ["0.weight"] and rec.item["aliases"] == {"1.weight": "0.weight"}
    assert trainrec.adapt(tied).param_ids() == ["0.weight"]


def test_restore_copies_in_place_and_the_optimizer_keeps_its_parameters():
    src, dst = mlp(0), mlp(1)
    opt_src = torch.optim.Adam(src.parameters(), lr=0.1)
    train(src, opt_src, None, 2)
    opt_dst = torch.optim.Adam(dst.parameters(), lr=0.1)
    params_before = [id(p) for p in dst.parameters()]
    rec = roundtrip(TrainingRecord.capture(src, opt_src, None, GradientsAccumulator(), Step(2)))
    r = rec.restore(dst, opt_dst, None, "cpu")
    assert r.model is dst and r.optimizer is opt_dst
    assert [id(p) for p in dst.parameters()] == params_before
    assert [id(p) for p in opt_dst.param_groups[0]["params"]] == params_before
    assert_state_equal(src, dst, opt_src, opt_dst)
    train(src, opt_src, None, 2)
    train(dst, opt_dst, None, 2)
    assert_state_equal(src, dst, opt_src, opt_dst)


def test_gradients_accumulated_natively_in_grad_are_pending_gradients_too():
    """Plain torch accumulation (backward() several times, then step) keeps the pending
    gradients in `.grad`; a checkpoint in the middle of the window must carry them."""
    def window_part(model, gen, n):
        for _ in range(n):
            nn.functional.mse_loss(model(torch.randn(5, 4, generator=gen)), torch.ones(5, 3)).backward()

    src, gen = mlp(0), torch.Generator().manual_seed(7)
    opt = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    window_part(src, gen, 2)  # half a window of 4, pending in .grad
    rec = roundtrip(TrainingRecord.capture(src, opt, None, GradientsAccumulator(), Step(2)))
    dst = mlp(1)
    dst.zero_grad()
    for p in dst.parameters():
        p.grad = torch.full_like(p, 5.0)  # stale gradients the restore must replace
    dst[0].bias.grad = None
    opt_dst = torch.optim.SGD(dst.parameters(), lr=0.1, momentum=0.9)
    rec.restore(dst, opt_dst, None, "cpu")
    gen_dst = torch.Generator()
    gen_dst.set_state(gen.get_state())
    for model, optimizer, g in ((src, opt, gen), (dst, opt_dst, gen_dst)):
        window_part(model, g, 2)
        optimizer.step()
    assert_state_equal(src, dst, opt, opt_dst)
    no_grad = mlp(2)
    rec2 = roundtrip(TrainingRecord.capture(no_grad, torch.optim.SGD(no_grad.parameters(), lr=0.1), None,
                                            GradientsAccumulator(), Step(0)))
    rec2.restore(dst, torch.optim.SGD(dst.parameters(), lr=0.1), None, "cpu")
    assert all(p.grad is None for p in dst.parameters())


def test_module_mismatch_is_refused_unchanged():
    rec = trainrec.adapt(mlp()).into_record()
    other = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 3))
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(RecordMismatchError, match="shape"):
        trainrec.adapt(other).load_record(rec, "cpu")
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in before.items())


# -- optimizers ---------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd-momentum-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd-dampening": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=1e-3),
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_resume_is_exact_and_survives_another_parameter_order(name):
    src = mlp(0)
    opt_src = OPTIMIZERS[name](src.parameters())
    train(src, opt_src, None, 3)
    rec = roundtrip(TrainingRecord.capture(src, opt_src, None, GradientsAccumulator(), Step(3)))
    dst = mlp(5)
    opt_dst = OPTIMIZERS[name](list(dst.parameters())[::-1])  # another parameter order
    rec.restore(dst, opt_dst, None, "cpu")
    train(src, opt_src, None, 3)
    train(dst, opt_dst, None, 3)
    assert_state_equal(src, dst)
    names = {id(p): n for n, p in src.named_parameters()}
    names_dst = {id(p): n for n, p in dst.named_parameters()}
    for p_src in src.parameters():
        p_dst = dict(dst.named_parameters())[names[id(p_src)]]
        for k, v in opt_src.state[p_src].items():
            assert torch.equal(v, opt_dst.state[p_dst][k]), (names_dst[id(p_dst)], k)


def test_optimizer_kind_and_group_mismatch_are_refused_unchanged():
    src = mlp(0)
    opt = torch.optim.Adam(src.parameters(), lr=0.1)
    train(src, opt, None, 1)
    rec = TrainingRecord.capture(src, opt, None, GradientsAccumulator(), Step(1))
    dst = mlp(3)
    sgd = torch.optim.SGD(dst.parameters(), lr=0.1)
    before = copy.deepcopy(dst.state_dict())
    with pytest.raises(RecordMismatchError, match="kind"):
        rec.restore(dst, sgd, None, "cpu")
    two_groups = torch.optim.Adam([{"params": list(dst.parameters())[:2]},
                                   {"params": list(dst.parameters())[2:]}], lr=0.1)
    with pytest.raises(RecordMismatchError, match="param groups"):
        rec.restore(dst, two_groups, None, "cpu")
    assert all(torch.equal(v, dst.state_dict()[k]) for k, v in before.items())


def test_an_optimizer_over_foreign_parameters_is_a_type_error():
    opt = torch.optim.SGD(mlp(1).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="not in the model"):
        TrainingRecord.capture(mlp(0), opt, None, GradientsAccumulator(), Step(0))


# -- schedulers ---------------------------------------------------------------------------


def _schedulers():
    def seq(o):
        return lr_sched.SequentialLR(o, [lr_sched.LinearLR(o, 0.5, total_iters=2), lr_sched.ExponentialLR(o, 0.9)], milestones=[2])

    def chained(o):
        return lr_sched.ChainedScheduler([lr_sched.StepLR(o, 2, 0.5), lr_sched.ExponentialLR(o, 0.95)])

    return {
        "StepLR": lambda o: lr_sched.StepLR(o, 2, 0.5),
        "MultiStepLR": lambda o: lr_sched.MultiStepLR(o, [2, 4], 0.5),
        "ExponentialLR": lambda o: lr_sched.ExponentialLR(o, 0.9),
        "CosineAnnealingLR": lambda o: lr_sched.CosineAnnealingLR(o, 4),
        "CosineAnnealingWarmRestarts": lambda o: lr_sched.CosineAnnealingWarmRestarts(o, 2, 2),
        "OneCycleLR": lambda o: lr_sched.OneCycleLR(o, max_lr=0.1, total_steps=20),
        "LinearLR": lambda o: lr_sched.LinearLR(o, 0.3, total_iters=4),
        "SequentialLR": seq,
        "ChainedScheduler": chained,
        "LambdaLR": lambda o: lr_sched.LambdaLR(o, lambda e: 0.8**e),
        "ReduceLROnPlateau": lambda o: lr_sched.ReduceLROnPlateau(o, patience=1),
    }


@pytest.mark.parametrize("name", list(_schedulers()))
def test_scheduler_resume_is_exact(name):
    make = _schedulers()[name]
    src = mlp(0)
    opt_src = torch.optim.SGD(src.parameters(), lr=0.1, momentum=0.9)
    sched_src = make(opt_src)
    train(src, opt_src, sched_src, 5)
    rec = roundtrip(TrainingRecord.capture(src, opt_src, sched_src, GradientsAccumulator(), Step(5)))
    dst = mlp(2)
    opt_dst = torch.optim.SGD(dst.parameters(), lr=0.1, momentum=0.9)
    sched_dst = make(opt_dst)
    rec.restore(dst, opt_dst, sched_dst, "cpu")
    # no scheduler step was performed: the learning rates equal the captured ones
    assert [g["lr"] for g in opt_dst.param_groups] == [g["lr"] for g in opt_src.param_groups]
    train(src, opt_src, sched_src, 4)
    train(dst, opt_dst, sched_dst, 4)
    assert [g["lr"] for g in opt_dst.param_groups] == [g["lr"] for g in opt_src.param_groups]
    assert_state_equal(src, dst, opt_src, opt_dst)


def test_scheduler_kind_mismatch_is_refused():
    o = torch.optim.SGD(mlp().parameters(), lr=0.1)
    rec = trainrec.adapt(lr_sched.StepLR(o, 2)).into_record()
    with pytest.raises(RecordMismatchError):
        trainrec.adapt(lr_sched.ExponentialLR(o, 0.5)).check_record(rec)


# -- grads --------------------------------------------------------------------------------


def test_grads_from_and_set_grads():
    m = mlp()
    m(torch.randn(2, 4)).sum().backward()
    expected = {n: p.grad.clone() for n, p in m.named_parameters()}
    g = trt.grads_from(m)
    assert all(p.grad is None for p in m.parameters())
    assert set(g) == set(expected)
    g.remove("0.bias")
    trt.set_grads(m, g)
    assert m[0].bias.grad is None
    assert torch.equal(m[0].weight.grad, expected["0.weight"])
    half = mlp().to(torch.float16)
    trt.set_grads(half, trainrec.GradientsParams({"0.weight": torch.ones(8, 4)}))
    assert half[0].weight.grad.dtype == torch.float16
    with pytest.raises(ValueError, match="shape"):
        trt.set_grads(m, trainrec.GradientsParams({"0.weight": torch.ones(3)}))


def test_f32_accumulation_of_bf16_gradients_differs_from_bf16_grad_accumulation():
    torch.manual_seed(0)
    m = nn.Linear(64, 64).to(torch.bfloat16)
    xs = [torch.randn(16, 64, dtype=torch.bfloat16) for _ in range(8)]
    acc = GradientsAccumulator()
    for x in xs:  # plain .grad accumulation in bf16 (what backward() does by default)
        m(x).float().pow(2).mean().backward()
    bf16_sum = m.weight.grad.clone()
    m.zero_grad(set_to_none=True)
    for x in xs:
        m(x).float().pow(2).mean().backward()
        acc.accumulate_with_dtype(m, trt.grads_from(m), trainrec.FloatDType.F32)
    f32_sum = acc.grads().get("weight")
    assert f32_sum.dtype == torch.float32 and m.weight.dtype == torch.bfloat16
    diff = (f32_sum - bf16_sum.float()).abs().max().item()
    print(f"max |f32 accumulation - bf16 .grad accumulation| = {diff}")
    assert diff > 0


# -- RNG ----------------------------------------------------------------------------------


def test_torch_rng_record():
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(4)
    npgen = np.random.default_rng(5)
    rec = roundtrip_rng(trt.TorchRngRecord.capture(gen, npgen))
    expected = (torch.rand(3), torch.rand(3, generator=gen), npgen.random())
    torch.manual_seed(0)
    gen2, npgen2 = torch.Generator().manual_seed(0), np.random.default_rng(0)
    rec.apply(gen2, npgen2)
    got = (torch.rand(3), torch.rand(3, generator=gen2), npgen2.random())
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]
    with pytest.raises(ValueError):
        rec.apply(npgen2)


def roundtrip_rng(rec):
    r = NamedMpkBytesRecorder()
    return r.load(r.record(rec, None), None, trt.TorchRngRecord)


# -- TorchFileRecorder --------------------------------------------------------------------


def _item():
    from trainrec import TensorData

    item = {d.value: TensorData.from_array((np.arange(6).reshape(2, 3) % 3).astype(d.numpy)) for d in DType}
    item["meta"] = {"n": [1, 2.5, "s", None, b"\x01"]}
    item["zero_d"] = TensorData.from_array(np.array(1.5, np.float32))
    return item


@pytest.mark.parametrize("settings", [trainrec.FullPrecisionSettings(), trainrec.HalfPrecisionSettings(),
                                      trainrec.DoublePrecisionSettings(), NativePrecisionSettings(),
                                      trt.BF16PrecisionSettings(), trt.TorchPrecisionSettings(torch.bfloat16, torch.int64)],
                         ids=lambda s: s.name)
def test_torch_file_recorder_roundtrip_and_plain_torch_load(tmp_path, settings):
    r = trt.TorchFileRecorder(settings)
    path = r.save_item(_item(), tmp_path / "x.pt", "Item")
    raw = torch.load(path, weights_only=True)  # plain torch reads it
    assert raw["format"] == "trainrec.torch" and isinstance(raw["item"]["f32"], torch.Tensor)
    back = r.load_item(path)
    for d in DType:
        assert back[d.value].dtype is d  # settings chose only the storage dtype
        assert np.array_equal(back[d.value].array.astype(np.float64), _item()[d.value].array.astype(np.float64))
    assert back["meta"] == {"n": [1, 2.5, "s", None, b"\x01"]} and back["zero_d"].shape == ()


def test_torch_file_recorder_with_training_record(tmp_path):
    src = mlp(0)
    opt = torch.optim.AdamW(src.parameters())
    train(src, opt, None, 2)
    rec = TrainingRecord.capture(src, opt, None, GradientsAccumulator(), Step(2))
    r = trt.TorchFileRecorder()
    rec.save(r, tmp_path / "c.pt")
    back = TrainingRecord.load(r, tmp_path / "c.pt", "cpu", state_type=Step)
    dst, opt2 = mlp(1), torch.optim.AdamW(mlp(1).parameters())
    opt2 = torch.optim.AdamW(dst.parameters())
    back.restore(dst, opt2, None, "cpu")
    assert_state_equal(src, dst, opt, opt2)


def test_torch_file_recorder_rejects_bad_files_with_recorder_errors(tmp_path):
    r = trt.TorchFileRecorder()
    path = r.save_item(_item(), tmp_path / "x.pt")
    data = path.read_bytes()
    for n in (0, 10, len(data) // 2, len(data) - 1):
        (tmp_path / "t.pt").write_bytes(data[:n])
        with pytest.raises(CorruptRecordError):
            r.load_item(tmp_path / "t.pt")
    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"format": "trainrec.torch", "x": object}))
    with pytest.raises(CorruptRecordError):
        r.load_item(tmp_path / "evil.pt")
    torch.save({"format": "other"}, tmp_path / "o.pt")
    with pytest.raises(CorruptRecordError, match="magic"):
        r.load_item(tmp_path / "o.pt")
    doc = torch.load(path, weights_only=True)
    doc["item"]["f32"][0, 0] += 1
    torch.save(doc, tmp_path / "resaved.pt")  # a plain torch.save has no file checksum
    with pytest.raises(CorruptRecordError, match="file checksum is missing"):
        r.load_item(tmp_path / "resaved.pt")
    at = data.index(np.asarray(_item()["f32"].array).tobytes())
    (tmp_path / "flip.pt").write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1:])
    with pytest.raises(trainrec.ChecksumError, match="file checksum mismatch"):
        r.load_item(tmp_path / "flip.pt")
    with pytest.raises(trainrec.FileMissingError):
        r.load_item(tmp_path / "missing.pt")


def test_torch_file_recorder_never_calls_torch_load(tmp_path, monkeypatch):
    """Loads go through core's allow-list reader (`trainrec.recorders.ptfile`), so no torch version's
    unpickler (CVE-2025-32434 in torch < 2.6) ever sees the file."""
    def refuse(*a, **kw):
        raise AssertionError("torch.load called on a load path")

    monkeypatch.setattr(torch, "load", refuse)
    path = trt.TorchFileRecorder().save_item({"a": 1, "t": TensorData.from_array(np.ones(3))},
                                             tmp_path / "x.pt")
    item = trt.TorchFileRecorder().load_item(path)
    assert item["a"] == 1 and item["t"].bitwise_equal(TensorData.from_array(np.ones(3)))
    trt.TorchFileRecorder().load_item(path, mmap=True)


def test_state_fields_may_hold_torch_tensors():
    @trainrec.record
    class S:
        key: torch.Tensor
        arr: np.ndarray

    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    back = r.load(r.record(S(torch.arange(3, dtype=torch.int16), np.ones(2)), None), "cpu", S)
    assert isinstance(back.key, torch.Tensor) and back.key.dtype == torch.int16
    assert torch.equal(back.key, torch.arange(3, dtype=torch.int16)) and isinstance(back.arr, np.ndarray)


# -- CUDA (skipped without a GPU) ---------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_run():
    model = mlp(0).to("cuda:0")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    acc = GradientsAccumulator()
    g = torch.Generator(device="cuda:0").manual_seed(0)
    for _ in range(3):
        x = torch.randn(5, 4, device="cuda:0", generator=g)
        nn.functional.mse_loss(model(x), torch.ones(5, 3, device="cuda:0")).backward()
        acc.accumulate(model, trt.grads_from(model))
    trt.set_grads(model, acc.grads())
    opt.step()
    x = torch.randn(5, 4, device="cuda:0", generator=g)
    nn.functional.mse_loss(model(x), torch.ones(5, 3, device="cuda:0")).backward()
    acc.accumulate(model, trt.grads_from(model))
    return model, opt, acc


@pytest.mark.cuda
@cuda
def test_cuda_capture_async_equals_capture():
    model, opt, acc = _cuda_run()
    r = NamedMpkBytesRecorder(NativePrecisionSettings())
    sync = TrainingRecord.capture(model, opt, None, acc, Step(4)).save(r)
    asyn = asyncio.run(TrainingRecord.capture_async(model, opt, None, acc, Step(4))).save(r)
    assert sync == asyn
    pending = acc.try_to_record()
    assert all(t.shape for t in pending.grads.values())


@pytest.mark.cuda
@cuda
def test_cuda_record_restores_onto_cpu_and_back():
    model, opt, acc = _cuda_run()
    rec = roundtrip(TrainingRecord.capture(model, opt, None, acc, Step(4)))
    cpu_model = mlp(3)
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=0.01)
    r_cpu = rec.restore(cpu_model, cpu_opt, None, "cpu")
    assert all(p.device.type == "cpu" for p in cpu_model.parameters())
    back = roundtrip(TrainingRecord.capture(cpu_model, cpu_opt, None, r_cpu.accumulator, Step(4)))
    assert len(back.grads.grads) == len(rec.grads.grads) > 0
    assert all(v.device.type == "cpu" for _, v in r_cpu.accumulator.grads().items())
    gpu_model = mlp(4).to("cuda:0")
    gpu_opt = torch.optim.AdamW(gpu_model.parameters(), lr=0.01)
    r_gpu = rec.restore(gpu_model, gpu_opt, None, torch.device("cuda:0"))
    assert all(v.device.type == "cuda" for _, v in r_gpu.accumulator.grads().items())
    r_back = back.restore(gpu_model, gpu_opt, None, "cuda:0")
    pending, expected = r_back.accumulator.grads(), acc.grads()
    assert all(torch.equal(v, expected.get(k)) and v.is_cuda for k, v in pending.items())
    assert_state_equal(model.cpu(), gpu_model.cpu())


def test_device_refuses_indexes_torch_does_not_have():
    from trainrec.adapters.torch.backend import TorchBackend

    backend = TorchBackend()
    assert backend.device("cpu") == torch.device("cpu")
    for spec in ("cpu:7", "cpu:4096", "cuda:4096"):  # torch parses "cpu:7"; 4096 wraps to index 0
        with pytest.raises(ValueError, match="cpu|no such torch device|CUDA"):
            backend.device(spec)
