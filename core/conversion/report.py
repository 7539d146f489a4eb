"""`ConversionReport`: what a conversion did (each target tensor's source, the template values
used, what was dropped or kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ConversionReport:
    """What a conversion did (`convert_with_report`; `trainrec convert --explain`).

    `source`, `target`: the forms' names. `tensors`: (target tensor, its sources, how) for
    every template tensor made, by a rule (its file and index) or by neutral names;
    `dropped`: source tensor -> the drop rule; `kept`: template tensor -> why it keeps the
    template's value (a keep rule, or a `counter`); `rules`: one line per rule given or
    preset, saying what it did; `template_values`: the `MATHS` fields where the template's
    value is used (`use_template`), with both values; `unchecked`: what nothing could
    check (an `lr=` the source cannot confirm); `forced`: what `force=True` converted
    anyway; `rounded`: what `allow_lossy=True` rounded; `state`: how the caller's state is
    typed."""

    source: str
    target: str
    tensors: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    rules: list[str] = field(default_factory=list)
    template_values: dict[str, str] = field(default_factory=dict)
    unchecked: dict[str, str] = field(default_factory=dict)
    forced: list[str] = field(default_factory=list)
    rounded: list[str] = field(default_factory=list)
    state: str = ""

    def notes(self) -> list[str]:
        """The lines a caller should see even without asking: the template's values used,
        what was not checked, forced and rounded."""
        out = [f"{k}: the template's value is used ({v})" for k, v in self.template_values.items()]
        out += [f"{k}: {v}" for k, v in self.unchecked.items()]
        out += [f"forced: {line}" for line in self.forced]
        out += [f"rounded: {line}" for line in self.rounded]
        return out

    def lines(self) -> list[str]:
        """The whole report, one fact a line."""
        out = [f"{self.source} -> {self.target}"]
        out += [f"rule {line}" for line in self.rules]
        for target, sources, how in self.tensors:
            out.append(f"{target} <- {', '.join(sources)}: {how}")
        out += [f"dropped {name}: {why}" for name, why in self.dropped.items()]
        out += [f"kept {name}: {why}" for name, why in self.kept.items()]
        out += self.notes()
        if self.state:
            out.append(f"state: {self.state}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())
