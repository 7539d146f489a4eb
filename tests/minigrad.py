"""minigrad: a tiny framework that knows nothing of trainrec, which `trainrec_minigrad`
binds the way an adapter author binds a framework trainrec does not ship.

It is shaped like tinygrad where that matters to an adapter:

- a `Tensor` is a mutable object holding its data and a `.grad`, which `backward`
  adds into: a second backward before `zero_grad` accumulates, so gradients can be pending
  on the tensors themselves;
- a model is any plain class holding tensors (no base class an adapter could claim);
  `get_state_dict(obj)` names its tensors by attribute path (`l1.weight`);
- one framework-global RNG (`manual_seed`, `randn`, `rand`, `rng_state` /
  `set_rng_state`);
- `Adam` holds its parameters and buffers in lists, by position, keeps no step count (only
  the running products `b1_t = b1**t` and `b2_t = b2**t`) and holds its learning rate
  `lr` as data, which a schedule writes before each step.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_RNG = np.random.Generator(np.random.PCG64(0))


def manual_seed(seed: int) -> None:
    _RNG.bit_generator.state = np.random.PCG64(seed).state


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = _RNG.bit_generator.state
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    _RNG.bit_generator.state = state


class Tensor:
    """Data (a numpy array the tensor owns) and `.grad` (a Tensor or None)."""

    def __init__(self, data: Any, dtype: Any = np.float32) -> None:
        self.data = np.array(data, dtype=dtype, copy=True)
        self.grad: Tensor | None = None

    @classmethod
    def wrap(cls, array: np.ndarray[Any, Any]) -> Tensor:
        """A tensor over `array` itself (no copy), as a lazy framework's result is."""
        t = cls.__new__(cls)
        t.data, t.grad = array, None
        return t

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data.dtype

    def numpy(self) -> np.ndarray[Any, Any]:
        return self.data.copy()

    def assign(self, value: Any) -> Tensor:
        """Write `value` into this tensor's buffer, in place."""
        np.copyto(self.data, value.data if isinstance(value, Tensor) else value, casting="unsafe")
        return self

    def cast(self, dtype: Any) -> Tensor:
        return self if self.data.dtype == np.dtype(dtype) else Tensor(self.data, dtype)

    def clone(self) -> Tensor:
        return Tensor(self.data, self.data.dtype)

    def __add__(self, other: Tensor) -> Tensor:
        return Tensor.wrap(self.data + other.data)


def randn(*shape: int) -> Tensor:
    return Tensor.wrap(_RNG.standard_normal(shape, dtype=np.float32))


def rand(*shape: int) -> Tensor:
    return Tensor.wrap(_RNG.random(shape, dtype=np.float32))


class Linear:
    def __init__(self, n_in: int, n_out: int) -> None:
        bound = 1.0 / np.sqrt(n_in)
        self.weight = Tensor(_RNG.uniform(-bound, bound, (n_out, n_in)))
        self.bias = Tensor(np.zeros(n_out))


def get_state_dict(obj: Any, prefix: str = "") -> dict[str, Tensor]:
    """Every tensor an object holds, by attribute path, in attribute order."""
    out: dict[str, Tensor] = {}
    items = enumerate(obj) if isinstance(obj, (list, tuple)) else vars(obj).items()
    for name, value in items:
        path = f"{prefix}{name}"
        if isinstance(value, Tensor):
            out[path] = value
        elif isinstance(value, (list, tuple)) or hasattr(value, "__dict__"):
            out.update(get_state_dict(value, path + "."))
    return out


def get_parameters(obj: Any) -> list[Tensor]:
    return list(get_state_dict(obj).values())


def _add_grad(t: Tensor, g: np.ndarray[Any, Any]) -> None:
    g = g.astype(t.data.dtype)
    t.grad = Tensor.wrap(g) if t.grad is None else t.grad + Tensor.wrap(g)


def mlp_backward(layers: list[Linear], x: np.ndarray[Any, Any], y: np.ndarray[Any, Any],
                 dropout: float = 0.0) -> float:
    """The mean-squared error of a ReLU MLP (dropout masks from the global RNG); adds each
    parameter's gradient into its `.grad`, as `loss.backward()` does."""
    h, cache = x, []
    for i, layer in enumerate(layers):
        z = h @ layer.weight.data.T + layer.bias.data
        mask = None
        if i < len(layers) - 1:
            z = np.maximum(z, 0)
            if dropout:
                mask = (rand(*z.shape).data >= dropout).astype(np.float32) / np.float32(1 - dropout)
                z = z * mask
        cache.append((h, z, mask))
        h = z
    diff = h - y
    d = (2.0 / diff.size) * diff
    for i in reversed(range(len(layers))):
        inp, z, mask = cache[i]
        if i < len(layers) - 1:
            d = d * (z > 0) * (1 if mask is None else mask)
        _add_grad(layers[i].weight, d.T @ inp)
        _add_grad(layers[i].bias, d.sum(axis=0))
        d = d @ layers[i].weight.data
    return float(np.mean(diff * diff))


class Adam:
    def __init__(self, params: list[Tensor], lr: float = 1e-3, b1: float = 0.9, b2: float = 0.999,
                 eps: float = 1e-8) -> None:
        self.params = list(params)
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
        self.m = [Tensor(np.zeros(p.shape)) for p in self.params]
        self.v = [Tensor(np.zeros(p.shape)) for p in self.params]
        self.b1_t, self.b2_t = 1.0, 1.0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        self.b1_t *= self.b1
        self.b2_t *= self.b2
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            g = p.grad.data
            m.assign(self.b1 * m.data + (1 - self.b1) * g)
            v.assign(self.b2 * v.data + (1 - self.b2) * g * g)
            m_hat = m.data / np.float32(1 - self.b1_t)
            v_hat = v.data / np.float32(1 - self.b2_t)
            p.assign(p.data - np.float32(self.lr) * m_hat / (np.sqrt(v_hat) + np.float32(self.eps)))
