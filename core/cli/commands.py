"""The `trainrec` command line (also `python -m trainrec`).

Exit codes: 0 success, 1 the check failed (corrupt file, records differ, inexact
resume), 2 usage errors, 3 a file could not be read or written as a record (`check`: the
workload itself failed), 4 a conversion was refused (the message lists every reason).

Safe to point at any file: only regular files are read, and the directories of the
formats of directories (Orbax, DDP, DCP checkpoints); a FIFO, device or other directory
is refused with exit 3 before it is opened (and every reader refuses what is not a
regular file, should a path change after that check), and every string that comes from a file or a
path is printed with its control and other non-printable characters escaped (`\x1b`,
`\n`, `\u202e`), so a crafted key cannot move the cursor, recolour the terminal or
print a line of its own. `--json` output escapes them as JSON does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import stat
import sys
from collections.abc import Sequence
from typing import Any

from ..errors import CorruptRecordError, FileMissingError, RecorderError
from ..items.tensor import TensorData
from ..items.tree import Item, map_leaves
from ..storage.location import is_url
from .terminal import printable as _printable

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code. A reader that closes the pipe early
    (`trainrec inspect FILE | head`) ends it quietly, with 141 as a shell reports SIGPIPE."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe fails here, not at exit
        return code
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush goes nowhere
        return 141


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainrec", description="Exact, portable training checkpoints."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="train with gradient accumulation, kill mid-window, resume, prove it bitwise exact",
        description="Trains a small model with gradient accumulation, checkpoints in the "
        "middle of an accumulation window, kills the training process, resumes from the file "
        "in a new process and compares against an uninterrupted run. Exit 0 only when the "
        "resume is bitwise exact.",
    )
    demo.add_argument("--backend", type=_demo_backend, default="auto",
                      help="auto, torch, jax, numpy, or module:attr naming a trainrec Workload "
                      "of any adapter (spec/ADAPTERS.md)")
    demo.add_argument("--steps", type=int, default=24, help="micro-steps in all (default 24)")
    demo.add_argument("--window", type=int, default=4, help="accumulation window (default 4)")
    demo.add_argument("--checkpoint-at", type=int, default=None,
                      help="micro-step to checkpoint after (default: mid-window near the middle)")
    demo.add_argument("--workdir", default=None, help="where to keep files (default: a temp dir)")
    demo.add_argument("--json", action="store_true", help="print the results as JSON")

    ins = sub.add_parser("inspect", help="show a record file's header and tensors",
                         description="Format, version, precision, record kind and a tree of "
                         "components with dtype, shape and bytes. Reads no tensor bytes of a "
                         "NamedMpk file (.pt and flax files: their file checksum reads every byte).")
    ins.add_argument("file")
    ins.add_argument("--json", action="store_true")

    ver = sub.add_parser("verify", help="check every checksum of a record file (exit 1 on corruption)")
    ver.add_argument("file")
    ver.add_argument("--json", action="store_true")

    dif = sub.add_parser("diff", help="compare two record files tensor by tensor (exit 1 when they differ)",
                         description="Per-tensor max absolute and relative difference, the count of "
                         "bitwise-equal tensors and each differing scalar with both values, for any two "
                         "record files (any trainrec format); a TrainingRecord's keys by part: model., "
                         "optimizer., scheduler., pending., state.")
    dif.add_argument("a")
    dif.add_argument("b")
    dif.add_argument("--json", action="store_true")

    con = sub.add_parser(
        "convert", help="convert a record file between formats and frameworks",
        description="Re-encode a record as NamedMpk (--to mpk), or convert a TrainingRecord "
        "to another adapter's layout (--to torch, jax (flax linen), flax.nnx, equinox, "
        "trainrec.numpy or any adapter's neutral form name) following a template: a record file "
        "captured from a freshly built run of the target (its model and optimizer decide "
        "names, layouts and state structure). DST's extension picks the format: .pt "
        "(TorchFileRecorder), .msgpack (FlaxMsgpackFileRecorder), else NamedMpk.")
    con.add_argument("src")
    con.add_argument("dst")
    con.add_argument("--to", required=True, metavar="FORM",
                     help="mpk (re-encode as NamedMpk; none of the options below apply), or the target's "
                          "neutral form: torch, jax, flax.nnx, equinox, trainrec.numpy, or the name an adapter registers (spec/ADAPTERS.md section 8)")
    con.add_argument("--template", help="record file of the target (for every --to but mpk; --to burn "
                     "without one: Burn's names and new ParamIds); a Burn module file (.bpk, Burn's .mpk) "
                     "converts as a TrainingRecord without optimizer state")
    con.add_argument("--rules", action="append", metavar="FILE",
                     help="conversion rules: a JSON file {\"rules\": [{\"match\", \"replace\", ...}]} "
                          "(regex renames with backreferences and name maps, einops rearrange "
                          "patterns, reshape, registered transforms, one-to-many and many-to-one; "
                          "spec/CONVERSION.md), or a built-in preset's name (attention); repeat it "
                          "for several: they are tried in the order given, before the built-in ones")
    con.add_argument("--map", help="deprecated spelling of --rules (one file)")
    con.add_argument("--force", action="store_true",
                     help="convert even where the optimizer algorithms or the schedule's position do not carry "
                          "(never where the optimizer's maths differ: see --use-template)")
    con.add_argument("--use-template", action="append", metavar="FIELD",
                     help="take the template's value of this field of the optimizer's maths where the source's "
                          "differs or is unknown (lr, b1, b2, eps, momentum, weight_decay, ...: "
                          "trainrec.convert.MATHS); repeat it, or separate fields with commas")
    con.add_argument("--explain", action="store_true",
                     help="print which rule or neutral name made each tensor, what was dropped and kept, and "
                          "every value not carried from the source")
    con.add_argument("--lr", type=float, nargs="+", metavar="RATE",
                     help="the learning rate at the record's schedule position (one, or one per "
                          "param group): needed for a torch target whose scheduler computes it; give "
                          "exactly the value the target's scheduler has there (checked against the "
                          "source's rate where the source gives one)")
    con.add_argument("--drop-rng", action="store_true", help="drop framework RNG states (not convertible)")
    con.add_argument("--allow-lossy", action="store_true",
                     help="round values into a template's narrower dtypes (refused by default)")
    con.add_argument("--json", action="store_true")

    from .check import add_check_parser

    add_check_parser(sub)  # `trainrec check TARGET` (core/check_cli.py)

    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "demo":
        from .demo import run_demo

        if ":" in args.backend:
            problem = _harness_problem(args.backend)
            if problem:
                print(f"trainrec demo: --backend {_printable(args.backend)}: {problem}", file=sys.stderr)
                return 2
        try:
            return run_demo(
                backend=args.backend, steps=args.steps, window=args.window,
                checkpoint_at=args.checkpoint_at, workdir=args.workdir, as_json=args.json,
            )
        except BrokenPipeError:
            raise
        except OSError as e:  # e.g. --workdir names a file, or a place it cannot write
            print(f"trainrec demo: {_message(e)}", file=sys.stderr)
            return 3
    if args.command == "check":
        from .check import run_check

        return run_check(args)
    if args.command == "inspect":
        return _inspect(args.file, args.json)
    if args.command == "verify":
        return _verify(args.file, args.json)
    if args.command == "diff":
        return _diff(args.a, args.b, args.json)
    if args.command == "convert":
        return _convert(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _message(e: BaseException, *, lines: bool = False) -> str:
    """An error message for the terminal, escaped to one line; with `lines` (a message
    that lists its reasons one a line) each line escaped and every line after the first
    indented, so no line of it can pass for one of the CLI's own."""
    if not lines:
        return _printable(str(e))
    return "\n    ".join(_printable(line) for line in str(e).split("\n"))


