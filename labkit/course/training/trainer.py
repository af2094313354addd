"""`Trainer`: one rank's run of a `TrainingJob`, the loop every data-parallel lab trains with.

    trainer = Trainer(job, config, steps=10, process_group=group)
    loss = trainer.step()          # one optimizer step: a 0-d tensor on the device

One optimizer step, with the job's knobs:

1. for each of the rank's micro-batches (`job.accumulation(world_size)` of them): fetch it from its DataLoader
   (tokenized as it is fetched when `job.tokenize == "in_loader"`), forward under bf16 autocast if asked, the
   loss divided by the micro-batch count, the logged metric on the first micro-batch (`job.accuracy`),
   backward; every micro-step but the last inside the gradient sync's `no_sync()`;
2. the gradient sync's work after backward (`labkit.course.training.grad_sync`), then the optimizer step and
   `zero_grad(set_to_none=False)` (DDP's gradients are views of its buckets: keep them);
3. the held-out evaluation (`job.eval_samples`, shared or on `job.eval_rank`), the loss read on the host if
   `job.loss_readout == "every_step"`, and the wait for the metric's all-reduce.

The names the trace shows are PyTorch's own: the DataLoader's "enumerate(DataLoader)#..." spans and the
job's `record_function` spans ("forward", "backward", "optimizer.step", "logging", "evaluation"), as a
training script would write them; no labkit label (`labkit.trace.phase`), so that `labkit.trace.diagnose`
finds the course's mistakes from what any job's trace holds. Data, model and evaluation follow the course's
contract (`labkit.course.training.reference`): the rank's rows of global batch s in step s, the same seeded
weights on every rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from labkit.course.training.data import RankSamples, tokenizer_passes
from labkit.course.training.grad_sync import make_grad_sync
from labkit.course.training.job import TrainingJob
from labkit.machine import _torch_compat as compat
from labkit.machine import runtime
from labkit.models import GPTConfig, seeded_model, synthetic_batch
from labkit.parallel.data import OverlappedDDP
from labkit.trace.commlog import CommLog

__all__ = ["Forward", "Trainer"]

Accumulate = Callable[[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]], Any]


class Forward(nn.Module):
    """The model as the gradient sync sees it: `forward(x)` gives logits, `forward(x, y)` the loss, under bf16
    autocast if asked (backward then runs outside it, as the autocast docs advise); each loss is kept."""

    def __init__(self, model: nn.Module, autocast: bool) -> None:
        super().__init__()
        self.model, self.autocast = model, autocast
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(x, y)
        if y is not None:
            self.losses.append(out.detach())
        return out


def _optimizer(job: TrainingJob, params: Any) -> torch.optim.Optimizer:
    if job.optimizer == "sgd":
        return torch.optim.SGD(params, lr=job.lr, **runtime.optimizer_options())
    if job.optimizer == "adam":
        return torch.optim.Adam(params, lr=job.lr, **runtime.optimizer_options())
    return torch.optim.AdamW(params, lr=job.lr, **runtime.optimizer_options())


class Trainer:
    """One rank's run of `job` on `GPT(config)` for up to `steps` optimizer steps (see the module docstring).

    `ddp_class`: the `OverlappedDDP` (sub)class for `grad_sync="overlapped"` (a learner's, in lab 03).
    `comm_log`: where the gradient sync logs its collectives, for `capture(..., comm_log=...)` (None: not
    logged)."""

    def __init__(
        self,
        job: TrainingJob,
        config: GPTConfig,
        *,
        steps: int,
        process_group: dist.ProcessGroup | None = None,
        ddp_class: type[OverlappedDDP] | None = None,
        comm_log: CommLog | None = None,
    ) -> None:
        self.world = dist.get_world_size(process_group)
        job.check(self.world)
        self.job, self.config, self.process_group = job, config, process_group
        self.rank = dist.get_rank(process_group)
        self.acc = job.accumulation(self.world)
        self.dev = dev = runtime.device()
        self.model = seeded_model(config, job.seed, dev, checkpointing=job.checkpointing)
        self.forward = Forward(self.model, job.precision == "autocast")
        self.log = comm_log
        self.sync = make_grad_sync(
            job.grad_sync, self.forward, process_group, self.log, job.bucket_cap_mb, ddp_class
        )
        self.opt = _optimizer(job, self.model.parameters())
        share = job.global_batch // self.world
        passes = 0
        if job.tokenize == "in_loader" and runtime.on_simulated():
            raise RuntimeError(
                "a tokenizer in the loop (tokenize='in_loader') is host Python, which a simulated machine "
                "neither runs on real tokens nor times: run a data-loading lesson on the emulated cluster "
                "(cluster='cpu') or on GPUs"
            )
        if (
            job.tokenize == "in_loader"
        ):  # the tokenizer costs about `tokenizer_cost` of a step, on this machine
            passes = tokenizer_passes(self.model, config, share, job.tokenizer_cost, dev)
        data = RankSamples(
            config, job.global_batch, self.rank, self.world, steps, seed=job.seed, passes=passes
        )
        if job.tokenize == "ahead":
            data.prepare()  # before training: in no step
        self.steps = steps
        loader = torch.utils.data.DataLoader(data, batch_size=job.micro_batch, shuffle=False)
        with compat.real_tensors():  # its base seed is drawn with .item(): real even on a simulated machine
            self.batches = iter(loader)
        self._metric: Any = None  # the logged metric's all-reduce, in flight until the step ends
        # every rank holds the held-out batch; who evaluates which rows is the job's choice
        self.val_x, self.val_y = synthetic_batch(
            config, max(1, job.eval_samples), seed=job.seed + 7, device=dev
        )

    # ------------------------------------------------------------------ a step

    def _fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro-batch, on the device (the DataLoader's own profiler span names the fetch)."""
        try:
            x, y = next(self.batches)
        except StopIteration:
            raise RuntimeError(
                f"this Trainer holds data for steps={self.steps} optimizer steps; make it "
                "with more: Trainer(job, config, steps=...)"
            ) from None
        return x.to(self.dev), y.to(self.dev)

    def next_micro_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This step's micro-batches, fetched now."""
        return [self._fetch() for _ in range(self.acc)]

    def forward_backward(self, accumulate: Accumulate | None = None) -> torch.Tensor:
        """The step's micro-batches forward and backward, gradients averaged; returns the mean loss (0-d).

        `accumulate(module, batches)`: run the micro-batches yourself (lab 02's exercise: `module(x, y)` is
        the loss); by default the loop of the module docstring. The metric's all-reduce, if any, is left in
        flight: `update()` waits for it."""
        self.forward.losses.clear()
        if accumulate is not None:
            accumulate(self.sync.module, self.next_micro_batches())
            if len(self.forward.losses) != self.acc:
                raise ValueError(
                    f"accumulate ran {len(self.forward.losses)} forward passes for {self.acc} "
                    "micro-batches; call module(x, y) once for every (x, y) in batches"
                )
            self._metric = None
        else:
            self._metric = self._micro_steps()
        self.sync.after_backward()
        return torch.stack(self.forward.losses).mean()

    def _micro_steps(self) -> Any:
        metric = None
        for i in range(self.acc):
            x, y = self._fetch()
            last = i == self.acc - 1
            with contextlib.nullcontext() if last else self.sync.no_sync():
                with record_function("forward"):
                    logits = self.sync.module(x)
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
                self.forward.losses.append(loss.detach())
                if i == 0:  # the step's first micro-batch is the one logged
                    metric = self._log_accuracy(logits, y)
                with record_function("backward"), self.sync.backward() if last else contextlib.nullcontext():
                    (loss / self.acc).backward()
        return metric

    def update(self) -> None:
        """The optimizer step, then the step's evaluation, loss readout and metric (see the module
        docstring)."""
        with record_function("optimizer.step"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
        self._evaluate()
        if self.job.loss_readout == "every_step":
            self.forward.losses[-1].item()  # the host waits for the device here, every step
        if self._metric is not None:
            self._metric.wait()

    def step(self, accumulate: Accumulate | None = None) -> torch.Tensor:
        """One optimizer step; returns its mean loss over the micro-batches, on the device."""
        loss = self.forward_backward(accumulate)
        self.update()
        return loss

    def communicate_only(self) -> None:
        """This job's gradient communication with zero gradients and no compute (communication alone)."""
        self.sync.communicate_only()

    # -------------------------------------------------------- logging, evaluation

    def _log_accuracy(self, logits: torch.Tensor, y: torch.Tensor) -> Any:
        if self.job.accuracy == "none":
            return None
        with record_function("logging"):
            if (
                self.job.accuracy == "local"
            ):  # this rank's hits, reduced asynchronously: waited for at the end
                hits = (logits.argmax(-1) == y).float().sum()
                stats = torch.stack([hits, torch.tensor(float(y.numel()), device=hits.device)])
                return dist.all_reduce(stats, group=self.process_group, async_op=True)
            # every rank's logits gathered to score a global accuracy, synchronously
            everyone = torch.empty(
                (self.world * len(logits), *logits.shape[1:]), dtype=logits.dtype, device=self.dev
            )
            dist.all_gather_single(everyone, logits.detach().contiguous(), group=self.process_group)
            (everyone.argmax(-1) == y.repeat(self.world, 1)).float().mean()
            return None

    def _evaluate(self) -> None:
        n, m = self.job.eval_samples, self.job.micro_batch
        if n == 0:
            return
        if self.job.eval_rank is None:  # each rank its rows
            rows = range(self.rank * n // self.world, (self.rank + 1) * n // self.world)
        elif self.rank == self.job.eval_rank:
            rows = range(n)
        else:
            return
        with record_function("evaluation"), torch.no_grad():
            for start in range(rows.start, rows.stop, m):  # in micro-batches, as an eval loader would
                stop = min(start + m, rows.stop)
                self.model(self.val_x[start:stop], self.val_y[start:stop])
