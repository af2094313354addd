"""`TrainingJob`: the knobs of one data-parallel training job, as its training script's config holds them.

Each of the course's mistakes is the wrong value of one knob (`labkit.course.training.mistakes` says which,
and the right one); `dataclasses.replace(job, knob=value)` changes one. `check(world_size)` refuses a job that
cannot run on that many ranks, with the value, the constraint and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit import validate
from labkit.batch import accumulation_steps

__all__ = ["GRAD_SYNCS", "OPTIMIZERS", "TrainingJob", "job_name"]

GRAD_SYNCS = ("ddp", "overlapped", "per_tensor", "none")
OPTIMIZERS = ("sgd", "adam", "adamw")


@dataclass(frozen=True)
class TrainingJob:
    """One data-parallel job's knobs (see the module docstring)."""

    global_batch: int = 16  # sequences per optimizer step, all ranks together: the job's contract, keep it
    micro_batch: int = 4  # sequences per rank in one forward and backward; accumulation makes up the rest
    optimizer: str = "adamw"  # "sgd", "adam" or "adamw"
    lr: float = 3e-4
    precision: str = "fp32"  # "fp32", or "autocast": the forward under bf16 torch.autocast
    checkpointing: bool = (
        False  # activation checkpointing of every block (recomputes the forward in backward)
    )
    # how gradients are averaged: "ddp" (torch DDP's buckets, all-reduced during backward), "overlapped"
    # (labkit's OverlappedDDP, the same idea), "per_tensor" (each gradient on its own after backward), "none"
    grad_sync: str = "ddp"
    bucket_cap_mb: float = 1.0  # the bucket size of "ddp" and "overlapped", MiB
    eval_samples: int = 0  # held-out sequences evaluated every step, all ranks together (0: no evaluation)
    eval_rank: int | None = None  # None: every rank evaluates its share; r: rank r evaluates all of them
    tokenize: str = (
        "ahead"  # "ahead": samples tokenized once before training; "in_loader": as they are fetched
    )
    tokenizer_cost: float = (
        1.0  # "in_loader": the tokenizer's time per step, as a share of the step's compute
    )
    accuracy: str = (
        "none"  # the logged metric: "none", "local" (reduced asynchronously) or "gathered" (logits)
    )
    loss_readout: str = (
        "deferred"  # "deferred": the loss stays on the device; "every_step": .item() each step
    )
    seed: int = 0  # the model's initial weights and the data

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank (`labkit.batch.accumulation_steps`)."""
        return accumulation_steps(self.global_batch, self.micro_batch, world_size)

    def check(self, world_size: int) -> None:
        """Raise ValueError, with the value and the fix, for a knob this job cannot run with."""
        self.accumulation(world_size)
        validate.one_of("optimizer", self.optimizer, OPTIMIZERS, 'optimizer="adamw"')
        validate.positive_number("lr", self.lr, "lr=3e-4")
        validate.one_of("precision", self.precision, ("fp32", "autocast"), 'precision="fp32"')
        validate.one_of("grad_sync", self.grad_sync, GRAD_SYNCS, 'grad_sync="ddp"')
        validate.positive_number("bucket_cap_mb", self.bucket_cap_mb, "bucket_cap_mb=1.0 (MiB)")
        validate.non_negative_int("eval_samples", self.eval_samples, "eval_samples=0 (no evaluation)")
        validate.one_of("tokenize", self.tokenize, ("ahead", "in_loader"), 'tokenize="ahead"')
        validate.positive_number("tokenizer_cost", self.tokenizer_cost, "tokenizer_cost=1.0")
        validate.one_of("accuracy", self.accuracy, ("none", "local", "gathered"), 'accuracy="local"')
        validate.one_of(
            "loss_readout", self.loss_readout, ("deferred", "every_step"), 'loss_readout="deferred"'
        )
        validate.non_negative_int("seed", self.seed, "seed=0")
        if self.eval_rank is not None and not 0 <= self.eval_rank < world_size:
            raise ValueError(
                f"eval_rank={self.eval_rank} is not a rank of {world_size}: None (shared) or "
                f"0..{world_size - 1}"
            )


def job_name(job: TrainingJob, base: TrainingJob | None = None) -> str:
    """A short folder name for `job`: the knobs that differ from `base` (default `TrainingJob()`)."""
    ref = dataclasses.asdict(base or TrainingJob())
    diff = [f"{k}-{v}" for k, v in dataclasses.asdict(job).items() if ref[k] != v]
    return "_".join(diff) or "clean"
