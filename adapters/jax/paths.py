"""ParamIds of a pytree: its key paths joined with `.` (dict keys, sequence indices,
NamedTuple field names: `params.Dense_0.kernel`, optax's `1.0.mu.Dense_0.kernel`), and
`flatten`, a tree's leaves by ParamId.
"""

from __future__ import annotations

from typing import Any

import jax


def _key_name(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def key_path(path: tuple[Any, ...]) -> str:
    """A pytree key path as a ParamId: the keys joined with `.` (a flax nnx Variable's
    trailing `.value` is left out: `l.kernel`, not `l.kernel.value`)."""
    names = [_key_name(k) for k in path]
    if len(names) > 1 and names[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":
        names.pop()
    return ".".join(names)


def flatten(tree: Any) -> tuple[dict[str, Any], Any]:
    """Leaves by ParamId, in pytree order, and the treedef to rebuild the tree."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out: dict[str, Any] = {}
    for path, leaf in leaves:
        name = key_path(path)
        if name in out:
            raise ValueError(f"two pytree leaves share the ParamId {name!r}")
        out[name] = leaf
    return out, treedef
