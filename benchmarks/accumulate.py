"""`GradientsAccumulator.accumulate` on JAX vs a jitted `jax.tree.map(jnp.add)` (`--rows accumulate`),
and the README's JAX loop, `acc.accumulate(model, trj.grads_from(grads, model))` with the
ParamIds worked out from the gradient tree every call, vs the same (`--rows jax-loop`).

Both sides sum the same gradient tree into a pending tree of the same structure, call after
call (a window of micro-steps); each timing is a batch of calls followed by one
`block_until_ready`, run alternately with the other side's batch; the row reports the
median seconds per call and the ratio of the two in the same run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

# (leaves, shape): small leaves at 20 and 200, and one larger set
TREES = ((20, (64, 64)), (200, (64, 64)), (20, (512, 512)))


def _per_call(fn: Any, calls: int) -> float:
    t0 = time.perf_counter()
    fn(calls)
    return (time.perf_counter() - t0) / calls


def jax_accumulate_rows(repeats: int) -> list[dict[str, Any]]:
    try:
        import jax  # noqa: F401
    except ImportError:
        return [{"name": "trainrec accumulate (jax)", "op": "accumulate (jax)", "skipped": "jax is not installed"}]
    rows: list[dict[str, Any]] = []
    for n, shape in TREES:
        rows += _tree_rows(n, shape, repeats)
    return rows


def jax_loop_rows(repeats: int) -> list[dict[str, Any]]:
    try:
        import jax  # noqa: F401
    except ImportError:
        return [{"name": "trainrec README loop (jax)", "op": "accumulate (jax)", "skipped": "jax is not installed"}]
    return _tree_rows(200, (64, 64), repeats, loop=True)


def _tree_rows(n: int, shape: tuple[int, int], repeats: int, loop: bool = False) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    import trainrec
    import trainrec.adapters.jax as trj

    tree_add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    params = {f"layer{i}": {"w": jax.random.normal(k, shape, jnp.float32)} for i, k in enumerate(keys)}
    module = trj.JaxModule(params)
    grad_tree = jax.tree.map(lambda p: p * 1e-3, params)
    grads = trj.grads_from(grad_tree, module)
    acc: trainrec.GradientsAccumulator[Any] = trainrec.GradientsAccumulator()
    acc.accumulate(module, grads)
    pending = tree_add(grad_tree, grad_tree)

    def ours(calls: int) -> None:
        for _ in range(calls):
            acc.accumulate(module, trj.grads_from(grad_tree, module) if loop else grads)
        jax.block_until_ready(list(acc._pending.values()))  # the pending arrays, not reset

    def theirs(calls: int) -> None:
        nonlocal pending
        for _ in range(calls):
            pending = tree_add(pending, grad_tree)
        jax.block_until_ready(pending)

    calls = max(5, 2000 // n) if shape == (64, 64) else 10
    ours(calls), theirs(calls)  # compile and warm both
    pairs = [(_per_call(ours, calls), _per_call(theirs, calls)) for _ in range(max(repeats, 7))]
    t_ours = statistics.median(p[0] for p in pairs)
    t_theirs = statistics.median(p[1] for p in pairs)
    what = f"{n} leaves of {'x'.join(map(str, shape))} f32"
    if loop:
        return [{"name": f"README loop: grads_from + accumulate ({what})", "op": "accumulate (jax)",
                 "seconds": t_ours, "vs_peer": t_theirs / t_ours, "leaves": n},
                {"name": f"jitted jax.tree.map(jnp.add) ({what})", "op": "accumulate (jax)",
                 "seconds": t_theirs, "leaves": n}]
    return [{"name": f"trainrec accumulate, jax ({what})", "op": "accumulate (jax)",
             "seconds": t_ours, "vs_peer": t_theirs / t_ours, "leaves": n},
            {"name": f"jitted jax.tree.map(jnp.add) ({what})", "op": "accumulate (jax)",
             "seconds": t_theirs, "leaves": n}]
