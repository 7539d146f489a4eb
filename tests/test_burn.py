"""Burn's own record files (`trainrec.recorders.burn`, `trainrec.conversion.burn_neutral`): the three real files
Burn wrote (`../shared/burn/`, see its README) read, inspect, verify, re-encode byte for
byte, and convert to torch and flax and back; torch weights written as Burnpack; Burn's
Adam moments under the conversion's checks. Damaged and hostile files: test_burn_attack.py."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import msgpack
import numpy as np
import pytest

import trainrec
from trainrec import GradientsAccumulator, TrainingRecord, read_file
from trainrec.cli.commands import main
from trainrec.conversion.burn_neutral import burn_template, training_record
from trainrec.conversion.convert import ConversionError, convert, convert_with_report
from trainrec.items.tree import iter_tensors
from trainrec.recorders.burn import (
    BurnNamedMpkRecorder,
    BurnpackRecorder,
    optimizer_path,
    param_id_text,
    param_id_value,
)

ROOT = Path(__file__).resolve().parents[1]


def _shared() -> Path | None:
    for where in (os.environ.get("TRAINREC_BURN_FILES"), ROOT.parent / "shared" / "burn"):
        if where and (Path(where) / "mnist-0.22.bpk").is_file():
            return Path(where)
    return None


SHARED = _shared()
needs_files = pytest.mark.skipif(
    SHARED is None, reason="Burn's real files are not here: they are in ../shared/burn beside the "
    "repository (as CI lays it out), or set TRAINREC_BURN_FILES to their folder")
BPK, MPK, BIN = "mnist-0.22.bpk", "modern-lstm-0.17-half.mpk", "mnist-0.21-full.bin"


def real(name: str) -> Path:
    assert SHARED is not None
    return SHARED / name


@trainrec.record
class S:
    step: int


# -- reading the real files ---------------------------------------------------------------------


@needs_files
def test_the_burnpack_mnist_net_reads_with_names_dtypes_and_param_ids():
    header, item = read_file(real(BPK))
    assert (header.format, header.record_type) == ("burn.burnpack", "burn.Module")
    t = item["tensors"]
    assert list(t)[:6] == ["conv1.conv.weight", "conv1.conv.bias", "conv1.norm.gamma", "conv1.norm.beta",
                           "conv1.norm.running_mean", "conv1.norm.running_var"]  # Burn's module order
    assert len(t) == 18 and t["fc1.weight"].shape == (1600, 128) and t["conv2.conv.weight"].shape == (64, 64, 3, 3)
    assert all(v.dtype is trainrec.DType.F32 for v in t.values())
    assert item["param_ids"]["conv1.conv.bias"] == 9505838338724798577
    raw = real(BPK).read_bytes()  # the file's own bytes: the data section starts at 1536
    assert t["conv1.conv.weight"].to_bytes() == raw[1536 : 1536 + 2304]


@needs_files
def test_the_lstm_reads_its_42_f16_tensors_with_shapes_bytes_and_ids_exact():
    header, item = read_file(real(MPK))
    assert (header.format, header.trainrec_version, header.settings.name) == ("burn.namedmpk", "burn 0.17.0", "half")
    tensors = dict(iter_tensors(item["item"]))
    assert len(tensors) == 42 and all(t.dtype is trainrec.DType.F16 for t in tensors.values())
    # the same file decoded by the msgpack library, independently
    doc = msgpack.unpackb(real(MPK).read_bytes(), raw=False)
    expected = {}

    def walk(node, path):
        if isinstance(node, dict) and set(node) == {"id", "param"}:
            expected[path] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else k)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}")

    walk(doc["item"], "")
    assert set(expected) == set(tensors)
    for path, node in expected.items():
        assert tensors[path].shape == tuple(node["param"]["shape"]), path
        assert tensors[path].to_bytes() == node["param"]["bytes"], path
        assert item["param_ids"][path] == node["id"]
    assert tensors["stacked_lstm.layers.0.norm_x.gamma"].shape == (128,)
    assert item["item"]["stacked_lstm"]["layers"][0]["hidden_size"] is None  # constants kept, as None
    assert item["metadata"]["version"] == "0.17.0"


@needs_files
def test_the_bin_mnist_net_reads_in_file_order_without_a_template_and_by_path_with_one(tmp_path):
    header, item = read_file(real(BIN))
    assert header.format == "burn.bin" and len(item["item"]) == 18
    assert item["item"][12].shape == (1600, 256)  # older weights than the Burnpack's: fc1 is 1600 -> 256
    with pytest.raises(trainrec.RecordMismatchError, match=r"another module.*fc1\.weight"):
        read_file(real(BIN), template=real(BPK))  # the Burnpack net is 1600 -> 128
    template = _torch_template(tmp_path, hidden=256)
    header, by_path = read_file(real(BIN), template=template)
    tensors = dict(iter_tensors(by_path["item"]))
    assert list(tensors)[:3] == ["conv1.conv.weight", "conv1.conv.bias", "conv1.norm.gamma"]
    assert [t.to_bytes() for t in tensors.values()] == [t.to_bytes() for t in item["item"]]
    assert by_path["param_ids"]["fc3.bias"] == item["param_ids"]["17"]
    with pytest.raises(TypeError, match="Bin"):
        read_file(real(BPK), template=template)


@needs_files
@pytest.mark.parametrize("name", [BPK, MPK, BIN])
def test_inspect_and_verify_say_what_they_could_and_could_not_check(name, capsys):
    assert main(["inspect", str(real(name))]) == 0
    out = capsys.readouterr().out
    assert "format: burn." in out and ("param_ids" in out)
    assert main(["verify", str(real(name))]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK:") and "Burn keeps no checksum" in out and "not the tensors' values" in out


def test_param_ids_are_burns_base32_of_their_little_endian_bytes():
    for value in (0, 1, 123456, 2**64 - 1, 9505838338724798577):
        text = param_id_text(value)
        assert len(text) == 13 and param_id_value(text) == value
    assert param_id_value("30b82c23-788d-4d63-a743-ada258d5f13c") is None  # a legacy UUID id
    assert param_id_value("zz") is None


# -- re-encoding ----------------------------------------------------------------------------------


@needs_files
def test_each_real_file_re_encodes_byte_for_byte(tmp_path):
    BurnpackRecorder().save_item(read_file(real(BPK))[1], tmp_path / "a.bpk")
    assert (tmp_path / "a.bpk").read_bytes() == real(BPK).read_bytes()
    _, lstm = read_file(real(MPK))
    BurnNamedMpkRecorder().save_item(lstm, tmp_path / "a.mpk")
    assert (tmp_path / "a.mpk").read_bytes() == real(MPK).read_bytes()
    BurnNamedMpkRecorder(compress=True).save_item(lstm, tmp_path / "b.mpk.gz")
    assert gzip.decompress((tmp_path / "b.mpk.gz").read_bytes()) == real(MPK).read_bytes()
    header, again = read_file(tmp_path / "b.mpk.gz")  # told from trainrec's .mpk.gz by its content
    assert header.format == "burn.namedmpk.gz" and again["param_ids"] == lstm["param_ids"]


@needs_files
def test_the_lstm_moves_to_burnpack_and_back_with_every_tensor_and_param_id(tmp_path):
    _, lstm = read_file(real(MPK))
    BurnpackRecorder().save_item(lstm, tmp_path / "lstm.bpk")
    header, bpk = read_file(tmp_path / "lstm.bpk")
    assert header.format == "burn.burnpack" and len(bpk["tensors"]) == 42
    assert {k: param_id_text(v) for k, v in bpk["param_ids"].items()} == lstm["param_ids"]
    BurnNamedMpkRecorder().save_item(bpk, tmp_path / "back.mpk")
    _, back = read_file(tmp_path / "back.mpk")
    old, new = dict(iter_tensors(lstm["item"])), dict(iter_tensors(back["item"]))
    assert old.keys() == new.keys() and all(old[k].bitwise_equal(new[k]) for k in old)
    assert back["param_ids"] == lstm["param_ids"]


# -- the MNIST nets in torch and flax -----------------------------------------------------------


def _torch_net(hidden=128):
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self, cin, cout):
            super().__init__()
            self.conv, self.norm = torch.nn.Conv2d(cin, cout, 3), torch.nn.BatchNorm2d(cout, eps=1e-5)

        def forward(self, x):
            return torch.nn.functional.max_pool2d(torch.relu(self.norm(self.conv(x))), 2, 2)

    class Net(torch.nn.Module):  # Burn's examples/mnist-inference-web model
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = Block(1, 64), Block(64, 64)
            self.fc1, self.fc2, self.fc3 = (torch.nn.Linear(1600, hidden), torch.nn.Linear(hidden, 128),
                                            torch.nn.Linear(128, 10))

        def forward(self, x):
            gelu = torch.nn.functional.gelu  # Burn's Gelu is the exact (erf) one
            x = self.conv2(self.conv1(x)).flatten(1)
            return self.fc3(gelu(self.fc2(gelu(self.fc1(x)))))

    torch.manual_seed(0)
    return Net().eval()


def _torch_template(tmp_path, hidden=128):
    torch = pytest.importorskip("torch")
    import trainrec.adapters.torch as trt

    net = _torch_net(hidden)
    record = TrainingRecord.capture(net, torch.optim.Adam(net.parameters()), None, GradientsAccumulator(), S(0))
    path = tmp_path / f"torch-{hidden}.pt"
    record.save(trt.TorchFileRecorder(trainrec.NativePrecisionSettings()), path)
    return path


def _flax_run(hidden=128):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    fnn = pytest.importorskip("flax.linen")
    import jax.numpy as jnp

    import trainrec.adapters.jax as trj

    class Block(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            x = fnn.Conv(64, (3, 3), padding="VALID", name="conv")(x)
            x = fnn.BatchNorm(use_running_average=True, epsilon=1e-5, name="norm")(x)
            return fnn.max_pool(fnn.relu(x), (2, 2), strides=(2, 2))

    class Net(fnn.Module):
        @fnn.compact
        def __call__(self, x):  # NHWC
            x = Block(name="conv2")(Block(name="conv1")(x))
            x = jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)  # flattened channels first, as Burn

            def gelu(v):
                return fnn.gelu(v, approximate=False)

            x = gelu(fnn.Dense(128, name="fc2")(gelu(fnn.Dense(hidden, name="fc1")(x))))
            return fnn.Dense(10, name="fc3")(x)

    net = Net()
    model = trj.JaxModule(jax.jit(net.init)(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1))))
    tx = optax.adam(1e-3)
    opt = trj.JaxOptimizer(tx, tx.init(model.params["params"]))
    return net, model, opt


def _digits():
    """scikit-learn's bundled 8x8 digits (0-16) as MNIST-like 28x28 inputs: upscaled to
    20x20 (bicubic, as MNIST's digits fit a 20x20 box), padded by 4, normalized as Burn's
    example does."""
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    x = torch.tensor(d.images / 16.0 * 255.0, dtype=torch.float32)[:, None]
    x = torch.nn.functional.interpolate(x, size=(20, 20), mode="bicubic", align_corners=False).clamp(0, 255)
    x = torch.nn.functional.pad(x, (4, 4, 4, 4))
    return ((x / 255 - 0.1307) / 0.3081).numpy(), d.target


def _predict_both(source, tmp_path, hidden):
    torch = pytest.importorskip("torch")
    net = _torch_net(hidden)
    opt = torch.optim.Adam(net.parameters())
    template = TrainingRecord.capture(net, opt, None, GradientsAccumulator(), S(0))
    convert(source, template).restore(net, opt, None, "cpu")
    fnet, fmodel, fopt = _flax_run(hidden)
    ftemplate = TrainingRecord.capture(fmodel, fopt, None, GradientsAccumulator(), S(0))
    convert(source, ftemplate).restore(fmodel, fopt, None, "cpu")
    x, y = _digits()
    with torch.no_grad():
        t_logits = net(torch.from_numpy(x)).numpy()
    import jax

    f_logits = np.asarray(jax.jit(fnet.apply)(fmodel.params, np.transpose(x, (0, 2, 3, 1))))
    return t_logits, f_logits, y


@needs_files
@pytest.mark.parametrize("name", [BPK, BIN])
def test_the_mnist_nets_predict_the_same_in_torch_and_flax_and_far_above_chance(name, tmp_path):
    hidden = 128 if name == BPK else 256
    record = read_file(real(name)) if name == BPK else read_file(real(name), template=_torch_template(tmp_path, 256))
    t_logits, f_logits, y = _predict_both(training_record(record), tmp_path, hidden)
    assert np.array_equal(t_logits.argmax(1), f_logits.argmax(1))
    np.testing.assert_allclose(t_logits, f_logits, rtol=1e-4, atol=1e-4)
    accuracy = float((t_logits.argmax(1) == y).mean())
    print(f"{name}: accuracy {accuracy:.4f} on scikit-learn's {len(y)} digits")
    assert accuracy > 0.8  # chance is 0.1


@needs_files
def test_the_cli_converts_the_burnpack_to_torch_and_back_to_the_same_bytes(tmp_path, capsys):
    template = _torch_template(tmp_path)
    out, back = tmp_path / "net.pt", tmp_path / "back.bpk"
    assert main(["convert", str(real(BPK)), str(out), "--to", "torch", "--template", str(template)]) == 0
    assert main(["convert", str(out), str(back), "--to", "burn", "--template", str(real(BPK))]) == 0
    assert back.read_bytes() == real(BPK).read_bytes()
    assert main(["convert", str(out), str(tmp_path / "new.bpk"), "--to", "burn"]) == 0  # no template
    assert main(["diff", str(real(BPK)), str(tmp_path / "new.bpk")]) == 1  # new ParamIds
    assert "18 of 18 tensors bitwise equal" in capsys.readouterr().out


@needs_files
def test_the_cli_converts_the_burnpack_to_flax_and_back(tmp_path):
    import trainrec.adapters.jax as trj

    _, model, opt = _flax_run()
    path = tmp_path / "flax.msgpack"
    TrainingRecord.capture(model, opt, None, GradientsAccumulator(), S(0)).save(
        trj.FlaxMsgpackFileRecorder(trainrec.NativePrecisionSettings()), path)
    assert main(["convert", str(real(BPK)), str(tmp_path / "f.msgpack"), "--to", "jax", "--template", str(path)]) == 0
    back = ["convert", str(tmp_path / "f.msgpack"), str(tmp_path / "b.bpk"), "--to", "burn",
            "--template", str(real(BPK))]
    # optax's fresh Adam state (zero moments) has no place in a Burn module file, which names no
    # optimizer: refused, unless forced (the Burn target keeps none)
    assert main(back) == 4
    assert main([*back, "--force"]) == 0
    assert (tmp_path / "b.bpk").read_bytes() == real(BPK).read_bytes()


# -- torch weights and optimizer state as Burn's ------------------------------------------------


# the settings of _trained_torch's optimizers, as the Burn program would give them
ADAM_CONFIG = {"lr": 1e-2, "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "clip_norm": None,
               "clip_value": None}
SGD_CONFIG = {"lr": 1e-2, "momentum": 0.9, "nesterov": False, "dampening": 0.0, "weight_decay": 0.0,
              "clip_norm": None, "clip_value": None}


def _trained_torch(steps=3, opt="adam"):
    torch = pytest.importorskip("torch")
    import trainrec.adapters.torch as trt

    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 6 * 6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    o = (torch.optim.Adam(net.parameters(), lr=1e-2) if opt == "adam"
         else torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9))
    for _ in range(steps):
        o.zero_grad()
        net(torch.randn(4, 1, 8, 8)).square().mean().backward()
        o.step()
    o.zero_grad(set_to_none=True)
    return net, o, trt


def test_a_torch_trained_model_written_as_burnpack_reads_back_with_every_value_equal(tmp_path):
    net, opt, _ = _trained_torch()
    source = TrainingRecord.capture(net, opt, None, GradientsAccumulator(), S(3))
    template = burn_template(source)
    converted, report = convert_with_report(source, template)
    # Burn's file keeps none of the optimizer's settings: the report says what the Burn program must use
    assert "the Burn program's optimizer config must give lr 0.01, b1 0.9" in report.notes()[0]
    path = tmp_path / "net.bpk"
    converted.save(BurnpackRecorder(), path)
    header, item = read_file(path)
    t = item["tensors"]
    sd = {k: v.detach().numpy() for k, v in net.state_dict().items()}
    assert list(t) == ["0.weight", "0.bias", "1.gamma", "1.beta", "1.running_mean", "1.running_var",
                       "3.weight", "3.bias", "4.gamma", "4.beta", "5.weight", "5.bias"]
    assert np.array_equal(t["0.weight"].array, sd["0.weight"])  # Conv2d [out, in, kh, kw] as torch
    assert np.array_equal(t["3.weight"].array, sd["3.weight"].T)  # Linear [in, out]
    assert np.array_equal(t["1.gamma"].array, sd["1.weight"]) and np.array_equal(t["4.beta"].array, sd["4.bias"])
    assert np.array_equal(t["1.running_var"].array, sd["1.running_var"])
    assert len(set(item["param_ids"].values())) == 12  # new ParamIds, one per tensor
    # the Adam moments, in Burn's optimizer record beside it
    oh, optim = read_file(optimizer_path(path))
    assert oh.record_type == "burn.Optimizer"
    state = opt.state_dict()["state"]
    pid = item["param_ids"]["3.weight"]
    assert np.array_equal(optim["tensors"][f"{pid}.momentum.moment_1"].array, state[4]["exp_avg"].numpy().T)
    assert np.array_equal(optim["tensors"][f"{pid}.momentum.moment_2"].array, state[4]["exp_avg_sq"].numpy().T)
    assert optim["scalars"][f"{pid}.momentum.time"] == {"UInt": 3}
    assert optim["scalars"][f"{pid}.__rank"] == {"UInt": 2} and optim["metadata"][str(pid)] == "3.weight"


def test_burn_adam_moments_convert_back_into_torch_exactly(tmp_path):
    torch = pytest.importorskip("torch")
    net, opt, _ = _trained_torch()
    source = TrainingRecord.capture(net, opt, None, GradientsAccumulator(), S(3))
    path = tmp_path / "net.bpk"
    convert(source, burn_template(source)).save(BurnpackRecorder(), path)
    fresh, fresh_opt, _ = _trained_torch(steps=0)
    template = TrainingRecord.capture(fresh, fresh_opt, None, GradientsAccumulator(), S(0))
    # Burn's optimizer record keeps no settings (the Burn program's config does): never assumed
    with pytest.raises(ConversionError, match=r"(?s)lr: the source's is unknown \(Burn's record keeps no "
                                              r"settings.*eps: the source's is unknown"):
        convert(training_record(path, optimizer_path(path), algorithm="adam"), template)
    with pytest.raises(ConversionError, match=r"b1: the source's 0.8, the template's 0.9"):
        convert(training_record(path, optimizer_path(path), algorithm="adam", config={**ADAM_CONFIG, "b1": 0.8}),
                template)
    burn = training_record(path, optimizer_path(path), algorithm="adam", config=ADAM_CONFIG)
    convert(burn, template).restore(fresh, fresh_opt, None, "cpu")
    for a, b in zip(net.state_dict().values(), fresh.state_dict().values()):
        if a.dtype.is_floating_point:
            assert torch.equal(a, b)
    old, new = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert old.keys() == new.keys()
    for k in old:
        assert torch.equal(old[k]["exp_avg"], new[k]["exp_avg"]) and torch.equal(old[k]["exp_avg_sq"], new[k]["exp_avg_sq"])
        assert float(new[k]["step"]) == 3.0


def test_burn_moments_are_refused_where_the_maths_differ_unless_forced(tmp_path):
    net, opt, _ = _trained_torch()
    source = TrainingRecord.capture(net, opt, None, GradientsAccumulator(), S(3))
    path = tmp_path / "net.bpk"
    convert(source, burn_template(source)).save(BurnpackRecorder(), path)
    burn = training_record(path, optimizer_path(path))  # Adam's family, told by its state
    sgd, sgd_opt, _ = _trained_torch(steps=0, opt="sgd")
    template = TrainingRecord.capture(sgd, sgd_opt, None, GradientsAccumulator(), S(0))
    with pytest.raises(ConversionError, match="adam state, the template's"):
        convert(burn, template)
    assert convert(burn, template, force=True).optimizer.item["state"] == {}  # the template's fresh state
    # AMSGrad's extra moment has no neutral form: refused, never dropped silently
    _, optim = read_file(optimizer_path(path))
    pid = next(iter(optim["param_ids"].values()))
    optim["tensors"][f"{pid}.momentum.max_moment_2"] = optim["tensors"][f"{pid}.momentum.moment_2"]
    adam, adam_opt, _ = _trained_torch(steps=0)
    template = TrainingRecord.capture(adam, adam_opt, None, GradientsAccumulator(), S(0))
    with pytest.raises(ConversionError, match="AMSGrad"):
        convert(training_record(path, optim), template)


def test_burn_sgd_velocity_needs_its_settings_to_convert(tmp_path):
    torch = pytest.importorskip("torch")
    net, opt, _ = _trained_torch(opt="sgd")
    source = TrainingRecord.capture(net, opt, None, GradientsAccumulator(), S(3))
    path = tmp_path / "net.bpk"
    convert(source, burn_template(source)).save(BurnpackRecorder(), path)
    _, optim = read_file(optimizer_path(path))
    assert all(n.endswith(".momentum.velocity") for n in optim["tensors"])
    fresh, fresh_opt, _ = _trained_torch(steps=0, opt="sgd")
    template = TrainingRecord.capture(fresh, fresh_opt, None, GradientsAccumulator(), S(0))
    with pytest.raises(ConversionError, match="dampening"):
        convert(training_record(path, optim), template)
    burn = training_record(path, optim, algorithm="sgd", config=SGD_CONFIG)
    convert(burn, template).restore(fresh, fresh_opt, None, "cpu")
    for k, v in opt.state_dict()["state"].items():
        assert torch.equal(v["momentum_buffer"], fresh_opt.state_dict()["state"][k]["momentum_buffer"])
