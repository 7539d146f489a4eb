"""The benchmark's training state: ~100 f32 tensors of mixed sizes, as torch tensors."""

from __future__ import annotations

from typing import Any

import numpy as np


def parse_size(text: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    for suffix, mult in units.items():
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(t)


def sizes(total_bytes: int, n_params: int = 25, seed: int = 0) -> list[int]:
    """Element counts of the parameters: a heavy-tailed mix, as real models have."""
    rng = np.random.default_rng(seed)
    weights = rng.pareto(1.0, n_params) + 0.05
    per_part = total_bytes // 4 // 4  # params, exp_avg, exp_avg_sq, grads; f32
    return [max(1, int(n)) for n in weights / weights.sum() * per_part]


def training_state(total_bytes: int, seed: int = 0) -> dict[str, Any]:
    """Model parameters, AdamW moments and pending gradients (~100 tensors), f32."""
    import torch

    rng = np.random.default_rng(seed)
    state: dict[str, Any] = {}
    for i, n in enumerate(sizes(total_bytes)):
        for part in ("param", "exp_avg", "exp_avg_sq", "grad"):
            state[f"layers.{i}.{part}"] = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    return state
