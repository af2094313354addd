"""Lab 05's driver: data-parallel training runs with a bottleneck planted, each captured as traces.

`mystery_runs(config, runs, ...)` runs on every rank (launch it with `labkit.launch`). Each run trains
its own copy of the same seeded GPT under torch DDP for a few steps, profiled with `labkit.trace.capture`
(host trace and, on the emulated cluster, the device timeline), one folder of per-rank traces per run.
A run is `(bottleneck, fixed)`: `bottleneck` one of `BOTTLENECKS` (None: the clean job), `fixed` applies
the fix that a trace of it points to. The planted mistakes, each seen in real jobs:

* "straggler": one rank (`straggler_rank`) also evaluates a held-out batch (4x the training batch, forward
  only) every step; fixed: the evaluation is shared out, each rank takes its part;
* "data_loading": every sample is "tokenized" in the training process, a slow per-sample Python loop
  inside the DataLoader (num_workers=0), about half a step's compute (`passes`: None measures it); fixed:
  the samples are prepared once, before training;
* "small_collectives": no DDP; every gradient all-reduced on its own after backward; fixed: DDP's buckets;
* "sync_collective": for a logging metric the logits are all-gathered, synchronously, between forward
  and backward; fixed: the metric is computed locally and its all-reduce issued asynchronously,
  waited for at the end of the step;
* "host_sync": `loss.item()` every step. On a GPU this drains the launch queue; on the emulated
  cluster compute is synchronous, so it costs nothing there (and `diagnose` rightly finds nothing).
"""

from __future__ import annotations

import random
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from labkit import runtime, validate
from labkit.experiments.common import seeded_model
from labkit.experiments.script import Where, run_lab
from labkit.models import GPTConfig, synthetic_batch
from labkit.parallel.data import allreduce_gradients_naive
from labkit.trace.capture import capture
from labkit.trace.phases import phase

__all__ = [
    "BOTTLENECKS",
    "DEFAULTS",
    "FIXES",
    "SequenceDataset",
    "headline",
    "main",
    "mystery_runs",
    "tokenizer_passes",
]

BOTTLENECKS = (None, "straggler", "data_loading", "small_collectives", "sync_collective", "host_sync")
FIXES = {
    None: "nothing to fix",
    "straggler": "share the extra evaluation out over every rank",
    "data_loading": "prepare the samples once, before training (or in DataLoader workers)",
    "small_collectives": "let DDP all-reduce gradients in buckets during backward",
    "sync_collective": "compute the metric locally; all-reduce it asynchronously, wait at the end of the step",
    "host_sync": "keep the loss on the device; read it every N steps",
}


