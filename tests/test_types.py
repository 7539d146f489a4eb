"""Types users see: `@trainrec.record` classes type-check in user code under
`mypy --strict`, protocols declare what core calls, `GradientsParams` is a `Mapping`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import typing
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

import trainrec
from trainrec import GradientsParams, Recorder
from trainrec.training.protocols import AutodiffModule, LrScheduler, Module, Optimizer

ROOT = Path(__file__).resolve().parents[1]

README_STYLE = '''
from __future__ import annotations

import numpy as np

import trainrec
from trainrec import DefaultRecorder, GradientsAccumulator, GradientsParams, RngRecord, TrainingRecord
from trainrec.adapters.numpy import MLP, SGD


@trainrec.record
class State:                      # your counters and RNG
    micro: int
    rng: RngRecord | None = None


def train(model: MLP, optimizer: SGD, gen: np.random.Generator) -> State:
    acc: GradientsAccumulator[MLP] = GradientsAccumulator()
    state = State(0)
    for _ in range(4):
        _, grads = model.loss_and_grads(np.ones((2, 3), np.float32), np.ones((2, 2), np.float32))
        acc.accumulate(model, grads)
        state.micro += 1
    summed: GradientsParams = acc.grads()
    first: object = summed["layers.0.weight"]
    names: list[str] = list(summed.keys())
    state.rng = RngRecord.capture(gen)
    TrainingRecord.capture(model, optimizer, None, acc, state).save(DefaultRecorder(), "ckpt.mpk")
    rec = TrainingRecord.load(DefaultRecorder(), "ckpt.mpk", "cpu", state_type=State)
    r = rec.restore(model, optimizer, None, "cpu")
    restored: State = r.state
    if restored.rng is not None:
        restored.rng.apply(gen)
    print(first, names)
    return restored
'''

# what users write around their state (tried by a user on main: four mypy --strict errors)
USER_CALLS = '''
from __future__ import annotations

from pathlib import Path

import trainrec
from trainrec import DefaultRecorder, NativePrecisionSettings, TrainingRecord


@trainrec.record
class State:
    micro: int


def f(path: Path, rec: TrainingRecord[State]) -> int:
    s = State(micro=1)
    DefaultRecorder().record(s, path)
    back: State = State.from_item(s.into_item(NativePrecisionSettings()))
    loaded = TrainingRecord.load(DefaultRecorder(), path, "cpu", state_type=State)
    return rec.state.micro + back.micro + loaded.state.micro
'''

WRONG = '''
import trainrec


@trainrec.record
class State:
    micro: int


State("zero")
'''


def _installed_layout(where: Path) -> Path:
    """`trainrec` as it is installed (core/ with adapters/ inside), as links: mypy cannot
    follow the editable install's import hook."""
    pkg = where / "trainrec"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "core").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "adapters").symlink_to(ROOT / "adapters")
    return where


_SHARED: dict[str, Path] = {}


def _shared(tmp_path: Path) -> Path:
    """One installed layout and mypy cache for this module's runs: mypy then analyses
    numpy and trainrec once, not once per test (about 40 s each on a busy 2-CPU VM)."""
    if "root" not in _SHARED:
        root = tmp_path.parent / "mypy-shared"
        _installed_layout(root / "site")
        _SHARED["root"] = root
    return _SHARED["root"]


_NO_FRAMEWORKS = "\n[mypy-torch.*,jax.*,jaxlib.*,matplotlib.*]\nfollow_imports = skip\n"
"""The user code here imports numpy and trainrec only, and no trainrec type it meets comes
from a framework; but einops and array_api_compat, which trainrec imports, import torch and
jax inside functions, so mypy would analyse all of torch, jax and matplotlib with them
(2,400 modules instead of 390: 30 s of each cache's first run instead of 5) for user code
that touches none of them. mypy's output on every source here is the same either way."""


