"""`trainrec convert`: a record converted to a template's adapter from the command line, its
flags spelled as the Python API's arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..errors import RecorderError
from ..items.tensor import TensorData
from ..items.tree import Item
from .shared import _message, _regular_file
from .terminal import printable as _printable


def _progress(done: int, total: int, what: str) -> None:
    if sys.stderr.isatty():
        width = 30
        filled = width * done // max(total, 1)
        end = "\n" if done == total else ""
        print(f"\r{what} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end,
              file=sys.stderr, flush=True)


def _convertible(src: str, header: Any, item: Item) -> None:
    """Refuse (`RecorderError`, nothing written) a source read as less than its whole
    record: a format whose reader gives a view (DCP's entries without their values, a
    DDP checkpoint's rank 0 part), or a `TrainingRecord` header over an item that is not
    one."""
    from ..recorders.formats import format_named
    from ..training.record import TrainingRecord

    fmt = format_named(header.format)
    if fmt is not None and fmt.partial:
        raise RecorderError(f"cannot convert {fmt.description or fmt.name}: read as a file it "
                            f"gives {fmt.partial}, not the whole record (nothing written)",
                            source=src)
    if header.record_type == TrainingRecord.RECORD_NAME:
        try:
            TrainingRecord.from_item(item)
        except RecorderError as e:
            raise RecorderError(f"the source says it holds a TrainingRecord but does not: {e} "
                                "(nothing written)", source=src) from e


def _recorder_for(path: str) -> Any:
    """A recorder (native precision) for the format DST's extension names in the format
    registry; NamedMpk when it names none."""
    from ..precision import NativePrecisionSettings
    from ..recorders.formats import recorder_for

    return recorder_for(path, NativePrecisionSettings())


def _training(header: Any, item: Item) -> Any:
    """A file's record as a TrainingRecord: its own, or a Burn module record's (with no
    optimizer state); None for anything else."""
    from ..conversion.burn_neutral import as_training
    from ..training.record import TrainingRecord

    if header.record_type == "TrainingRecord":
        return TrainingRecord.from_item(item)
    return as_training(header, item)


def _burn_template(source: Any) -> Any:
    from ..conversion.burn_neutral import burn_template

    return burn_template(source)


# the API's spellings in conversion messages, and the command line's (patterns for re.sub)
_FLAGS = ((r"use_template=\[([^\]]*)\]", "--use-template FIELDS"),
          (r"force=True", "--force"),
          (r"allow_lossy=True", "--allow-lossy"),
          (r"drop_rng=True \(--drop-rng\)|drop_rng=True", "--drop-rng"),
          (r"convert\(lr=\.\.\.\)|\blr=(?= ?\S)", "--lr "),
          (r"\blr (is for|must be)", r"--lr \1"),
          (r"\buse_template:", "--use-template:"))


def _cli_spelling(text: str) -> str:
    """`text` (a conversion's message) naming the command line's flags, not the API's."""
    import re

    def fields(m: re.Match[str]) -> str:
        return "--use-template " + ",".join(f.strip(" '\"") for f in m.group(1).split(","))

    for pattern, flag in _FLAGS:
        text = re.sub(pattern, fields if "FIELDS" in flag else flag, text)
    return text.replace("--lr  ", "--lr ").replace("--lr (", "--lr RATE (")


def _convert(args: argparse.Namespace) -> int:
    from ..conversion.convert import ConversionError, convert_with_report, framework_of
    from ..conversion.rules import PRESETS, load_rules
    from ..items.tree import iter_tensors, map_tensors
    from ..recorders.read import read_file
    from ..training.record import TrainingRecord

    if args.to == "mpk":  # a re-encoding: the conversion's options would be silently ignored
        unused = [flag for flag, given in (("--template", args.template), ("--rules", args.rules),
                                           ("--map", args.map), ("--lr", args.lr), ("--force", args.force),
                                           ("--drop-rng", args.drop_rng), ("--allow-lossy", args.allow_lossy),
                                           ("--use-template", args.use_template), ("--explain", args.explain))
                  if given not in (None, False, [])]
        if unused:
            print(f"trainrec convert: --to mpk re-encodes the record as it is; {', '.join(unused)} "
                  "apply only to a conversion (--to FORM)", file=sys.stderr)
            return 2
    try:
        for given, checkpoint in ((args.src, True), (args.template, True), (args.map, False)):
            if given is not None:
                _regular_file(given, checkpoint=checkpoint)
        header, item = read_file(args.src, mmap=True)  # NamedMpk sources stream from the map
        _convertible(args.src, header, item)
        if args.to == "mpk":
            total = sum(1 for _ in iter_tensors(item))
            count = [0]

            def tick(_: str, t: TensorData) -> TensorData:
                def read() -> Any:
                    count[0] += 1
                    _progress(count[0], total, "writing")
                    return t.read()

                return TensorData(t.dtype, t.shape, read)  # counts as the writer reaches it

            _recorder_for(args.dst).save_item(map_tensors(item, tick), args.dst, header.record_type)
            summary: dict[str, Any] = {"dst": args.dst, "record": header.record_type, "tensors": total}
        else:
            if not args.template and args.to != "burn":  # a Burn target can be made from the source
                print(f"trainrec convert: --to {args.to} needs --template", file=sys.stderr)
                return 2
            found = _training(header, item)
            if found is None:
                print(_printable(f"trainrec convert: {args.src} holds a {header.record_type}, "
                                 "not a TrainingRecord"), file=sys.stderr)
                return 2
            source: TrainingRecord[Any] = found
            template: TrainingRecord[Any] | None = (_training(*read_file(args.template)) if args.template
                                                   else _burn_template(source))
            if template is None:
                print(_printable(f"trainrec convert: the template {args.template} holds no TrainingRecord"),
                      file=sys.stderr)
                return 2
            if framework_of(template) != args.to:
                print(_printable(f"trainrec convert: the template is a {framework_of(template)} record, "
                                 f"not {args.to}"), file=sys.stderr)
                return 2
            if args.map:
                print("trainrec convert: note: --map is deprecated, use --rules", file=sys.stderr)
            rules = []
            for given in (args.rules or []) + ([args.map] if args.map else []):
                if given not in PRESETS or os.path.exists(given):
                    _regular_file(given, checkpoint=False)
                rules += load_rules(given)
            lr = None if args.lr is None else args.lr[0] if len(args.lr) == 1 else args.lr
            fields = [f.strip() for given in args.use_template or [] for f in given.split(",") if f.strip()]
            converted, report = convert_with_report(source, template, rules=rules or None, force=args.force,
                                                    drop_rng=args.drop_rng, lr=lr, allow_lossy=args.allow_lossy,
                                                    use_template=fields)
            converted.save(_recorder_for(args.dst), args.dst)
            summary = {"dst": args.dst, "from": framework_of(source), "to": args.to,
                       "parameters": sum(1 for _ in iter_tensors(converted.model.item)),
                       "pending_gradients": len(converted.grads.grads)}
            opt_state = converted.optimizer.item
            if args.to == "burn" and isinstance(opt_state, dict) and opt_state.get("tensors"):
                from ..recorders.burn import (
                    optimizer_path,  # BurnpackRecorder wrote Burn's optimizer record there
                )

                summary["optimizer"] = str(optimizer_path(args.dst))
            if args.json and (args.explain or report.notes()):
                summary["report" if args.explain else "notes"] = report.lines() if args.explain else report.notes()
            elif args.explain:
                print("\n".join(_printable(line) for line in report.lines()))
            for note in [] if args.json else report.notes():
                print(_printable(f"trainrec convert: note: {_cli_spelling(note)}"), file=sys.stderr)
    except ConversionError as e:
        print(f"trainrec convert: refused: {_cli_spelling(_message(e, lines=True))}", file=sys.stderr)
        return 4
    except (RecorderError, ValueError, OSError) as e:
        print(f"trainrec convert: {_cli_spelling(_message(e))}", file=sys.stderr)
        return 3
    print(json.dumps(summary) if args.json else
          _printable("wrote " + ", ".join(f"{k} {v}" for k, v in summary.items())))
    return 0
