"""What an optax optimizer's update is, read from its record; imports no JAX.

A `JaxOptimizer` (and `nnx.Optimizer`) record names its transforms with their
hyperparameters under `#identity` (`identity.py`), schedules included as their optax
function's name and the constants it captured. `optax_maths` reads the neutral `MATHS`
of the update from it (`trainrec.convert.MATHS`): the algorithm's betas, eps or momentum,
weight decay before the algorithm's transform (L2, coupled) or after it (decoupled, as
`optax.adamw`), gradient clipping before it, and the learning rate of the update at a
schedule count, evaluated here from the recorded schedule (`schedule_value`) with the
closed forms of optax 0.2's built-in schedules. A schedule that is a function of the
caller's, or a chain this does not read, leaves the value unknown, with why.

Values are computed in float64; optax computes them in float32, so they agree to
float32's precision (the engine's comparison allows for it).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from typing import Any

from trainrec.adapter_kit import Item, TensorData

__all__ = ["optax_maths", "schedule_value", "schedule_scale", "FACTORY_DEFAULTS"]
_F32 = 1e-6  # optax's schedules in float32: a value is within about 8 ulps of the schedule's scale

# the defaults of the optax factories `inject_hyperparams` wraps (optax 0.2; a test holds
# them to optax's signatures): what an argument not given is
FACTORY_DEFAULTS: dict[str, dict[str, Item]] = {
    "adam": {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0},
    "adamw": {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "eps_root": 0.0, "weight_decay": 1e-4},
    "sgd": {"momentum": None},
}
_CLIPS = {"clip_by_global_norm": ("clip_norm", "max_norm"), "clip": ("clip_value", "max_delta")}


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _schedule_spec(spec: Any) -> Any:
    """A schedule as `identity_of` records it: `{"fn": ...}`, or (an `inject_hyperparams`
    schedule) the `WrappedSchedule` transform that holds it."""
    if isinstance(spec, list) and len(spec) == 1 and isinstance(spec[0], dict):
        inner = spec[0].get("self")
        if isinstance(inner, dict) and "schedule_fn" in inner:
            return inner["schedule_fn"]
    return spec


def _interpolate(name: str) -> Callable[[float, float, float], float] | None:
    if name == "_linear_interpolate":
        return lambda start, end, pct: (end - start) * pct + start
    if name == "_cosine_interpolate":
        return lambda start, end, pct: end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)
    return None


def schedule_value(spec: Any, count: int) -> float | None:
    """The value of the optax schedule `spec` (as `identity_of` records it) at `count`, or
    None where it is not one of optax's built-in schedules with the constants this needs."""
    spec = _schedule_spec(spec)
    if not isinstance(spec, dict):
        return _number(spec)
    fn = spec.get("fn")
    table: dict[str, Any] = spec

    def num(key: str) -> float:  # KeyError, TypeError where the schedule does not hold it
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{key} is {value!r}")
        return float(value)

    def items(key: str) -> list[Any]:
        value = table[key]
        if not isinstance(value, (list, dict)):
            raise TypeError(f"{key} is {value!r}")
        return list(value.items()) if isinstance(value, dict) else list(value)

    try:
        if fn == "constant_schedule":
            return num("value")
        if fn in ("polynomial_schedule", "exponential_decay") and set(spec) <= {"fn", "init_value"}:
            return num("init_value")  # their `lambda count: init_value` for degenerate steps
        if fn == "polynomial_schedule":
            init, end, power = num("init_value"), num("end_value"), num("power")
            steps, begin = num("transition_steps"), num("transition_begin")
            c = min(max(count - begin, 0.0), steps)
            return float((init - end) * (1 - c / steps) ** power + end)
        if fn == "exponential_decay":
            init, rate = num("init_value"), num("decay_rate")
            steps, begin = num("transition_steps"), num("transition_begin")
            decreased = count - begin
            p = decreased / steps
            if spec.get("staircase"):
                p = math.floor(p)
            value = init if decreased <= 0 else float(init * rate ** p)
            bound = _number(spec.get("end_value"))
            if bound is not None:
                value = max(value, bound) if rate < 1.0 else min(value, bound)
            return value
        if fn == "cosine_decay_schedule":
            init, steps, alpha, exponent = num("init_value"), num("decay_steps"), num("alpha"), num("exponent")
            c = min(float(count), steps)
            decay = 0.5 * (1 + math.cos(math.pi * c / steps))
            return float(init * ((1 - alpha) * decay ** exponent + alpha))
        if fn == "piecewise_constant_schedule":
            v = num("init_value")
            pairs = items("boundaries_and_scales") if spec.get("boundaries_and_scales") else []
            for threshold, scale in sorted((int(k), float(x)) for k, x in pairs):
                indicator = 1.0 if threshold > count else 0.0  # max(0, sign(threshold - count))
                v = v * indicator + (1 - indicator) * scale * v
            return v
        if fn == "piecewise_interpolate_schedule":
            kind = spec.get("interpolate_fn")
            interpolate = _interpolate(str(kind.get("fn")) if isinstance(kind, dict) else "")
            if interpolate is None:
                return None
            bounds = [0.0, *(float(b) for b in items("boundaries"))]
            values = [num("init_value")]
            for scale in items("scales"):
                values.append(values[-1] * float(scale))
            if count >= bounds[-1]:
                return values[-1]
            for i in range(len(bounds) - 1):
                if bounds[i] <= count < bounds[i + 1]:
                    pct = (count - bounds[i]) / max(bounds[i + 1] - bounds[i], 1.0)
                    return interpolate(values[i], values[i + 1], pct)
            return None  # a negative count
        if fn == "join_schedules":
            schedules, boundaries = items("schedules"), [int(b) for b in items("boundaries")]
            out = schedule_value(schedules[0], count)
            for boundary, other in zip(boundaries, schedules[1:]):
                if count >= boundary:
                    out = schedule_value(other, count - boundary)
            return out
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError):
        return None
    return None


