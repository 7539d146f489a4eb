"""`StateRecord`: a component's state (a model's, an optimizer's, a scheduler's) as an item tree
of host copies, tagged with its `kind`; what every binding's `into_record` gives.

It needs only the item tree and the precision layer, so that `trainrec.training.protocols`
can name it in its signatures without importing the record machinery of `records`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CorruptRecordError
from ..items.tree import Item, check_item, join_key
from ..precision import PrecisionSettings, convert_item

__all__ = ["StateRecord"]


@dataclass(frozen=True)
class StateRecord:
    """A component's state as an item tree of host copies, tagged with its `kind`."""

    kind: str
    item: Item

    RECORD_NAME = "StateRecord"

    def into_item(self, settings: PrecisionSettings) -> Item:
        return {"kind": self.kind, "state": convert_item(self.item, settings)}

    @classmethod
    def from_item(cls, item: Item, device: Any = None, *, key: str = "") -> StateRecord:
        if not isinstance(item, dict) or set(item) != {"kind", "state"}:
            raise CorruptRecordError("component record must be {kind, state}", key=key)
        kind = item["kind"]
        if not isinstance(kind, str):
            raise CorruptRecordError("component kind must be a string", key=join_key(key, "kind"))
        return cls(kind, check_item(item["state"], join_key(key, "state")))
