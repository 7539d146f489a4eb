"""`trainrec.adapt` and `register_adapter`."""

from __future__ import annotations

import numpy as np
import pytest

import trainrec
from trainrec.adapters.numpy import MLP, NumpyBackend
from trainrec.training import registry


def test_protocol_objects_pass_through():
    m = MLP([2, 3])
    assert trainrec.adapt(m) is m
    assert isinstance(m, trainrec.AutodiffModule)


def test_numpy_arrays_resolve_through_the_entry_point():
    assert isinstance(trainrec.adapt(np.zeros(3)), NumpyBackend)
    assert isinstance(trainrec.adapt(np.ndarray), NumpyBackend)


def test_unknown_objects_raise_type_error_saying_how_to_fix():
    with pytest.raises(TypeError, match="register_adapter"):
        trainrec.adapt(object())


def test_registered_adapters_win_by_recency_and_mro(monkeypatch):
    monkeypatch.setattr(registry, "_registered", [])
    monkeypatch.setattr(registry, "_cache", {})

    class Net:  # a "framework" class living in this test module
        pass

    class Sub(Net):
        pass

    class Bound:
        def __init__(self, tag):
            self.tag = tag

    class A:
        name = "a"

        def __init__(self, tag):
            self.tag = tag

        def adapt(self, obj):
            return Bound(self.tag) if isinstance(obj, Net) else None

    root = Net.__module__.partition(".")[0]
    trainrec.register_adapter(A("first"), roots=[root])
    trainrec.register_adapter(A("second"), roots=[root])
    assert trainrec.adapt(Sub()).tag == "second"
    with pytest.raises(TypeError):
        trainrec.register_adapter(object(), roots=[root])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        trainrec.register_adapter(A("x"), roots="torch")  # type: ignore[arg-type]
