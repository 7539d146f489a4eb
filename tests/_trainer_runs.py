"""Hugging Face `Trainer` runs for tests/test_transformers_trainer.py: uninterrupted runs,
runs stopped by SIGTERM at a micro-step, their resumes, with trainrec's `ExactResume` and
without it (Trainer alone, and Trainer's `enable_jit_checkpoint`).

    python _trainer_runs.py JOBS.json OUT.pt

JOBS.json is a list of jobs, run one after the other in this process (each builds its
model, data and Trainer anew, as a fresh process would). A job:

    {"name", "dir" (output_dir), "exact" (attach ExactResume), "bf16", "stop_at" (send
     SIGTERM to this process during that training micro-step, counted from the start of the
     run, on rank "stop_rank" only when given), "killed" (instead of the SIGTERM, what its
     default action does: the run ends there, nothing saved; the default disposition is
     checked), "uncaught" (the last job only: its SystemExit ends the process, whose exit
     status is then the result), "resume" (null, true or a path), "args"
     (TrainingArguments overrides), "jit" (enable_jit_checkpoint, its 3 s wait cut to
     0.05 s), "samples" (per rank, default 20), "drop_pending" (the broken variant:
     ExactResume puts no pending .grad back; the last job of its process)}

OUT (OUT.RANK with several ranks) receives `torch.save([result, ...])` after each job:
"exit" (the SystemExit code, or "killed"), "error" ("Type: message"), "params",
"optimizer" (its tensors by path), "scheduler", "global_step", "rng" (final torch / numpy /
python states), "forwards" (a digest of each training micro-step's input_ids, in order),
"untouched" (a refused resume left the model's parameters as they were), "checkpoints"
(every checkpoint folder: file -> sha1, after the run), "jit_returned" (train() returned
normally after the signal), "default_sigterm", "handler_restored" (SIGTERM's disposition
is the default again after train()), "seconds", "losses".

Tiny GPT2LMHeadModel from a config (dropout 0.1), 20 samples of 8 tokens with random
-100 labels, batch 2, gradient_accumulation_steps 4: windows of 4, 4 and 2 micro-batches,
3 steps an epoch, 2 epochs; AdamW, cosine with warm-up, clipping, an evaluation each
epoch. With RANK / WORLD_SIZE / MASTER_* in the environment the run is DDP over gloo.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from trainrec.adapters.torch.transformers import ExactResume  # noqa: E402


class Killed(BaseException):
    """What the default SIGTERM disposition does to a process, without ending this one."""


class Ending(BaseException):
    """The job's SystemExit, on its way to end the process, with the job's result."""

    def __init__(self, result: dict[str, Any]) -> None:
        self.result = result


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _data(samples: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(samples):
        ids = torch.randint(0, 64, (8,), generator=g)
        labels = ids.clone()
        labels[torch.rand(8, generator=g) < 0.3] = -100  # a window's token count varies
        out.append({"input_ids": ids, "attention_mask": torch.ones(8, dtype=torch.long),
                    "labels": labels})
    return out


def _trainer(job: dict[str, Any]) -> Trainer:
    transformers.set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                       n_head=2))
    world = world_size()
    kwargs: dict[str, Any] = dict(
        output_dir=job["dir"], per_device_train_batch_size=2, gradient_accumulation_steps=4,
        num_train_epochs=2, learning_rate=5e-3, lr_scheduler_type="cosine", warmup_steps=2,
        logging_steps=1, save_strategy="steps", save_steps=2, eval_strategy="epoch",
        per_device_eval_batch_size=4, report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, bf16=bool(job.get("bf16")), dataloader_num_workers=0,
        enable_jit_checkpoint=bool(job.get("jit")))
    kwargs.update(job.get("args", {}))
    trainer = Trainer(model=model, args=TrainingArguments(**kwargs),
                      train_dataset=_data(job.get("samples", 20) * world, 1),
                      eval_dataset=_data(4, 2))
    if job.get("exact"):
        ExactResume.attach(trainer)
    return trainer


def _digests(folder: Path) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    if not folder.is_dir():
        return out
    for ck in sorted(folder.iterdir()):
        if ck.is_dir() and "checkpoint-" in ck.name:
            out[ck.name] = {str(f.relative_to(ck)): hashlib.sha1(f.read_bytes()).hexdigest()
                            for f in sorted(ck.rglob("*")) if f.is_file()}
    return out


def _flat(tree: Any, at: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{at}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, sub in enumerate(tree) for k, v in _flat(sub, f"{at}/{i}").items()}
    return {at: tree.clone() if isinstance(tree, torch.Tensor) else tree}


def run(job: dict[str, Any], catch: bool = True) -> dict[str, Any]:
    if job.get("jit"):
        from transformers.trainer_jit_checkpoint import CheckpointManager

        CheckpointManager.__init__.__defaults__ = (0.05,)  # its kill_wait, 3 s
    trainer = _trainer(job)
    if job.get("drop_pending"):  # the broken variant: the pending .grad is not put back
        from trainrec.adapters.torch.pending import Pending

        Pending.apply = lambda self, model: None  # type: ignore[method-assign]
    rank = int(os.environ.get("RANK", "0"))
    forwards: list[str] = []
    stop_at = job.get("stop_at")
    stop_here = job.get("stop_rank") in (None, rank)
    disposition: list[bool] = []

    def hook(module: Any, args: Any, kwargs: Any) -> None:
        if not module.training:
            return
        forwards.append(hashlib.sha1(kwargs["input_ids"].cpu().numpy().tobytes()).hexdigest()[:12])
        if stop_here and len(forwards) == stop_at:
            if job.get("killed"):  # Trainer alone: SIGTERM's default action ends the process
                disposition.append(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
                raise Killed
            os.kill(os.getpid(), signal.SIGTERM)
            if job.get("jit"):
                time.sleep(0.3)  # its timer sets the flag its hooks look at

    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    out: dict[str, Any] = {"name": job["name"], "exit": None, "error": None}
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    try:
        trainer.train(resume_from_checkpoint=job.get("resume"))
    except SystemExit as e:
        out["exit"] = e.code
        if not catch:
            out.update(forwards=forwards, checkpoints=_digests(Path(job["dir"])),
                       handler_restored=signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
            raise Ending(out) from e
    except Killed:
        out["exit"] = "killed"
        out["default_sigterm"] = disposition == [True]
    except Exception as e:  # noqa: BLE001 - the refusals are results
        out["error"] = f"{type(e).__name__}: {e}"
        out["untouched"] = all(torch.equal(before[k], v)
                               for k, v in trainer.model.state_dict().items())
    out["forwards"] = forwards
    out["checkpoints"] = _digests(Path(job["dir"]))
    out["handler_restored"] = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if out["exit"] is None and out["error"] is None:
        out["jit_returned"] = bool(job.get("jit")) and stop_at is not None
        out["params"] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        out["optimizer"] = _flat(trainer.optimizer.state_dict())
        sched = trainer.lr_scheduler.state_dict()
        out["scheduler"] = {k: v for k, v in sched.items() if k != "lr_lambdas"}
        out["global_step"] = trainer.state.global_step
        out["rng"] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()[1].copy(),
                      "python": random.getstate()}
        out["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return out


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    world = os.environ.get("WORLD_SIZE", "1")
    out = sys.argv[2] if world == "1" else f"{sys.argv[2]}.{os.environ['RANK']}"
    results: list[dict[str, Any]] = []
    for i, job in enumerate(jobs):
        start = time.perf_counter()
        code = 0
        try:
            result = run(job, catch=i < len(jobs) - 1 or not job.get("uncaught"))
        except Ending as e:  # the last job's SystemExit: the process ends with its code
            result, code = e.result, e.result["exit"]
        results.append({**result, "seconds": time.perf_counter() - start})
        torch.save(results, out)
        if code:
            if world != "1":
                torch.distributed.destroy_process_group()
            sys.stdout.flush()
            os._exit(code)  # as sys.exit(code), without interpreter teardown (gloo, see below)
    if world != "1":
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)  # as tests/ddp_run.py: gloo may abort a rank at interpreter teardown


if __name__ == "__main__":
    main()