def _regular_file(path: str, *, checkpoint: bool = True) -> None:
    """Refuse, before opening it, anything but a regular file or a directory (or a link to
    one): a FIFO would block the read forever, a device never end. A directory given as a
    `checkpoint` is left to `read_file` (one of a directory format, such as Orbax's, or
    refused there). Raises `FileMissingError` for a missing path or another directory,
    `RecorderError` for the rest. A store URL is left to `read_file` (its store says)."""
    if is_url(path):
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError as e:
        raise FileMissingError("no such file", source=path) from e
    except (OSError, ValueError) as e:
        raise RecorderError(f"cannot read: {e}", source=path) from e
    if stat.S_ISDIR(mode):
        if checkpoint:
            return  # a checkpoint of a directory format (Orbax), or refused by read_file
        raise FileMissingError("a directory, not a file", source=path)
    if not stat.S_ISREG(mode):
        raise RecorderError("not a regular file (a FIFO, device or socket): refused", source=path)


def _demo_backend(value: str) -> str:
    """A bundled backend, or `module:attr` naming a `Workload` in an importable module."""
    if value in ("auto", "torch", "jax", "numpy"):
        return value
    module, sep, attr = value.partition(":")
    if not (sep and module and attr.isidentifier()):
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected auto, torch, jax, numpy or module:attr (a trainrec Workload)")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise argparse.ArgumentTypeError(f"{value!r}: no module named {module!r}")
    return value


