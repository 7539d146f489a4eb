"""Packaging: the wheel installs into a fresh venv; importing trainrec imports no framework."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_trainrec_imports_no_framework():
    code = (
        "import sys, trainrec, trainrec.adapters.numpy as tn, numpy as np\n"
        "trainrec.adapt(np.zeros(2)); trainrec.adapt(tn.MLP([2, 2]))\n"
        "bad = [m for m in ('torch', 'jax', 'jaxlib', 'flax', 'optax') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_core_has_no_framework_imports():
    offenders = []
    for path in (ROOT / "core").rglob("*.py"):
        for line in path.read_text().splitlines():
            s = line.strip()
            if s.startswith(("import ", "from ")):
                mod = s.split()[1].split(".")[0]
                if mod in {"torch", "jax", "jaxlib", "flax", "optax"}:
                    offenders.append(f"{path.name}: {s}")
    assert not offenders


_NOT_SOURCE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache",
    ".hypothesis", "bench-results")


def _not_source(directory: str, names: list[str]) -> set[str]:
    """What a copy of the checkout leaves out: build and tool outputs, and virtual
    environments (a `.venv` in the checkout is gigabytes: copying it was most of this
    test's time)."""
    return _NOT_SOURCE(directory, names) | {
        n for n in names if os.path.isfile(os.path.join(directory, n, "pyvenv.cfg"))}


def test_wheel_installs_into_a_fresh_venv(tmp_path):
    # built from a copy: a build in the checkout leaves build/ and trainrec.egg-info there,
    # whose entry points then shadow the installed ones for code run from the checkout
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=_not_source)
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(source)],
        check=True,
    )
    assert not (source / "trainrec.egg-info").exists() or not (ROOT / "trainrec.egg-info").exists() or \
        (ROOT / "trainrec.egg-info").stat().st_mtime < source.stat().st_mtime  # the checkout's untouched
    (wheel,) = dist.glob("trainrec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("trainrec/__init__.py", "trainrec/py.typed", "trainrec/adapters/numpy/mlp.py",
                     "trainrec/adapters/torch/recorder.py", "trainrec/adapters/jax/recorder.py",
                     "trainrec/conformance/suite.py", "trainrec/conformance/golden/manifest.json",
                     "trainrec/conformance/golden/training-record.mpk",
                     "trainrec/conversion/presets/attention.json"):
        assert expected in names
    # every subpackage of core's layers is in the wheel (pyproject's `packages` lists each)
    for package in sorted(p.parent for p in (ROOT / "core").glob("*/__init__.py")):
        assert f"trainrec/{package.name}/__init__.py" in names, package.name
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "trainrec = trainrec.cli:main" in text and "[trainrec.adapters]" in text

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # this env's pip installs into the fresh one, run by its interpreter (`--python`): no
    # pip of its own to bootstrap there (ensurepip was a third of this test's CPU)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                    str(wheel)], check=True)
    # numpy, msgpack, ml_dtypes, array_api_compat and einops from this env, wherever it
    # keeps them (a venv may reach another's site-packages through a .pth file)
    deps = {str(Path(importlib.import_module(m).__file__).parents[1])
            for m in ("numpy", "msgpack", "ml_dtypes", "array_api_compat", "einops")}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sorted(deps))}
    out = subprocess.run(
        [str(py), "-c", "import trainrec, trainrec.adapters.numpy; print(trainrec.__file__)"],
        check=True, capture_output=True, text=True, env=env, cwd=tmp_path,
    )
    assert str(env_dir) in out.stdout
    cli = subprocess.run([str(env_dir / "bin" / "trainrec"), "--help"], capture_output=True,
                         text=True, env=env, cwd=tmp_path)
    assert cli.returncode == 0 and "demo" in cli.stdout


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"], ["inspect", "--help"],
                                  ["verify", "--help"]])
def test_cli_help(args):
    out = subprocess.run([sys.executable, "-m", "trainrec", *args], capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout


_BLOCK_FRAMEWORKS = (
    "import importlib.abc, sys\n"
    "class Block(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path, target=None):\n"
    "        if name.partition('.')[0] in ('torch', 'jax', 'jaxlib', 'flax', 'optax'):\n"
    "            raise ImportError(f'{name} is blocked', name=name)\n"
    "sys.meta_path.insert(0, Block())\n"
)


def test_adapter_packages_import_without_their_framework_and_say_what_to_install():
    code = _BLOCK_FRAMEWORKS + (
        "import trainrec.adapters.torch as trt, trainrec.adapters.jax as trj\n"
        "assert 'TorchFileRecorder' in dir(trt) and 'JaxModule' in trj.__all__\n"
        "for mod, name, extra in ((trt, 'TorchFileRecorder', 'trainrec[torch]'), (trj, 'JaxModule', 'trainrec[jax]')):\n"
        "    try:\n"
        "        getattr(mod, name)\n"
        "    except ImportError as e:\n"
        "        assert extra in str(e) and name in str(e), e\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_converting_torch_to_jax_needs_neither_framework(tmp_path):
    """The record conversion is pure numpy: it runs where importing torch, jax, flax or
    optax fails, and writes the same bytes as in a process that has them."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import trainrec
    import trainrec.adapters.jax as trj
    from trainrec.conversion.convert import convert

    @trainrec.record
    class Step:
        n: int

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    acc = trainrec.GradientsAccumulator()
    source = trainrec.TrainingRecord.capture(model, opt, None, acc, Step(1))
    params = {"params": {"kernel": jax.numpy.zeros((3, 2)), "bias": jax.numpy.zeros((2,))}}
    tx = optax.adamw(0.1, weight_decay=0.01)  # torch AdamW's maths
    template = trainrec.TrainingRecord.capture(trj.JaxModule(params), trj.JaxOptimizer(tx, tx.init(params["params"])),
                                               None, trainrec.GradientsAccumulator(), Step(0))
    native = trainrec.NativePrecisionSettings()
    source.save(trainrec.NamedMpkFileRecorder(native), tmp_path / "src.mpk")
    template.save(trainrec.NamedMpkFileRecorder(native), tmp_path / "template.mpk")
    expected = convert(source, template).save(trainrec.NamedMpkBytesRecorder(native))
    code = _BLOCK_FRAMEWORKS + (
        "import trainrec\n"
        "from trainrec.conversion.convert import convert\n"
        "load = lambda p: trainrec.TrainingRecord.load(trainrec.NamedMpkFileRecorder(), p)\n"
        f"out = convert(load({str(tmp_path / 'src.mpk')!r}), load({str(tmp_path / 'template.mpk')!r}))\n"
        "sys.stdout.buffer.write(out.save(trainrec.NamedMpkBytesRecorder(trainrec.NativePrecisionSettings())))\n"
        "bad = [m for m in ('torch', 'jax', 'flax', 'optax') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    assert out.stdout == expected
