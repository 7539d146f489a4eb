"""`MLP`: the reference `AutodiffModule`, a multi-layer perceptron with explicit backward."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from trainrec import DType, GradientsParams, StateRecord, TensorData
from trainrec.adapter_kit import check_tensor_map, expect_kind

from .backend import NumpyBackend

__all__ = ["MLP"]


class MLP:
    """Linear layers with ReLU between them (and inverted dropout when `dropout > 0` and
    a generator is passed), mean-squared-error loss. Parameters are `layers.{i}.weight`
    ([out, in]) and `layers.{i}.bias` ([out]), initialised as torch's `nn.Linear`."""

    kind = "trainrec.numpy.MLP"

    def __init__(
        self, sizes: Sequence[int], *, seed: int = 0, dtype: Any = np.float32, dropout: float = 0.0
    ) -> None:
        if len(sizes) < 2:
            raise ValueError("an MLP needs at least input and output sizes")
        rng = np.random.default_rng(seed)
        self.dropout = dropout
        self.params: dict[str, np.ndarray[Any, Any]] = {}
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            bound = 1.0 / np.sqrt(n_in)
            self.params[f"layers.{i}.weight"] = rng.uniform(-bound, bound, (n_out, n_in)).astype(dtype)
            self.params[f"layers.{i}.bias"] = rng.uniform(-bound, bound, (n_out,)).astype(dtype)
        self._layers = len(sizes) - 1

    @property
    def backend(self) -> NumpyBackend:
        return NumpyBackend()

    def param_ids(self) -> list[str]:
        return list(self.params)

    def param_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.params.items()}

    def forward(self, x: np.ndarray[Any, Any], rng: np.random.Generator | None = None) -> Any:
        """The output and the cache `backward` needs."""
        cache = []
        h = x.astype(self.params["layers.0.weight"].dtype)
        for i in range(self._layers):
            w, b = self.params[f"layers.{i}.weight"], self.params[f"layers.{i}.bias"]
            z = h @ w.T + b
            mask = None
            if i < self._layers - 1:
                out = np.maximum(z, 0)
                if self.dropout > 0 and rng is not None:
                    keep = rng.random(out.shape) >= self.dropout
                    mask = keep.astype(out.dtype) / out.dtype.type(1 - self.dropout)
                    out = out * mask
            else:
                out = z
            cache.append((h, z, mask))
            h = out
        return h, cache

    def loss_and_grads(
        self, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any], rng: np.random.Generator | None = None
    ) -> tuple[float, GradientsParams]:
        """Mean-squared error and the gradients of every parameter."""
        out, cache = self.forward(x, rng)
        diff = out - y.astype(out.dtype)
        loss = float(np.mean(diff * diff))
        d = (2.0 / diff.size) * diff
        grads = GradientsParams()
        for i in reversed(range(self._layers)):
            h, z, mask = cache[i]
            if i < self._layers - 1:
                if mask is not None:
                    d = d * mask
                d = d * (z > 0)
            w = self.params[f"layers.{i}.weight"]
            grads.register(f"layers.{i}.weight", (d.T @ h).astype(w.dtype))
            grads.register(f"layers.{i}.bias", d.sum(axis=0).astype(w.dtype))
            d = d @ w
        return loss, grads

    def into_record(self) -> StateRecord:
        return StateRecord(self.kind, {k: TensorData.from_array(v) for k, v in self.params.items()})

    def _expected(self) -> dict[str, tuple[tuple[int, ...], DType]]:
        return {k: (tuple(v.shape), DType.from_numpy(v.dtype)) for k, v in self.params.items()}

    def check_record(self, record: Any) -> None:
        check_tensor_map(expect_kind(record, self.kind, "model"), self._expected(), "model")

    def load_record(self, record: Any, device: Any) -> None:
        NumpyBackend().device(device)
        tensors = check_tensor_map(expect_kind(record, self.kind, "model"), self._expected(), "model")
        staged = {k: t.array.astype(self.params[k].dtype) for k, t in tensors.items()}
        for k, v in staged.items():
            self.params[k][...] = v