_WORKLOAD_PARTS = ("state_type", "build", "micro_step", "apply_window")


def _harness_problem(value: str) -> str:
    """Why `module:attr` names no workload (one line), or "" when it does: the demo's
    processes then start from a harness that loads, not into a traceback in each."""
    from ..workload.loop import load_workload

    try:
        workload = load_workload(value)
    except Exception as e:  # the user's module: any error while importing it or its attr
        return _printable(f"{type(e).__name__}: {e}")
    missing = [name for name in _WORKLOAD_PARTS if not hasattr(workload, name)]
    if missing:
        return (f"{type(workload).__name__} is not a trainrec Workload (it has no "
                f"{', '.join(missing)})")
    return ""


def _tree_leaf(path: str, leaf: Any) -> Any:
    if isinstance(leaf, TensorData):
        return {"dtype": leaf.dtype.value, "shape": list(leaf.shape), "bytes": leaf.nbytes}
    if isinstance(leaf, bytes):
        return f"<{len(leaf)} bytes>"
    return leaf


def _tree(item: Item) -> Any:
    return map_leaves(item, _tree_leaf)


def _print_tree(node: Any, indent: str, out: list[str]) -> None:
    entries = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in entries:
        if isinstance(v, dict) and set(v) == {"dtype", "shape", "bytes"}:
            out.append(f"{indent}{_printable(str(k))}: {v['dtype']}{v['shape']} {v['bytes']} B")
        elif isinstance(v, (dict, list)) and v:
            out.append(f"{indent}{_printable(str(k))}:")
            _print_tree(v, indent + "  ", out)
        else:
            out.append(f"{indent}{_printable(str(k))}: {v!r}")


_COMPONENTS = ("model", "optimizer", "scheduler", "grads", "state")


def _inspect(path: str, as_json: bool) -> int:
    from ..recorders.read import read_file

    try:
        _regular_file(path)
        header, item = read_file(path, mmap=True)
    except RecorderError as e:
        print(f"trainrec inspect: {_message(e)}", file=sys.stderr)
        return 3
    tree = _tree(item)
    if header.record_type == "TrainingRecord" and isinstance(tree, list) and len(tree) == 5:
        tree = dict(zip(_COMPONENTS, tree))
    s = header.settings
    info = {
        "file": path,
        "format": header.format,
        "version": f"{header.version[0]}.{header.version[1]}",
        "written_by": header.trainrec_version,
        "precision": {"name": s.name,
                      "float": None if s.float_dtype is None else s.float_dtype.value,
                      "int": None if s.int_dtype is None else s.int_dtype.value},
        "record": header.record_type,
        "tree": tree,
    }
    if as_json:
        print(json.dumps(info, indent=2))
        return 0
    lines = [f"{k}: {v}" for k, v in info.items() if k != "tree"]
    lines.append("tree:")
    if isinstance(tree, (dict, list)):
        _print_tree(tree, "  ", lines)
    else:
        lines.append(f"  {tree!r}")
    print("\n".join(map(_printable, lines)))
    return 0