class SequenceDataset(torch.utils.data.Dataset):
    """The sequences a rank trains on (its rows of `synthetic_batch`), one sample at a time.

    `passes` > 0 plants a slow tokenizer: each sample is written out as text and parsed back that many
    times, in Python, when it is fetched, as a tokenizer run inside the training loop would.
    `prepare()` does that work once, up front (the fix).
    """

    def __init__(self, config: GPTConfig, samples: int, seed: int, passes: int = 0) -> None:
        self.x, self.y = synthetic_batch(config, samples, seed=seed)
        self.vocab = config.vocab_size
        self.passes = passes
        self._ready: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return len(self.x)

    def _tokenize(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.x[i].tolist()
        for _ in range(self.passes):  # text -> tokens, as a slow tokenizer would
            text = " ".join(f"t{t:05d}" for t in tokens)
            tokens = [int(word[1:]) % self.vocab for word in text.split()]
        return torch.tensor(tokens), self.y[i]

    def prepare(self) -> SequenceDataset:
        self._ready = [self._tokenize(i) for i in range(len(self))]
        return self

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._ready[i] if self._ready is not None else self._tokenize(i)


def tokenizer_passes(
    model: torch.nn.Module,
    config: GPTConfig,
    batch_size: int,
    seed: int,
    device: torch.device,
    share: float = 0.5,
) -> int:
    """Tokenizer passes per sample (`SequenceDataset`) that cost about `share` of the compute (CPU time) of a
    forward and backward of `batch_size` samples, so that a planted data-loading bottleneck is one at any model
    size. (The forward and backward measured is the model's first, cold: more passes, if anything.)"""
    x, y = synthetic_batch(config, batch_size, seed=seed, device=device)
    t0 = time.thread_time()
    model(x, y).backward()
    runtime.synchronize()
    step_s = time.thread_time() - t0
    model.zero_grad(set_to_none=True)
    probe = SequenceDataset(config, 4, seed, passes=20)
    probe[0]  # once untimed: the first call pays for cold caches, and would make the tokenizer look slower
    t0 = time.thread_time()
    for i in range(len(probe)):
        probe[i]
    per_pass = (time.thread_time() - t0) / (4 * 20)
    return max(1, round(share * step_s / (batch_size * per_pass)))


class _Job:
    """One run on this rank: its own seeded model (under DDP, or not), data, optimizer and planted mistake."""

    def __init__(
        self,
        config: GPTConfig,
        bottleneck: str | None,
        fixed: bool,
        *,
        batch_size: int,
        batches: int,
        straggler_rank: int,
        passes: int,
        bucket_cap_mb: float,
        seed: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.bottleneck, self.fixed, self.group = bottleneck, fixed, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.straggler_rank = straggler_rank
        self.dev = dev = runtime.device()
        self.model = seeded_model(config, seed, dev)
        self.naive = bottleneck == "small_collectives" and not fixed
        self.ddp = (
            self.model
            if self.naive
            else DistributedDataParallel(
                self.model,
                device_ids=[dev.index] if dev.type == "cuda" else None,
                bucket_cap_mb=bucket_cap_mb,
                process_group=group,
            )
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        if bottleneck == "data_loading" and passes is None:
            passes = tokenizer_passes(self.model, config, batch_size, seed, dev)
        data = SequenceDataset(
            config,
            batch_size * batches,
            seed * 1000 + self.rank,
            passes if bottleneck == "data_loading" else 0,
        )
        if bottleneck != "data_loading" or fixed:
            data.prepare()  # before training, in no step; the clean job too, so that the fix can reach it exactly
        self.batches = iter(
            torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False, num_workers=0)
        )
        # the straggler's held-out batch: 4 x the training batch, forward only, about as much work as a step.
        # (3 x measured 1.58-1.77x the other ranks' compute over six launches, too near diagnose's 1.5x: one CI
        # run called it "none".)
        self.val_x, self.val_y = synthetic_batch(config, 4 * batch_size, seed=seed + 7, device=dev)

    def step(self) -> None:
        dev, group = self.dev, self.group
        with phase("data"):
            x, y = next(self.batches)
            x, y = x.to(dev), y.to(dev)
        self.opt.zero_grad()
        logits = self.ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        stats_work = None
        if self.bottleneck == "sync_collective":
            with phase("logging"):
                if self.fixed:  # a local metric, reduced asynchronously: nothing waits for it until the end
                    hits = (logits.argmax(-1) == y).float().sum()
                    stats = torch.stack([hits, torch.tensor(float(y.numel()), device=hits.device)])
                    stats_work = dist.all_reduce(stats.to(dev), group=group, async_op=True)
                else:  # every rank's logits gathered to score a global accuracy, synchronously
                    everyone = torch.empty(
                        (self.world * len(logits), *logits.shape[1:]), dtype=logits.dtype, device=dev
                    )
                    dist.all_gather_single(everyone, logits.detach().contiguous(), group=group)
                    (everyone.argmax(-1) == y.repeat(self.world, 1)).float().mean()
        loss.backward()
        if self.naive:
            allreduce_gradients_naive(self.model, group)
        self.opt.step()
        if self.bottleneck == "straggler":
            with phase("evaluation"), torch.no_grad():
                if self.fixed:  # every rank evaluates its share of the held-out batch
                    n = len(self.val_x)
                    share = slice(self.rank * n // self.world, (self.rank + 1) * n // self.world)
                    self.model(self.val_x[share], self.val_y[share])
                elif self.rank == self.straggler_rank:
                    self.model(self.val_x, self.val_y)
        if self.bottleneck == "host_sync" and not self.fixed:
            loss.item()  # the host waits for the device here, every step
        if stats_work is not None:
            stats_work.wait()


def mystery_runs(
    config: GPTConfig,
    runs: Sequence[tuple[str | None, bool]],
    trace_dir: str,
    *,
    batch_size: int = 8,
    steps: int = 3,
    warmup: int = 1,
    trace_steps: int = 3,
    straggler_rank: int = 1,
    passes: int | None = None,
    bucket_cap_mb: float = 0.25,
    seed: int = 0,
    same_core: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> list[dict[str, Any]]:
    """Every rank: time each run `(bottleneck, fixed)`, then trace it into `trace_dir/<name>/`.

    First `warmup + steps` steps of every run, taking turns step by step (so that a slow moment of the
    machine hits them all alike), timed on `labkit.runtime.clock` without a profiler; then each run's
    `trace_steps` more steps under `capture` (after one profiled warm-up step). `same_core`: on the emulated
    cluster all ranks share one core (`labkit.runtime.share_one_core`), so that a slow core is not taken for
    a straggler, at twice the wall time. Returns this rank's step times (ms) and trace folder per run.
    """
    validate.positive_int("steps", steps, "mystery_runs(..., steps=3)")
    validate.positive_int("trace_steps", trace_steps, "mystery_runs(..., trace_steps=2)")
    for bottleneck, _ in runs:
        validate.one_of(
            "bottleneck", bottleneck, BOTTLENECKS, 'mystery_runs(config, [("straggler", False)], dir)'
        )
    world = dist.get_world_size(process_group)
    if not 0 <= straggler_rank < world:
        raise ValueError(f"straggler_rank={straggler_rank} must be a rank of the group, 0..{world - 1}")
    if same_core:
        runtime.share_one_core()
    jobs = [
        _Job(
            config,
            b,
            f,
            batch_size=batch_size,
            batches=warmup + steps + 1 + trace_steps,
            straggler_rank=straggler_rank,
            passes=passes,
            bucket_cap_mb=bucket_cap_mb,
            seed=seed,
            group=process_group,
        )
        for b, f in runs
    ]
    times: list[list[float]] = [[] for _ in jobs]
    for _ in range(warmup + steps):
        for job, t in zip(jobs, times):
            dist.barrier(group=process_group)
            t0 = runtime.clock()
            job.step()
            t.append((runtime.clock() - t0) * 1e3)
    out = []
    for job, t in zip(jobs, times):
        name = (
            f"{job.bottleneck or 'clean'}{f'_rank{straggler_rank}' if job.bottleneck == 'straggler' else ''}"
            f"{'_fixed' if job.fixed else ''}"
        )
        dist.barrier(group=process_group)
        # one profiled warm-up step first: the traced steps are in the steady state (e.g. a fast rank already
        # waits for a straggler's previous step)
        path = capture(
            job.step, steps=trace_steps, warmup=1, path=Path(trace_dir) / name / "trace_rank{rank}.json"
        )
        out.append(
            {
                "bottleneck": job.bottleneck,
                "fixed": job.fixed,
                "traces": str(path.parent),
                "step_ms": t[warmup:],
                "median_ms": statistics.median(t[warmup:]),
                "rank": job.rank,
            }
        )
    return out


# ----------------------------------------------------------------- as a script (labkit.experiments.script)

DEFAULTS: dict[str, Any] = {
    "world_size": 2,
    "n_layers": 2,
    "d_model": 64,
    "vocab_size": 2048,
    "seq_len": 64,
    "batch_size": 8,
    "mystery_seed": 3,
    "steps": 3,
    "trace_dir": "traces_05",
    "timeout_s": 120,
}


def headline(
    w: Where,
    n_layers: int,
    d_model: int,
    vocab_size: int,
    seq_len: int,
    batch_size: int,
    mystery_seed: int,
    steps: int,
    trace_dir: str,
    timeout_s: float,
) -> dict[str, Any]:
    """Lab 05's records: a job with a mistake planted by `mystery_seed`, the same job with the fix the trace's
    diagnosis (`labkit.trace.diagnose`) names, and the clean job, in one launch."""
    from labkit.trace import diagnose

    config = GPTConfig(n_layers=n_layers, d_model=d_model, n_heads=4, vocab_size=vocab_size, seq_len=seq_len)
    # A host sync costs nothing where compute is synchronous (the CPU): drawn only on GPUs.
    shows_here = [b for b in BOTTLENECKS if b is not None and (b != "host_sync" or w.on_gpu)]
    planted = random.Random(mystery_seed).choice(shows_here)
    folder = Path(trace_dir).resolve()
    if w.rank() == 0:
        shutil.rmtree(
            folder, ignore_errors=True
        )  # this run's traces only (ranks write theirs inside the launch)

    def runs(plan: list[tuple[str | None, bool]]) -> list[list[dict[str, Any]]]:
        per_rank = w.launch(
            mystery_runs,
            config,
            plan,
            str(folder),
            batch_size=batch_size,
            steps=steps,
            timeout_s=timeout_s,
            deadline_s=timeout_s * 3,
        )
        return [[rank[i] for rank in per_rank] for i in range(len(plan))]

    (mystery,) = runs([(planted, False)])
    found = diagnose(Path(mystery[0]["traces"]))
    # The fix the diagnosis names, applied to the job: it removes the planted mistake only if it named that one
    before, after, clean = runs([(planted, False), (planted, found.kind == planted), (None, False)])
    ms = [max(r["median_ms"] for r in run) for run in (before, after, clean)]  # the slowest rank's median
    return {
        "before": ms[0],
        "after": ms[1],
        "limit": ms[2],
        "unit": "ms",
        "meaning": {
            "before": "data-parallel step time with a planted bottleneck (slowest rank's median)",
            "after": "step time after the fix that the trace's diagnosis pointed to",
            "limit": "the same job with nothing planted, measured in the same launch",
        },
        "metric": "step time of a job with a hidden bottleneck, before and after the fix the trace named",
        "planted": planted,
        "diagnosed": found.kind,
        "evidence": found.evidence,
        "fix": FIXES.get(found.kind),
        "fixed": found.kind == planted,
        "traces": mystery[0]["traces"],
    }


def main(argv: list[str] | None = None) -> int:
    return run_lab("05_unprofiled_run", headline, DEFAULTS, argv)


if __name__ == "__main__":
    from labkit.experiments import (
        unprofiled_run,
    )  # by its own name, so launch pickles its functions by reference

    raise SystemExit(unprofiled_run.main())
