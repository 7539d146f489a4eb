"""Why a resume diverged: the likely cause and its fix, from where and when the first
divergence appears (`explain`).

The reasoning, in the order it is tried:

1. The checkpoint, as loaded, already differs from the state it was taken from: the
   recorder does not keep the values.
2. Something differs right after the restore (micro-step K), while the checkpoint holds it
   as it was: the resume code changed it. Pending gradients gone: a new accumulator; the
   optimizer's or scheduler's state: rebuilt after the restore; a field of the state:
   overwritten; the live RNG: recorded but never applied.
3. Everything restored equal at K and something differs after micro-step J > K: the
   micro-step read something the checkpoint does not hold. The batch it reported differs:
   the data position is outside the state. A helper in `Parts.extras` differed right after
   the restore: that one (an RNG, a data cursor, a GradScaler). Else: any of those.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from .state import differences

__all__ = ["explain", "rng_name"]

_RNG_TYPES = re.compile(r"generator|key|rng|random", re.I)
_DATA_NAMES = re.compile(r"cursor|epoch|index|offset|position|pos|sampler|loader|iter|data|batch", re.I)
_RNG_NAMES = re.compile(r"rng|key|seed|gen|random|dropout", re.I)


def rng_name(key: str) -> str:
    """A person's name for an RNG state at `key` in the `rng` component."""
    parts = key.split(".")
    rest = parts[1:]
    head = ".".join(rest[:2])
    if rest[:1] == ["torch_cpu"]:
        return "the torch CPU RNG"
    if rest[:1] == ["cuda"] and len(rest) > 1:
        return f"CUDA device {rest[1]}'s RNG"
    if head == "base.python" or rest[:1] == ["python"]:
        return "Python's random state"
    if head == "base.numpy_global" or rest[:1] == ["numpy_global"]:
        return "numpy's global RNG"
    if head == "base.generators" or (rest[:1] == ["generators"] and "torch_cpu" not in key):
        index = rest[2] if head == "base.generators" and len(rest) > 2 else rest[1] if len(rest) > 1 else "?"
        kind = "numpy Generator" if head == "base.generators" else "generator"
        return f"{kind} {index} given to capture"
    if rest[:1] == ["keys"] and len(rest) > 1:
        return f"JAX key {rest[1]} given to capture"
    if rest[:1] == ["rngs"] and len(rest) > 1:
        return f"the nnx Rngs {rest[1]} given to capture"
    return f"the RNG state `state.{key}`"


def _rng_summary(keys: Sequence[str]) -> str:
    names = list(dict.fromkeys(rng_name(k) for k in keys))
    if len(names) == 1:
        return f"only {names[0]} differs"
    return f"{', '.join(names[:-1])} and {names[-1]} differ"


def _extras_differing(ref: dict[str, Any], got: dict[str, Any]) -> list[str]:
    ref_values, got_values = ref.get("values", {}), got.get("values", {})
    return [name for name, value in ref_values.items()
            if value is not None and (name not in got_values or differences(value, got_values[name]))]


def _extra_hint(name: str, type_name: str) -> str:
    what = f"`parts.extras[{name!r}]` ({type_name})"
    if _RNG_TYPES.search(type_name) or _RNG_NAMES.search(name):
        return (f"{what} differed right after the restore: randomness the checkpoint does not "
                "hold (a JAX dropout key, a generator kept beside the state): record it in your "
                "state in before_capture (`JaxRngRecord.capture(key)`, `TorchRngRecord.capture(gen)`) "
                "and apply it in after_restore")
    if _DATA_NAMES.search(name) or _DATA_NAMES.search(type_name):
        return (f"{what} differed right after the restore: the data position (epoch, cursor, "
                "sampler) is kept outside the recorded state: keep it in your state and seek "
                "the data to it in after_restore")
    return (f"{what} differed right after the restore: its state is not in the checkpoint "
            "(a stateful helper, such as a GradScaler or an EMA): record its `state_dict()` in your "
            "state in before_capture and load it back in after_restore")


def _diff_text(gap: float) -> str:
    return f"max abs diff {gap:.3g}" if math.isfinite(gap) else "another value"