def _verify(path: str, as_json: bool) -> int:
    from ..items.tree import iter_tensors
    from ..recorders.read import read_file

    if is_url(path) and (steps := _committed_steps(path)):
        return max(_verify(f"{path.rstrip('/')}/{name}", as_json) for _, name in steps)

    count = total = 0
    try:
        _regular_file(path)
        header, item = read_file(path, mmap=True)
        for _, t in iter_tensors(item):
            t.array  # noqa: B018 - reading checks the checksum
            count += 1
            total += t.nbytes
    except RecorderError as e:
        corrupt = isinstance(e, CorruptRecordError)  # else unreadable: missing, a directory, I/O
        if as_json:
            print(json.dumps({"file": path, "ok": False, "error": str(e)}))
        else:
            print(f"{'CORRUPT' if corrupt else 'UNREADABLE'}: {_message(e)}")
        return 1 if corrupt else 3
    from ..recorders.formats import format_named

    fmt = format_named(header.format)
    checked = fmt.verified if fmt else "nothing: this format carries no checksums (parsed only)"
    # a directory format's own entries (DCP's shard entries), checked beside its tensors
    entries = fmt.entries(item) if fmt is not None and fmt.entries is not None else None
    if as_json:
        extra = {} if entries is None else {"entries": entries[1], "entry_bytes": entries[2]}
        print(json.dumps({"file": path, "ok": True, "tensors": count, "bytes": total, **extra,
                          "verified": checked}))
    else:
        what = "" if entries is None else f"{entries[1]} {entries[0]} ({entries[2]} bytes) and "
        print(_printable(f"OK: {path}: {what}{count} tensors ({total} bytes); verified: {checked}"))
    return 0


def _committed_steps(url: str) -> list[tuple[int, str]]:
    """The committed steps of a manager's folder at `url` (none for an object's URL):
    `verify` checks each."""
    from ..recorders.remote import committed
    from ..storage.location import object_size

    try:
        object_size(url)
        return []
    except RecorderError:
        pass
    try:
        return committed(url)
    except RecorderError:
        return []


def _diff(a: str, b: str, as_json: bool) -> int:
    import numpy as np

    from ..items.tree import iter_tensors
    from ..recorders.read import read_file

    try:
        _regular_file(a)
        _regular_file(b)
        (ha, ia), (hb, ib) = read_file(a), read_file(b)
    except RecorderError as e:
        print(f"trainrec diff: {_message(e)}", file=sys.stderr)
        return 3
    name = _part_names(ha.record_type, ia) if ha.record_type == hb.record_type else _raw_path
    ta = {name(k): t for k, t in iter_tensors(ia)}
    tb = {name(k): t for k, t in iter_tensors(ib)}
    rows = []
    for key in sorted(set(ta) | set(tb)):
        x, y = ta.get(key), tb.get(key)
        if x is None or y is None:
            rows.append({"key": key, "status": "only in " + ("b" if x is None else "a")})
            continue
        if x.shape != y.shape:
            rows.append({"key": key, "status": f"shape {list(x.shape)} vs {list(y.shape)}"})
            continue
        equal = x.dtype is y.dtype and x.to_bytes() == y.to_bytes()
        row: dict[str, Any] = {"key": key, "status": "equal" if equal else "differs",
                               "dtype": [x.dtype.value, y.dtype.value]}
        if not equal and x.numel and x.dtype.value != "bool" and y.dtype.value != "bool":
            fx, fy = x.array.astype(np.float64), y.array.astype(np.float64)
            diff = np.abs(fx - fy)
            row["max_abs"] = float(np.nanmax(diff))
            row["max_rel"] = float(np.nanmax(diff / np.maximum(np.abs(fx), 1e-30)))
        rows.append(row)
    others = ["record"] if ha.record_type != hb.record_type else []
    same = sum(r["status"] == "equal" for r in rows)
    scalars = _scalar_differences(ia, ib, name)
    result = {"a": a, "b": b, "tensors": len(rows), "bitwise_equal": same,
              "scalars_equal": not scalars, "scalars": scalars,
              "rows": [r for r in rows if r["status"] != "equal"], "headers_differ": others}
    identical = same == len(rows) and not scalars
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for r in result["rows"]:
            extra = (f"  max abs {r['max_abs']:.3g}  max rel {r['max_rel']:.3g}" if "max_abs" in r else "")
            print(_printable(f"{r['key']}: {r['status']}{extra}"))
        for d in scalars:
            print(_printable(f"{d['key']}: {d['a']} in a, {d['b']} in b"))
        print(f"{same} of {len(rows)} tensors bitwise equal; "
              + ("scalars equal" if not scalars else f"{len(scalars)} scalar{'s' * (len(scalars) > 1)} differ"))
    return 0 if identical else 1