def schedule_scale(spec: Any) -> float:
    """The largest value the constants of schedule `spec` reach (its init, peak and end
    values, and their products with scales): float32's error in optax's value is relative
    to it, not to the value (a warm-up's first steps, a cosine's last)."""
    spec = _schedule_spec(spec)
    if isinstance(spec, list):
        return max((schedule_scale(x) for x in spec), default=0.0)
    if not isinstance(spec, dict):
        return abs(_number(spec) or 0.0)
    out = 0.0
    for key, value in spec.items():
        if key.endswith("value") and _number(value) is not None:
            out = max(out, abs(float(value)))
        elif isinstance(value, (dict, list)):
            out = max(out, schedule_scale(value))
    table = spec.get("scales") or list((spec.get("boundaries_and_scales") or {}).values())
    v = abs(_number(spec.get("init_value")) or 0.0)
    for scale in table if isinstance(table, list) else ():
        v *= abs(_number(scale) or 0.0)
        out = max(out, v)
    return out


def _entries(leaves: dict[str, Item]) -> list[dict[str, Item]] | None:
    """The transforms of the record, in chain order: `#identity`, or (a record captured
    before it was kept) the names and scalar arguments `#transforms` holds."""
    identity = leaves.get("#identity")
    if isinstance(identity, list) and all(isinstance(e, dict) for e in identity):
        return [e for e in identity if isinstance(e, dict)]
    names = leaves.get("#transforms")
    if not isinstance(names, list):
        return None
    out: list[dict[str, Item]] = []
    for name in names:
        if not isinstance(name, str):
            return None
        base, _, args = name.partition("(")
        entry: dict[str, Item] = {"transform": base}
        for part in args.rstrip(")").split(", ") if args.rstrip(")") else []:
            key, _, value = part.partition("=")
            try:
                entry[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                entry[key] = value
        out.append(entry)
    return out


def optax_maths(leaves: dict[str, Item], algorithm: str, schedule_count: int,
                update_count: int) -> tuple[dict[str, Item], dict[str, str], dict[str, float]]:
    """The `MATHS` of the optax update `leaves` (an optimizer record's) makes, with its
    schedules at `schedule_count` (those of `inject_hyperparams` at `update_count`, the
    count they keep); the fields it cannot say, with why; the absolute tolerance of the
    values computed from schedules."""
    entries = _entries(leaves)
    unknown: dict[str, str] = {}
    tolerance: dict[str, float] = {}
    if entries is None:
        return {}, {"*": "the record names no optax transforms"}, tolerance
    algo_at = next((i for i, e in enumerate(entries)
                    if e.get("transform") in ("scale_by_adam", "trace", "inject_hyperparams")), None)
    settings: dict[str, Item] = {"maximize": False, "clip_norm": None, "clip_value": None}
    coupled: list[Item] = []
    decoupled: list[Item] = []
    rates: list[tuple[str, float | None]] = []
    for i, e in enumerate(entries):
        name = str(e.get("transform"))
        after = algo_at is not None and i > algo_at
        if name in _CLIPS and not after:
            key, arg = _CLIPS[name]
            settings[key] = _number(e.get(arg))
        elif name == "add_decayed_weights":
            value = _number(e.get("weight_decay"))
            (decoupled if after else coupled).append(value if e.get("mask") is None else "masked")
        elif name == "masked":
            inner = e.get("inner")
            if isinstance(inner, list) and any(isinstance(x, dict) and x.get("transform") == "add_decayed_weights"
                                               for x in inner):
                (decoupled if after else coupled).append("masked (optax.masked: some parameters only)")
        elif name == "scale" and after:
            step = _number(e.get("step_size"))
            rates.append(("scale", None if step is None else -step))
        elif name == "scale_by_schedule" and after:
            fn = e.get("step_size_fn")
            if isinstance(fn, dict) and fn.get("fn") == "scale_by_learning_rate":
                value = schedule_value(fn.get("learning_rate"), schedule_count)
                tolerance["lr"] = _F32 * schedule_scale(fn.get("learning_rate"))
                m = _number(fn.get("m"))
                rates.append(("schedule", None if value is None or m is None else -m * value))
            else:
                rates.append(("schedule", None))
        elif name == "scale_by_adam":
            settings.update(b1=_number(e.get("b1")), b2=_number(e.get("b2")), eps=_number(e.get("eps")),
                            amsgrad=False)
        elif name == "trace":
            settings.update(momentum=_number(e.get("decay")), nesterov=bool(e.get("nesterov")), dampening=0.0)
        elif name == "inject_hyperparams":
            _injected(e, leaves, update_count, settings, unknown, coupled, decoupled, rates, tolerance)
    if algorithm == "sgd" and "momentum" not in settings:
        settings.update(momentum=0.0, nesterov=False, dampening=0.0)
    if algorithm == "sgd" and not _number(settings.get("momentum")):  # no momentum: L2 either way
        coupled, decoupled = coupled + decoupled, []
    if coupled and decoupled:
        settings["weight_decay"] = f"coupled {coupled} and decoupled {decoupled}"
    else:
        found = coupled or decoupled
        settings["weight_decay"] = (found[0] if len(found) == 1 else f"several: {found}") if found else 0.0
        settings["decoupled_weight_decay"] = bool(decoupled)
    if len(rates) == 1 and rates[0][1] is not None:
        settings["lr"] = rates[0][1]
    elif "lr" in unknown:
        pass
    elif len(rates) == 1:
        unknown["lr"] = ("its learning-rate schedule is not one of optax's built-in schedules with recorded "
                         "constants (a function of yours)")
    else:
        unknown["lr"] = (f"{len(rates)} learning-rate transforms after the algorithm's" if rates
                         else "no learning-rate transform after the algorithm's")
    return settings, unknown, tolerance


def _injected(e: dict[str, Item], leaves: dict[str, Item], count: int, settings: dict[str, Item],
              unknown: dict[str, str], coupled: list[Item], decoupled: list[Item],
              rates: list[tuple[str, float | None]], tolerance: dict[str, float]) -> None:
    """The maths of `inject_hyperparams(adam | adamw | sgd)`: its factory's defaults, the
    values its state holds now (set by hand, or numeric arguments), its schedules at
    `count`."""
    factory = e.get("inner_factory")
    name = str(factory.get("fn")) if isinstance(factory, dict) else ""
    if name not in FACTORY_DEFAULTS:
        unknown["*"] = f"inject_hyperparams({name}) is not adam, adamw or sgd"
        return
    hps: dict[str, Item] = dict(FACTORY_DEFAULTS[name])
    numeric = e.get("numeric_hps")
    if isinstance(numeric, dict):
        hps.update(numeric)
    for key, value in leaves.items():
        if ".hyperparams." in f".{key}" or key.startswith("hyperparams."):
            hp = key.rsplit(".", 1)[-1]
            if hp in hps or hp == "learning_rate":
                hps[hp] = _leaf_number(value)
    sched = e.get("sched_hps")
    for hp, spec in (sched.items() if isinstance(sched, dict) else ()):
        hps[hp] = schedule_value(spec, count)
        tolerance["lr" if hp == "learning_rate" else hp] = _F32 * schedule_scale(spec)
        if hps[hp] is None:
            unknown["lr" if hp == "learning_rate" else hp] = f"its {hp} schedule is not one optax builds in"
    other = e.get("other_hps")
    mask = other.get("mask") if isinstance(other, dict) else None
    eps_root = _number(hps.get("eps_root")) or 0.0
    if name in ("adam", "adamw"):
        eps = _number(hps.get("eps"))
        settings.update(b1=_number(hps.get("b1")), b2=_number(hps.get("b2")), amsgrad=False,
                        eps=eps if not eps_root else f"{eps} with eps_root {eps_root}")
    else:
        settings.update(momentum=_number(hps.get("momentum")) or 0.0,
                        nesterov=bool(other.get("nesterov")) if isinstance(other, dict) else False, dampening=0.0)
    if name == "adamw":
        decay = _number(hps.get("weight_decay"))
        decoupled.append(decay if mask is None else "masked (optax.adamw's mask: some parameters only)")
    rate = _number(hps.get("learning_rate"))
    rates.append(("inject", rate))


def _leaf_number(value: Item) -> float | None:
    if isinstance(value, TensorData) and value.shape in ((), (1,)):
        return float(value.array.reshape(()))
    return _number(value)
