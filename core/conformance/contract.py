"""How the conformance suite reports a broken contract: a `contract:` message naming the
component and key and the sentence broken (`_broken`, `_expect`, `_rejects`), and the
words it uses for where two runs' records differ (`_where`, `_differs`), including what
a differing RNG state says about the cause (`_rng_note`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import RecorderError
from ..items.tree import compare_items
from ..precision import NativePrecisionSettings
from ..recorders.namedmpk import NamedMpkBytesRecorder

_NATIVE = NativePrecisionSettings()


def _broken(where: str, sentence: str) -> AssertionError:
    return AssertionError(f"contract: {where}: {sentence}")


def _expect(ok: bool, where: str, sentence: str) -> None:
    if not ok:
        raise _broken(where, sentence)


def _rejects(call: Callable[[], Any], where: str, sentence: str,
             error: type[Exception] = RecorderError) -> None:
    """`call()` must raise `error`; anything else breaks the contract at `where`."""
    try:
        call()
    except error:
        return
    except Exception as e:  # noqa: BLE001 - the contract is about the type
        raise _broken(where, f"{sentence}; raised {type(e).__name__} instead: {e}") from e
    raise _broken(where, f"{sentence}; it was accepted")


_COMPONENTS = ("model", "optimizer", "scheduler", "grads", "state")


def _where(path: str) -> str:
    """A path in a TrainingRecord item as `component.key`."""
    head, _, rest = path.partition(".")
    if not head.isdigit() or int(head) >= len(_COMPONENTS):
        return path
    rest = rest.removeprefix("state.") if int(head) < 3 else rest  # component records: {kind, state}
    return f"{_COMPONENTS[int(head)]}.{rest}" if rest else _COMPONENTS[int(head)]


def _differs(expected: bytes, got: bytes) -> str:
    """The keys where two TrainingRecord payloads differ, as `component.key`, and what an
    RNG state among them means (`_rng_note`)."""
    r = NamedMpkBytesRecorder(_NATIVE)
    _, diff, paths = compare_items(r.load_item(expected), r.load_item(got))
    if not paths:
        return "the byte order"
    return ", ".join(_where(p) for p in paths[:5]) + f" (max difference {diff})" + _rng_note(paths)


# a caller-state key naming an RNG state (spec/ADAPTERS.md section 4: `rng: RngRecord`)
_RNG_WORDS = ("rng", "random", "generator")


def _rng_paths(paths: list[str]) -> list[str]:
    """The paths (as `component.key`) among `paths` that are RNG states in the caller state."""
    named = [_where(p) for p in paths]
    return [w for w in named if w.startswith("state.") and any(x in w.lower() for x in _RNG_WORDS)]


def _rng_note(paths: list[str]) -> str:
    """What an RNG state among the differing `paths` says about the cause."""
    rng = _rng_paths(paths)
    if not rng:
        return ""
    only = "only " if len(rng) == len(paths) else ""
    return (f"; {only}the caller state's RNG differs ({rng[0]}): the runs hold other RNG states, so "
            "the cause is an RNG, not the components: build(seed) must seed every RNG the state "
            "records, after_restore put each back, and a framework-global RNG be kept per run, since "
            "the suite runs parts side by side in one process (spec/ADAPTERS.md section 4)")