# a TrainingRecord item is [model, optimizer, scheduler, pending, state] (spec/FORMAT.md):
# its paths are printed by part name, a component's {kind, state} and a pending
# gradient's {dtype, value} left out
_PARTS = ("model", "optimizer", "scheduler", "pending", "state")


def _raw_path(path: str) -> str:
    return path


def _part_names(record_type: str, item: Item) -> Any:
    """How `diff` names a key path of a record of `record_type`: a TrainingRecord's by its
    parts (`pending.fc1.bias`, `optimizer.state.fc1.bias.exp_avg`), others as they are."""
    if record_type != "TrainingRecord" or not isinstance(item, list) or len(item) != len(_PARTS):
        return _raw_path

    def name(path: str) -> str:
        head, _, rest = path.partition(".")
        if not head.isdigit() or int(head) >= len(_PARTS):
            return path
        part = _PARTS[int(head)]
        if part in ("model", "optimizer", "scheduler"):
            rest = rest[len("state."):] if rest.startswith("state.") else "" if rest == "state" else rest
        elif part == "pending" and rest.endswith(".value"):
            rest = rest[: -len(".value")]
        return f"{part}.{rest}" if rest else part

    return name


def _scalar_differences(a: Item, b: Item, name: Any, prefix: str = "") -> list[dict[str, str]]:
    """Each scalar (every leaf but a tensor) that differs between the two items, and each
    place where their structure does, by key path, with both values as Python writes them
    (a tensor only one side has is a tensor row, not repeated here)."""
    from ..items.tree import join_key, walk_pairs

    out: list[dict[str, str]] = []
    for path, x, y in walk_pairs(a, b, prefix):
        if isinstance(x, TensorData) and isinstance(y, TensorData):
            continue  # the tensor rows
        if isinstance(x, dict) and isinstance(y, dict):  # other keys: compare what both have
            for k in x.keys() | y.keys():
                if k in x and k in y:
                    out.extend(_scalar_differences(x[k], y[k], name, join_key(path, k)))
                elif not _has_tensors(x.get(k, y.get(k))):
                    out.append({"key": name(join_key(path, k)),
                                "a": _short(x[k]) if k in x else "absent", "b": _short(y[k]) if k in y else "absent"})
        elif type(x) is not type(y) or repr(x) != repr(y):
            if not (_has_tensors(x) and _has_tensors(y)):  # lists of tensors of another length: the rows
                out.append({"key": name(path) if path else "(root)", "a": _short(x), "b": _short(y)})
    return sorted(out, key=lambda d: d["key"])


def _has_tensors(item: Any) -> bool:
    from ..items.tree import iter_tensors

    return isinstance(item, TensorData) or (isinstance(item, (dict, list)) and next(iter_tensors(item), None) is not None)


def _short(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else (
        f"a map of {len(value)}" if isinstance(value, dict) else f"a list of {len(value)}")
    return text if len(text) <= 80 else text[:77] + "..."


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
