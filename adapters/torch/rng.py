"""`TorchRngRecord`: Python, numpy, torch CPU and every CUDA device's RNG state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainrec import CorruptRecordError, RecordMismatchError, RngRecord
from trainrec.adapter_kit import Item, PrecisionSettings

__all__ = ["TorchRngRecord"]


@dataclass(frozen=True)
class TorchRngRecord:
    """`RngRecord` plus torch's CPU generator, every CUDA device's generator and the
    states of any `torch.Generator`s given to `capture` (numpy `Generator`s given go to
    the embedded `RngRecord`). Torch states are opaque bytes, which no precision setting
    touches."""

    base: RngRecord
    torch_cpu: bytes
    cuda: tuple[bytes, ...]
    generators: tuple[bytes, ...] = ()

    RECORD_NAME = "TorchRngRecord"

    @classmethod
    def capture(cls, *generators: Any) -> TorchRngRecord:
        np_gens = [g for g in generators if isinstance(g, np.random.Generator)]
        torch_gens = [g for g in generators if isinstance(g, torch.Generator)]
        if len(np_gens) + len(torch_gens) != len(generators):
            raise TypeError("generators must be numpy.random.Generator or torch.Generator")
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(
            RngRecord.capture(*np_gens),
            _td(torch.get_rng_state()),
            tuple(_td(s) for s in cuda),
            tuple(_td(g.get_state()) for g in torch_gens),
        )

    def apply(self, *generators: Any) -> None:
        """Put every recorded state back (same generators, in the same order, as captured).
        Refuses a machine with another number of CUDA devices."""
        np_gens = [g for g in generators if isinstance(g, np.random.Generator)]
        torch_gens = [g for g in generators if isinstance(g, torch.Generator)]
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(self.cuda) != have:
            raise RecordMismatchError(
                f"record holds RNG state of {len(self.cuda)} CUDA devices, this machine has {have}"
            )
        if len(torch_gens) != len(self.generators):
            raise ValueError(
                f"record holds {len(self.generators)} torch generators, {len(torch_gens)} given"
            )
        self.base.apply(*np_gens)
        torch.set_rng_state(_state(self.torch_cpu))
        if self.cuda:
            torch.cuda.set_rng_state_all([_state(s) for s in self.cuda])
        for g, s in zip(torch_gens, self.generators):
            g.set_state(_state(s))

    def into_item(self, settings: PrecisionSettings) -> Item:
        return {"base": self.base.into_item(settings), "torch_cpu": self.torch_cpu,
                "cuda": list(self.cuda), "generators": list(self.generators)}

    @classmethod
    def from_item(cls, item: Item, device: Any = None) -> TorchRngRecord:
        if not isinstance(item, dict) or set(item) != {"base", "torch_cpu", "cuda", "generators"}:
            raise CorruptRecordError("TorchRngRecord must be {base, torch_cpu, cuda, generators}")
        states = [item["torch_cpu"], *_list(item["cuda"]), *_list(item["generators"])]
        if not all(isinstance(s, bytes) for s in states):
            raise CorruptRecordError("torch RNG states must be bytes")
        return cls(RngRecord.from_item(item["base"]), item["torch_cpu"],  # type: ignore[arg-type]
                   tuple(_list(item["cuda"])), tuple(_list(item["generators"])))  # type: ignore[arg-type]


def _td(state: torch.Tensor) -> bytes:
    return bytes(state.numpy().tobytes())


def _state(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _list(v: Item) -> list[Item]:
    if not isinstance(v, list):
        raise CorruptRecordError("expected a list of RNG states")
    return v