def _mypy(tmp_path: Path, source: str, *, plugin: bool = True) -> subprocess.CompletedProcess[str]:
    """mypy --strict on `source` as user code, with the project's mypy configuration
    enabling `trainrec.mypy` as the README says (or without it)."""
    pytest.importorskip("mypy")
    shared = _shared(tmp_path)
    layout = shared / "site"
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent(source))
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n" + ("plugins = trainrec.mypy\n" if plugin else "") + _NO_FRAMEWORKS)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--follow-imports=silent",
         "--config-file", str(config), "--cache-dir", str(shared / ("cache" if plugin else "cache-plain")),
         str(user)],
        capture_output=True, text=True, cwd=tmp_path, env={"MYPYPATH": str(layout), "PATH": ""},
        timeout=600,
    )


def test_record_dataclass_transform_lets_user_code_pass_mypy_strict(tmp_path):
    ok = _mypy(tmp_path, README_STYLE)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_user_code_calling_record_methods_passes_mypy_strict_with_the_plugin(tmp_path):
    ok = _mypy(tmp_path, USER_CALLS)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_without_the_plugin_mypy_cannot_see_the_record_methods(tmp_path):
    bad = _mypy(tmp_path, USER_CALLS, plugin=False)  # why the README tells users to enable it
    assert bad.returncode == 1 and '"State" has no attribute "into_item"' in bad.stdout, bad.stdout
    assert "Returning Any" not in bad.stdout  # `rec.state` is a State either way


def test_the_plugin_types_from_item_as_the_class_and_into_item_as_an_item(tmp_path):
    out = _mypy(tmp_path, USER_CALLS + '''
reveal_type(State.from_item)
reveal_type(State(1).into_item)
''')
    assert 'def (item: Union[' in out.stdout or "def (item: " in out.stdout, out.stdout
    assert "-> user.State" in out.stdout and "settings: trainrec.precision.PrecisionSettings" in out.stdout


def test_mypy_checks_a_records_constructor_against_its_fields(tmp_path):
    bad = _mypy(tmp_path, WRONG)
    assert bad.returncode == 1
    assert 'Argument 1 to "State" has incompatible type "str"; expected "int"' in bad.stdout, bad.stdout


def test_record_carries_dataclass_transform():
    assert getattr(trainrec.record, "__dataclass_transform__", None) is not None


# -- protocols declare what core calls ------------------------------------------------------


def test_recorder_protocol_declares_read_which_training_record_load_calls():
    assert "read" in dir(Recorder)
    assert Recorder.read.__annotations__["return"] == "tuple[Header, Item]"


@pytest.mark.parametrize("proto", [Module, AutodiffModule, Optimizer, LrScheduler])
def test_component_protocols_return_state_records(proto):
    hints = typing.get_type_hints(proto.into_record, {"StateRecord": trainrec.StateRecord,
                                                      "AutodiffModule": AutodiffModule})
    assert hints["return"] is trainrec.StateRecord


# -- GradientsParams is a Mapping -----------------------------------------------------------


def test_gradients_params_is_a_mapping_keeping_burns_methods():
    a, b = np.ones(2, np.float32), np.zeros(3, np.float32)
    g = GradientsParams({"a": a, "b": b})
    assert isinstance(g, Mapping)
    assert g["a"] is a and list(g.keys()) == ["a", "b"] and [v is b for v in g.values()] == [False, True]
    assert dict(g) == {"a": a, "b": b} or set(dict(g)) == {"a", "b"}
    assert [k for k, _ in g.items()] == ["a", "b"]
    with pytest.raises(KeyError, match="no gradient for ParamId 'c'"):
        g["c"]
    g.register("c", a)
    assert g.get("c") is a and g.get("missing") is None and g.len() == 3 and not g.is_empty()
    assert g.remove("c") is a and "c" not in g and len(g) == 2
    assert g == g and g != GradientsParams({"a": a, "b": b})  # identity: tensors do not compare
    assert hash(g) == hash(g)
