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

This module holds `main` and the argument parser; each command lives in its own module
beside it (`inspect_cmd`, `verify_cmd`, `diff_cmd`, `convert_cmd`, with what they share in
`shared`), and every name importable from here before the split still is.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

from ..errors import CorruptRecordError, FileMissingError, RecorderError  # noqa: F401
from ..items.tensor import TensorData  # noqa: F401
from ..items.tree import Item, map_leaves  # noqa: F401
from ..storage.location import is_url  # noqa: F401
from .convert_cmd import (  # noqa: F401
    _FLAGS,
    _burn_template,
    _cli_spelling,
    _convert,
    _convertible,
    _progress,
    _recorder_for,
    _training,
)
from .diff_cmd import (  # noqa: F401
    _PARTS,
    _diff,
    _has_tensors,
    _part_names,
    _raw_path,
    _scalar_differences,
    _short,
)
from .inspect_cmd import (  # noqa: F401
    _COMPONENTS,
    _inspect,
    _print_tree,
    _tree,
    _tree_leaf,
)
from .shared import (  # noqa: F401
    _message,
    _regular_file,
)
from .terminal import printable as _printable
from .verify_cmd import (  # noqa: F401
    _committed_steps,
    _verify,
)

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

    ver = sub.add_parser("verify", help="check every checksum of a record file (exit 1 on corruption, 3 when unreadable)")
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