def explain(*, at: int, window: int, divergence: Any, differing: Sequence[Any],
            step: dict[str, Any], saved: Sequence[Sequence[Any]], ref_extras: dict[str, Any],
            got_extras: dict[str, Any], equal_before: Sequence[int],
            own_checkpoint: bool = False) -> str:
    """The likely cause of `divergence` (a `trainrec.check.report.Divergence`) and its fix, one
    paragraph. `differing`: every difference at that micro-step; `step`: the resume's record
    of it (pending counts, the batches); `saved`: what the loaded checkpoint holds unlike the
    state it was taken from; `*_extras`: the fingerprints of `Parts.extras` right after the
    restore and in the uninterrupted run at the same micro-step; `own_checkpoint`: the
    workload saves and resumes through its own `save_checkpoint` / `load_checkpoint` (a
    tool's: Lightning's, Accelerate's)."""
    d = divergence
    component, key, micro = d.component, d.key, d.micro_step
    components = list(dict.fromkeys(x.component for x in differing))
    extras = _extras_differing(ref_extras, got_extras)
    types = ref_extras.get("types", {})
    if saved:
        c, k, _ = saved[0]
        return (f"the checkpoint as loaded already differs from the training state it was taken "
                f"from ({c} {k}): the recorder does not keep these values as they are: save with "
                "native precision (e.g. NamedMpkFileRecorder(NativePrecisionSettings()))")
    if micro == at:
        lead = f"right after the restore at micro-step {at}"
        if component == "pending":
            ref_n, got_n = step["pending"]
            if got_n == 0 and ref_n > 0 and own_checkpoint:
                return (f"pending gradients differ {lead}: the uninterrupted run had gradients of "
                        f"{ref_n} parameters pending in the window ({at % window} of {window} "
                        "micro-steps), the resumed run has none: the workload's own checkpoint "
                        "(save_checkpoint / load_checkpoint) does not bring them back, as "
                        "Lightning's and Accelerate's checkpoints alone do not: add trainrec's "
                        "ExactResume (the torch adapter's `lightning.ExactResume` in "
                        "Trainer(callbacks=[...]), its `accelerate.ExactResume` registered for "
                        "checkpointing), or save and restore them yourself")
            if got_n == 0 and ref_n > 0:
                return (f"pending gradients differ {lead}: the uninterrupted run had gradients of "
                        f"{ref_n} parameters pending in the window ({at % window} of {window} "
                        "micro-steps), the resumed run has none: the loop starts a new accumulator after "
                        "the restore: use `restored.accumulator` (in a Workload: keep the "
                        "`parts.accumulator` the restore set)")
            return (f"pending gradients differ {lead} ({key}), though the checkpoint holds them as "
                    "they were: the resume code changes the accumulator or `.grad` after the restore: "
                    "go on with `restored.accumulator` as it is")
        if component == "model":
            return (f"the model differs {lead} ({key}), though the checkpoint holds it as it was: "
                    "the loop goes on with another model than the restored one (use "
                    "`restored.model`: an immutable model, such as an equinox module, comes back "
                    "new) or re-initializes it after the restore")
        if component == "scheduler":
            also = " and with it the optimizer's learning rate" if "optimizer" in components else ""
            return (f"the LR scheduler's state differs {lead} ({key}){also}, though the checkpoint "
                    "holds it as it was: the scheduler was rebuilt after the restore (a new one "
                    "starts its schedule over and sets the optimizer's LR back): build it before "
                    "`record.restore`, restore into it, and go on with that one")
        if component == "optimizer":
            return (f"the optimizer's state differs {lead} ({key}), though the checkpoint holds it "
                    "as it was: the optimizer was rebuilt (or reset) after the restore: build it "
                    "before `record.restore`, restore into it, and go on with that one")
        if component == "state":
            return (f"your state's field `{key}` differs {lead}, though the checkpoint holds it as "
                    "it was: the resume code overwrites `restored.state` (a counter reset, a "
                    "field set anew): go on with the state the restore returned")
        if component == "rng":
            keys = [x.key for x in differing if x.component == "rng"]
            return (f"everything else restored equal {lead}, but the live RNG does not: "
                    f"{_rng_summary(keys)}, though the checkpoint holds the uninterrupted run's: "
                    "the RNG was recorded but not applied after the restore: call "
                    "`state.rng.apply()` (in after_restore) before the next batch")
    steps_equal = f"{at}" if not equal_before or max(equal_before) == at else f"{at}..{max(equal_before)}"
    lead = (f"everything restored equal at micro-step {steps_equal}; after micro-step {micro} "
            f"(K+{micro - at})")
    hint = _extra_hint(extras[0], types.get(extras[0], "?")) if extras else ""
    if component == "data":
        ref_batch, got_batch = step.get("data") or (None, None)
        shown = ""
        if _ids(ref_batch) and _ids(got_batch) and len(str(ref_batch)) < 300:
            shown = f" (ids {got_batch} where the uninterrupted run consumed {ref_batch})"
        if hint:
            return f"{lead} the batch the micro-step consumed differs{shown}; {hint}"
        return (f"{lead} the batch the micro-step consumed differs{shown}: the data position "
                "(epoch, cursor, sampler) or the RNG the batch is drawn from is not in the recorded "
                "state: keep it in your state (the position, or the generator's state through "
                "`TorchRngRecord` / `JaxRngRecord`) and put it back in after_restore")
    if component == "rng":
        keys = [x.key for x in differing if x.component == "rng"]
        return (f"{lead} {_rng_summary(keys)}: the micro-step draws from it differently after the "
                "resume, so something that decides its draws is not recorded" + (f"; {hint}" if hint else ""))
    reported = step.get("data") is None and "data" not in components
    same_batch = " with the same batch" if reported and _reported(step) else ""
    what = f"the {'pending gradients' if component == 'pending' else component} ({key}, {_diff_text(d.max_abs_diff)})"
    if hint:
        return f"{lead} {what} differ{same_batch}, while every recorded RNG is equal; {hint}"
    return (f"{lead} {what} differ{same_batch}, while every recorded RNG is equal: the micro-step "
            "reads something the checkpoint does not hold: an RNG or key outside the state (a JAX "
            "dropout key, a torch.Generator), a stateful helper (a GradScaler, an EMA) or a data "
            "position (epoch, cursor). Keep such objects in `parts.extras` (the check then names "
            "the one), report the batch with `parts.report_batch` to tell data from arithmetic, "
            "and make sure build(seed) seeds everything the run uses")


def _ids(batch: Any) -> bool:
    """Whether a micro-step's reported batches are all sample ids (lists of ints)."""
    return isinstance(batch, list) and bool(batch) and all(
        isinstance(b, list) and all(isinstance(i, int) for i in b) for b in batch)


def _reported(step: dict[str, Any]) -> bool:
    return bool(step.get("reported"))
