"""What `ExactResume` refuses, saying why: Trainer setups it cannot make exact
(`_refuse_unsupported`: DeepSpeed, FSDP, DataParallel, JIT checkpoints, ...), and a
window's batch that is not a mapping of str to tensors (`_batch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _batch(batch: Any, index: int) -> dict[str, torch.Tensor]:
    if not isinstance(batch, Mapping) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in batch.items()):
        raise TypeError(
            f"batch {index} of the window is not a mapping of str to tensors "
            f"({type(batch).__name__}): ExactResume saves the rest of a window, fetched "
            "ahead, as tensors; use a data collator that returns tensors only")
    return {k: v.detach() for k, v in batch.items()}


def _refuse_unsupported(trainer: Any) -> None:
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback
    from transformers.utils import is_sagemaker_mp_enabled

    args = trainer.args
    jit = getattr(args, "enable_jit_checkpoint", False) or any(
        isinstance(cb, JITCheckpointCallback) for cb in trainer.callback_handler.callbacks)
    refusals = [
        (jit, "Trainer's enable_jit_checkpoint: ExactResume refuses to run beside it (its SIGTERM "
              "handler saves into checkpoint-<global_step>, over the complete step checkpoint, "
              "without the pending gradients); set TrainingArguments(enable_jit_checkpoint=False), "
              "ExactResume saves on SIGTERM itself"),
        (trainer.is_deepspeed_enabled, "DeepSpeed: not supported (DDP, one process per device, is)"),
        (trainer.is_fsdp_enabled or getattr(trainer, "is_fsdp_xla_enabled", False),
         "FSDP: not supported (DDP, one process per device, is)"),
        (args.n_gpu > 1, f"DataParallel over {args.n_gpu} GPUs: not supported; run one process "
                         "per GPU (torchrun), which is DDP"),
        (trainer.is_model_parallel or getattr(trainer, "is_distributed_loading_by_transformers",
                                              False), "a model split over devices: not supported"),
        (is_sagemaker_mp_enabled(), "SageMaker model parallelism: not supported"),
        (args.auto_find_batch_size, "auto_find_batch_size: it changes the batch size on the fly, "
                                    "which no saved data position survives; set it False"),
        (args.ignore_data_skip, "ignore_data_skip: a resume would not skip the data already "
                                "trained on; set it False"),
        (trainer.train_dataset is not None and _length(trainer.train_dataset) is None,
         "a train dataset without __len__ (an IterableDataset): not supported"),
    ]
    refused = [why for bad, why in refusals if bad]
    if refused:
        raise ValueError("ExactResume cannot make this Trainer exact: " + "; ".join(refused))
