"""Hugging Face Transformers: a `Trainer` stopped by SIGTERM at any micro-step, inside a
gradient-accumulation window too, resumes bitwise with `trainer.train(resume_from_checkpoint=True)`.

    trainer = Trainer(model=model, args=args, train_dataset=data, ...)
    ExactResume.attach(trainer)                       # the one line added to a script
    trainer.train(resume_from_checkpoint=True)        # or None on the first run

Trainer saves at step boundaries only (`save_steps`), and what it saves loses the window in
progress: the `.grad` summed so far, where the window stands, the batches it fetched ahead.
On SIGTERM (what schedulers and spot VMs send before they kill) the process dies with
nothing saved since the last step checkpoint, or, with `enable_jit_checkpoint=True`,
Trainer saves at its next step hook into `checkpoint-<global_step>`, over the complete step
checkpoint, without the pending gradients and with a later RNG.

With `ExactResume` attached, a SIGTERM only sets a flag. After the micro-step in progress
(or, when it ended a window, after the optimizer step and the log / evaluation / step
checkpoint Trainer makes there, which the uninterrupted run makes too), every process saves
`exact-checkpoint-<global_step>-<micro>` in the output directory, committed whole (a temp
directory renamed into place once every rank's part is durable): Trainer's own files
(model under `model/`, optimizer, scheduler, GradScaler, `trainer_state.json`) written by
Trainer's own methods, and per rank the pending `.grad`, the micro-step within the window,
the rest of the window's batches and its token count, the RNG states (now and at the start
of the epoch), the loss not yet logged. Then `train()` raises `SystemExit(128 + signal)`
(143 for SIGTERM): the user's code after `train()` (a `save_model`) does not run on a
half-trained model. Trainer's `checkpoint-N` folders are never touched. A save that
fails (a rank could not write its part) raises its error from `train()` on every rank,
having committed nothing; earlier checkpoints are untouched.

`train(resume_from_checkpoint=True)` takes the newest checkpoint of either kind (an exact
one at step N micro-step k is newer than `checkpoint-N`), `resume_from_checkpoint=PATH`
either kind by name. An exact checkpoint is checked before anything loads (another
gradient_accumulation_steps, world size, per-device batch size, seed, data seed or dataset
length is refused, each named with the fix, the model untouched); then Trainer loads model,
optimizer, scheduler, scaler and state as from its own checkpoints, and `ExactResume`
positions the data after the saved micro-step, puts the pending `.grad`, the window's rest
and the RNG states back, so that exactly the remaining micro-steps run and the result is
bitwise the uninterrupted run's. Trainer's own checkpoints resume as Trainer resumes them.

DDP (one process per device, `torchrun`): the flag is agreed across ranks after every
micro-step (one 1-element all-reduce), so all ranks save at the same micro-step, each its
own pending gradients, batches and RNG. The same world size is needed to resume.

`ExactResume.attach` refuses, with `ValueError`, what it cannot make exact: Trainer's
`enable_jit_checkpoint` (refused, not replaced: its handler would overwrite step
checkpoints), DeepSpeed, FSDP, DataParallel (`n_gpu > 1`), model parallelism,
`auto_find_batch_size`, `ignore_data_skip`, a train dataset without `__len__`.

It reaches into Trainer's internals (spec/PROTOCOLS.md, "Hugging Face Trainer", lists
them), which is why the extra `trainrec[transformers]` bounds the version
(`transformers>=5.12,<6`: 5.12 split the training loop into the methods used here).
Importing this module imports transformers.

The module is one idea, `ExactResume` (one Trainer callback and the Trainer methods it
wraps, which share its state), and so longer than most; the checkpoints it finds in
`output_dir` are `trainer_checkpoints.py`'s, what it refuses `trainer_refusals.py`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

try:
    import transformers
except ImportError as e:  # pragma: no cover - the message is tested with transformers hidden
    raise ImportError("trainrec.adapters.torch.transformers needs transformers, which is not "
                      "installed: pip install 'trainrec[transformers]'", name=e.name) from e

from transformers.trainer_callback import ExportableState, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

import trainrec
from trainrec import (
    CorruptRecordError,
    NamedMpkFileRecorder,
    NativePrecisionSettings,
    RecordMismatchError,
)

from .distributed_collectives import _broadcast, _rank_world, agree
from .distributed_commit import _Commit
from .distributed_manifest import _part_name, _read_part, read_manifest
from .pending import Pending, pack, unpack
from .rng import TorchRngRecord
from .trainer_checkpoints import FORMAT, _free_name, _is_exact, checkpoints
from .trainer_refusals import _batch, _length, _refuse_unsupported

__all__ = ["ExactResume", "FORMAT", "checkpoints"]

VERSION = (1, 0)
_PART = "trainrec.transformers.part"
_MODEL_DIR = "model"
_TRAINER_STATE = "trainer_state.json"
_SUFFIX = ".mpk"
# the Trainer methods ExactResume wraps (spec/PROTOCOLS.md, "Hugging Face Trainer")
_WRAPPED = ("train", "_load_from_checkpoint", "set_initial_training_values",
            "_init_training_state", "get_batch_samples", "training_step", "_load_rng_state",
            "_maybe_log_save_evaluate")
_NATIVE = NativePrecisionSettings()
_SOURCE = "exact Trainer checkpoint (trainrec ExactResume)"
# what must be the same to go on exactly: the manifest's name, TrainingArguments' name
_SAME = ("gradient_accumulation_steps", "world_size", "per_device_train_batch_size", "seed",
         "data_seed")
_COUNTERS = ("global_step", "epoch", "micro", "window", "steps_in_epoch", "globalstep_last_logged",
             "rank", "world_size")


@trainrec.record
class _Position:
    """What a rank needs, besides Trainer's own files, to go on from the saved micro-step:
    the RNG at the start of the epoch in progress, the batches of the window not yet
    trained on (the window was fetched whole, ahead) and its token count (Trainer divides
    each micro-step's loss by the whole window's), the loss summed since the last log."""

    epoch_rng: TorchRngRecord
    batches: list[dict[str, torch.Tensor]]
    num_items: torch.Tensor | None
    num_items_int: int | None
    tr_loss: torch.Tensor


@dataclasses.dataclass
class _Resume:
    """A checked exact checkpoint being resumed from (this rank's part)."""

    path: Path
    pending: Pending
    position: _Position
    counters: dict[str, int]
    rng_applied: bool = False
    window_served: bool = False
    window_left: int = 0


class ExactResume(TrainerCallback):
    """Make a `transformers.Trainer` stop on SIGTERM with an exact checkpoint at any
    micro-step, and resume from one bitwise: `ExactResume.attach(trainer)` (see the module
    docstring). Passing `ExactResume()` in `Trainer(callbacks=[...])` instead is refused
    (a callback is never told its Trainer)."""

    exit_code: int | None = None
    """`128 + signal` once a signal stopped the run (the `SystemExit` code), else None."""

    def __init__(self) -> None:
        self._trainer: Any = None
        self._signals: tuple[int, ...] = ()
        self._signalled: int | None = None
        self._previous: dict[int, Any] = {}
        self._resume: _Resume | None = None
        self._window: tuple[list[Any], Any] = ([], None)
        self._done = 0  # micro-steps of the window in progress done
        self._epoch_rng: TorchRngRecord | None = None
        self._epoch_ended = False
        self._batches_checked = False
        self._loop: tuple[int, int, int] = (0, 0, 0)  # steps_in_epoch, updates an epoch, max_steps
        self.exit_code = None
        self.saved: Path | None = None
        """The exact checkpoint this run saved on a signal, once committed."""

    # -- attaching ------------------------------------------------------------------------

    @classmethod
    def attach(cls, trainer: Any, *, signals: Sequence[int] = (signal.SIGTERM,)) -> ExactResume:
        """Attach a new `ExactResume` to `trainer` and return it. During `trainer.train()`
        each of `signals` (default SIGTERM) stops the run with an exact checkpoint.

        Raises `TypeError` for what is not a `transformers.Trainer`, `ValueError` for one
        it is already attached to or cannot make exact (module docstring), naming the fix."""
        if not isinstance(trainer, transformers.Trainer):
            raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
        if any(isinstance(cb, ExactResume) for cb in trainer.callback_handler.callbacks):
            raise ValueError("this Trainer already has an ExactResume attached")
        signals = tuple(signals)
        if not signals or not all(isinstance(s, int) for s in signals):
            raise TypeError("signals must be a non-empty sequence of signal numbers")
        _refuse_unsupported(trainer)
        exact = cls()
        exact._trainer = trainer
        exact._signals = signals
        trainer.add_callback(exact)
        for name in _WRAPPED:  # on the instance: a subclass's overrides are what is wrapped
            original = getattr(trainer, name)
            wrapper = getattr(exact, "_wrap_" + name.lstrip("_"))
            setattr(trainer, name, functools.wraps(original)(functools.partial(wrapper, original)))
        return exact

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        raise ValueError("ExactResume is attached with ExactResume.attach(trainer), after the "
                         "Trainer is made, not through Trainer(callbacks=[...]): a callback is "
                         "never given its Trainer")

    # -- train(): which checkpoint, checked before anything loads; the signal handlers ----

    def _wrap_train(self, original: Callable[..., Any], resume_from_checkpoint: Any = None,
                    trial: Any = None, ignore_keys_for_eval: Any = None, **kwargs: Any) -> Any:
        trainer = self._trainer
        if trial is not None:
            raise ValueError("ExactResume does not support hyperparameter search (trial=...)")
        _refuse_unsupported(trainer)
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("ExactResume installs signal handlers, which Python allows only in "
                             "the main thread: call trainer.train() from the main thread")
        path = self._choose(resume_from_checkpoint)
        self._resume = None if path is None or not _is_exact(path) else self._check(path)
        self._signalled, self.exit_code, self.saved = None, None, None
        self._epoch_rng, self._epoch_ended, self._done = None, False, 0
        self._batches_checked = False
        self._install()
        try:
            return original(resume_from_checkpoint=None if path is None else str(path),
                            trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._uninstall()
            self._resume = None
            self._window = ([], None)

    def _choose(self, resume: Any) -> Path | None:
        """The checkpoint to resume from: `resume` as Trainer takes it, True meaning the
        newest of either kind (rank 0's choice, on every rank)."""
        if resume is None or resume is False:
            return None
        if resume is not True:
            return Path(resume)
        out = self._trainer.args.output_dir
        if not os.path.isdir(out):
            get_last_checkpoint(out)  # Trainer's own error
        found = checkpoints(out)
        choice = [str(found[-1][1]) if found else None]
        _broadcast(choice, None)
        if choice[0] is None:
            raise ValueError(f"No valid checkpoint found in output directory ({out})")
        return Path(choice[0])

    def _check(self, path: Path) -> _Resume:
        """Read and check the exact checkpoint `path` against this run (collective with
        several ranks: when one rank's check fails, every rank raises). Nothing is loaded."""
        failure: Exception | None = None
        resume: _Resume | None = None
        try:
            resume = self._read(path)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, then it is raised
            failure = e
        if _rank_world(None)[1] > 1:
            agree(failure, None, str(path))
        elif failure is not None:
            raise failure
        assert resume is not None
        return resume

    def _read(self, path: Path) -> _Resume:
        trainer = self._trainer
        args = trainer.args
        manifest = read_manifest(path, FORMAT, VERSION, "ExactResume", lambda doc: {
            **{k: type(doc.get(k)) is int for k in ("global_step", "micro", *_SAME[:4])},
            "data_seed": doc.get("data_seed") is None or type(doc.get("data_seed")) is int,
            "train_dataset_length": doc.get("train_dataset_length") is None
            or type(doc.get("train_dataset_length")) is int,
        })
        live = {"gradient_accumulation_steps": args.gradient_accumulation_steps,
                "world_size": args.world_size,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "seed": args.seed, "data_seed": args.data_seed}
        why = {
            "gradient_accumulation_steps": "the pending gradients are a part of a window of that "
            "many micro-steps (each loss divided by the whole window's token count)",
            "world_size": "each rank's pending gradients, batches and RNG are its own, and no rule "
            "maps them onto another number of ranks",
            "per_device_train_batch_size": "the saved batches and the data position are counted "
            "in batches of that size",
            "seed": "the data order (and any model_init) derives from it",
            "data_seed": "the data order derives from it",
        }
        problems = [f"{k}={manifest[k]!r} in the checkpoint, {live[k]!r} here ({why[k]}): "
                    f"resume with " + (f"torchrun --nproc-per-node {manifest[k]}" if k == "world_size"
                                       else f"TrainingArguments({k}={manifest[k]!r})")
                    for k in _SAME if manifest[k] != live[k]]
        length = _length(trainer.train_dataset)
        if manifest["train_dataset_length"] != length:
            problems.append(f"the train dataset had {manifest['train_dataset_length']} samples, "
                            f"this one has {length}: the saved data position counts in it; "
                            "resume with the same train_dataset")
        if problems:
            raise RecordMismatchError(f"{_SOURCE} {path} cannot continue this run exactly: "
                                      + "; ".join(problems), source=str(path))
        rank, world = _rank_world(None)
        file = path / manifest["parts"][rank]
        _, item = _read_part(file, _PART, False)
        if item.get("save_id") != manifest["save_id"]:
            raise CorruptRecordError(f"save_id is {item.get('save_id')!r}, the manifest says "
                                     f"{manifest['save_id']!r} (a part of another save)",
                                     source=str(file))
        pending = unpack(item, trainer.model, _Position, _COUNTERS, source=f"{_SOURCE} {file}",
                         rng=True)
        counters = pending.counters
        for key, want in {"rank": rank, "world_size": world, "global_step": manifest["global_step"],
                          "micro": manifest["micro"]}.items():
            if counters[key] != want:
                raise CorruptRecordError(f"{key} is {counters[key]}, the manifest says {want} (a "
                                         "part of another save, or of another rank)", source=str(file))
        state = json.loads((path / _TRAINER_STATE).read_text(encoding="utf-8"))
        if state.get("global_step") != counters["global_step"]:
            raise CorruptRecordError(f"{_TRAINER_STATE} says global step {state.get('global_step')},"
                                     f" the parts {counters['global_step']}", source=str(path))
        position = pending.state
        assert isinstance(position, _Position) and pending.rng is not None
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(pending.rng.cuda) != cuda or len(position.epoch_rng.cuda) != cuda:
            raise RecordMismatchError(f"{_SOURCE} {file} holds the RNG states of "
                                      f"{len(pending.rng.cuda)} CUDA devices, this machine has "
                                      f"{cuda}: resume on a machine like the one it was saved on",
                                      source=str(file))
        if counters["micro"] and len(position.batches) != counters["window"] - counters["micro"]:
            raise CorruptRecordError(f"holds {len(position.batches)} batches of the window, "
                                     f"{counters['window'] - counters['micro']} were left",
                                     source=str(file))
        return _Resume(path, pending, position, counters)

    def _install(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            if self._signalled is not None:  # a second one: what was there before
                old = self._previous.get(signum)
                signal.signal(signum, signal.SIG_DFL if old is None else old)
                signal.raise_signal(signum)
                return
            self._signalled = signum

        self._previous = {}
        for s in self._signals:
            self._previous[s] = signal.signal(s, handler)

    def _uninstall(self) -> None:
        for s, old in self._previous.items():
            signal.signal(s, signal.SIG_DFL if old is None else old)
        self._previous = {}

    # -- resuming: Trainer's loading, its data skipping, the window, the RNG ---------------

    def _wrap_load_from_checkpoint(self, original: Callable[..., Any], resume_from_checkpoint: str,
                                   model: Any = None) -> Any:
        if self._resume is not None and Path(resume_from_checkpoint) == self._resume.path:
            resume_from_checkpoint = str(self._resume.path / _MODEL_DIR)
        return original(resume_from_checkpoint, model)

    def _wrap_set_initial_training_values(self, original: Callable[..., Any], args: Any,
                                          dataloader: Any) -> Any:
        values = original(args, dataloader)
        steps_in_epoch, max_steps = values[5], values[6]
        self._loop = (steps_in_epoch, values[1], max_steps)
        resume = self._resume
        if resume is not None and resume.counters["steps_in_epoch"] != steps_in_epoch:
            raise RecordMismatchError(
                f"{_SOURCE} {resume.path} was saved with {resume.counters['steps_in_epoch']} "
                f"batches an epoch, this run has {steps_in_epoch}: resume with the same data "
                "and dataloader settings (dataloader_drop_last)", source=str(resume.path))
        return values

    def _wrap_init_training_state(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        epochs_trained, steps_trained = original(*a, **kw)
        resume = self._resume
        if resume is not None:
            c = resume.counters
            if self._trainer.state.global_step != c["global_step"] or epochs_trained != c["epoch"]:
                raise CorruptRecordError(
                    f"Trainer resumed at epoch {epochs_trained}, global step "
                    f"{self._trainer.state.global_step}, the checkpoint's parts were saved at "
                    f"epoch {c['epoch']}, global step {c['global_step']}", source=str(resume.path))
            steps_trained += c["micro"]  # Trainer skips to the window's start; we past its done part
        return epochs_trained, steps_trained

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After Trainer loaded the checkpoint and zeroed `.grad`: the pending gradients
        and the loss not yet logged go back."""
        resume = self._resume
        if resume is None:
            return
        trainer = self._trainer
        resume.pending.apply(trainer.model)
        trainer._tr_loss = resume.position.tr_loss.to(trainer._tr_loss.device)
        trainer._globalstep_last_logged = resume.counters["globalstep_last_logged"]
        if self._at_epoch_start(resume):  # applied again at the epoch's start: no epoch may follow
            assert resume.pending.rng is not None
            resume.pending.rng.apply()

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Before the epoch's iterator is made (it draws from the RNG: the base seed of the
        loader's workers, a sampler's order): the RNG as it was at the start of the epoch
        the checkpoint was saved in (a resume) or recorded (every epoch)."""
        self._epoch_ended = False
        resume = self._resume
        if resume is not None and not resume.rng_applied:
            if self._at_epoch_start(resume):  # saved after an epoch's end: its RNG is this one's
                assert resume.pending.rng is not None
                resume.pending.rng.apply()
                resume.rng_applied = True
            else:
                resume.position.epoch_rng.apply()
        self._epoch_rng = TorchRngRecord.capture()

    def _at_epoch_start(self, resume: _Resume) -> bool:
        """Whether `resume` goes on at the start of an epoch (saved after an epoch's end, or
        at the end of training)."""
        per_epoch = self._loop[1]
        return resume.counters["micro"] == 0 and resume.counters["global_step"] % max(per_epoch, 1) == 0

    def _wrap_load_rng_state(self, original: Callable[..., Any], checkpoint: Any) -> Any:
        if self._resume is None:
            return original(checkpoint)
        return None  # the exact checkpoint's RNG goes back around the first fetch

    def _wrap_get_batch_samples(self, original: Callable[..., Any], epoch_iterator: Any,
                                num_batches: int, device: Any) -> Any:
        resume = self._resume
        if resume is not None and not resume.window_served:
            resume.window_served = True
            micro = resume.counters["micro"]
            if micro:
                return self._rest_of_window(original, epoch_iterator, num_batches, device)
        batches, num_items = original(epoch_iterator, num_batches, device)
        if not self._batches_checked and batches:  # refused now, not at a signal's save
            _batch(batches[0], 0)
            self._batches_checked = True
        if resume is not None and not resume.rng_applied:
            # saved between two windows: the RNG of the save once the next one is fetched (the
            # epoch's first fetch makes the loader's iterator, which draws its base seed: the
            # uninterrupted run drew it at that fetch too, from the epoch's start state)
            assert resume.pending.rng is not None
            resume.pending.rng.apply()
            resume.rng_applied = True
        self._window = (batches, num_items)
        self._done = 0
        return batches, num_items

    def _rest_of_window(self, original: Callable[..., Any], epoch_iterator: Any, num_batches: int,
                        device: Any) -> Any:
        resume = self._resume
        assert resume is not None
        c = resume.counters
        if num_batches != c["window"]:
            raise RecordMismatchError(
                f"{_SOURCE} {resume.path} was saved in a window of {c['window']} batches, this run "
                f"fetches {num_batches} there: resume with the same data and "
                "gradient_accumulation_steps", source=str(resume.path))
        # the data iterator goes past the window's rest (Trainer skipped its done part), and
        # the window's rest is what the uninterrupted run had fetched
        fetched, _ = original(epoch_iterator, num_batches - c["micro"], device)
        if len(fetched) != len(resume.position.batches):
            raise RecordMismatchError(f"{_SOURCE} {resume.path}: the data ended "
                                      f"{len(resume.position.batches) - len(fetched)} batches "
                                      "early in the saved window", source=str(resume.path))
        batches = [{k: v.to(device) for k, v in b.items()} for b in resume.position.batches]
        pos = resume.position
        num_items = (pos.num_items.to(device) if pos.num_items is not None else pos.num_items_int)
        assert resume.pending.rng is not None
        resume.pending.rng.apply()  # the RNG after the saved micro-step
        resume.rng_applied = True
        resume.window_left = len(batches)
        self._window = ([None] * c["micro"] + batches, num_items)  # indexed as the whole window
        self._done = c["micro"]
        return batches, num_items

    def _wrap_training_step(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        resume = self._resume
        if resume is not None and resume.window_left:
            # Trainer set it to the number of batches fetched; the window had more
            self._trainer.current_gradient_accumulation_steps = resume.counters["window"]
            resume.window_left -= 1
        return original(*a, **kw)

    # -- stopping: after each micro-step, after each optimizer step's log/eval/save --------

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._done += 1
        if self._stop_agreed():
            self._save_and_exit()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._done = 0
        self._window = ([], None)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._epoch_ended = True

    def _wrap_maybe_log_save_evaluate(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        out = original(*a, **kw)
        step = self._trainer.state.global_step
        steps_in_epoch, per_epoch, max_steps = self._loop
        # an epoch's last step: its end (callbacks, epoch evaluation and save) comes first,
        # since a resume starts the next epoch; the last step: train() ends first
        end_of_epoch = per_epoch > 0 and step % per_epoch == 0 and not self._epoch_ended
        if step >= max_steps or end_of_epoch or self._done:
            return out
        if self._stop_agreed():
            self._save_and_exit()
        return out

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stop_agreed():
            self._save_and_exit()

    def _stop_agreed(self) -> bool:
        """Whether a signal arrived on any rank (collective with several ranks, called at
        the same points on every rank)."""
        flag = self._signalled is not None
        if _rank_world(None)[1] == 1:
            return flag
        backend = str(dist.get_backend())
        device = self._trainer.args.device if "nccl" in backend else torch.device("cpu")
        t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    # -- the save ---------------------------------------------------------------------------

    def _save_and_exit(self) -> None:
        signum = self._signalled if self._signalled is not None else self._signals[0]
        self.saved = self._save()
        self.exit_code = 128 + int(signum)
        raise SystemExit(self.exit_code)

    def _save(self) -> Path:
        """Commit an exact checkpoint of the run as it stands (collective: every rank, at
        the same point; called on a signal) and return its path. Raises `RecorderError` on
        every rank when a rank could not write its part; nothing is committed then."""
        trainer = self._trainer
        args = trainer.args
        rank, world = _rank_world(None)
        step = int(trainer.state.global_step)
        micro = self._done
        root = Path(trainer._get_output_dir(trial=None))
        name: list[str | None] = [None]
        if rank == 0:
            name[0] = _free_name(root, step, micro)
        _broadcast(name, None)
        path = root / str(name[0])
        commit = _Commit(path, rank, world, None)
        if rank == 0:
            commit.prepare()
        commit.begin(None)
        try:
            trainer.store_flos()  # collective with several ranks, as in Trainer's own save
            self._write_trainer_files(commit.temp)
            part = {**self._part(step, micro, rank, world), "save_id": commit.token}
            NamedMpkFileRecorder(_NATIVE).save_item(
                part, commit.temp / _part_name(rank, world, _SUFFIX), _PART)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it, then it is raised
            commit.fail(e)
        else:
            commit.wrote([step, micro])
        manifest = {
            "format": FORMAT, "version": list(VERSION), "trainrec": trainrec.__version__,
            "transformers": transformers.__version__, "world_size": world,
            "save_id": commit.token, "parts": [_part_name(r, world, _SUFFIX) for r in range(world)],
            "global_step": step, "micro": micro,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "seed": args.seed, "data_seed": args.data_seed,
            "train_dataset_length": _length(trainer.train_dataset),
            "resume": "trainer.train(resume_from_checkpoint=True) with "
                      "trainrec.adapters.torch.transformers.ExactResume.attach(trainer)",
        }
        commit.finish(manifest, "positions")
        return path

    def _write_trainer_files(self, temp: Path) -> None:
        """What Trainer's `_save_checkpoint` writes, by its own methods, except the RNG
        (this rank's part holds it) and with the model under `model/` (a Trainer resuming
        without ExactResume finds no weights and refuses the folder)."""
        trainer = self._trainer
        trainer.save_model(str(temp / _MODEL_DIR), _internal_call=True)
        trainer._save_optimizer_and_scheduler(str(temp))
        trainer._save_scaler(str(temp))
        if trainer.args.should_save:
            state = copy.deepcopy(trainer.state)
            for cb in trainer.callback_handler.callbacks + [trainer.control]:
                if isinstance(cb, ExportableState):
                    name, cb_state = cb.__class__.__name__, cb.state()
                    if isinstance(state.stateful_callbacks.get(name), list):
                        state.stateful_callbacks[name].append(cb_state)
                    else:
                        state.stateful_callbacks[name] = cb_state
            state.save_to_json(str(temp / _TRAINER_STATE))

    def _part(self, step: int, micro: int, rank: int, world: int) -> dict[str, Any]:
        trainer = self._trainer
        batches, num_items = self._window
        rest = [_batch(b, i) for i, b in enumerate(batches[micro:])] if micro else []
        epoch_rng = self._epoch_rng if self._epoch_rng is not None else TorchRngRecord.capture()
        position = _Position(
            epoch_rng=epoch_rng, batches=rest,
            num_items=num_items.detach() if isinstance(num_items, torch.Tensor) else None,
            num_items_int=num_items if isinstance(num_items, int) else None,
            tr_loss=trainer._tr_loss.detach())
        steps_in_epoch, per_epoch, _ = self._loop
        counters = {"global_step": step, "epoch": step // max(per_epoch, 1), "micro": micro,
                    "window": len(batches) if micro else 0, "steps_in_epoch": steps_in_epoch,
                    "globalstep_last_logged": int(trainer._globalstep_last_logged),
                    "rank": rank, "world_size": world}
        return pack(trainer.model, position, counters, rng=TorchRngRecord.capture())
