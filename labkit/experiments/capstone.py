"""The capstone's driver: one data-parallel training job with two or three of the course's mistakes planted.

`draw(seed)` deals a `Capstone`: a GPT, a `TrainingJob` (the knobs a training script's config holds) with
mistakes planted in it, chosen by the seed so that every learner, or every exam sitting, gets a different job,
and the memory of the job's (emulated) GPU. `train(capstone, jobs, trace_dir)` runs jobs on every rank (launch
it with `labkit.launch`); each job, one after the other:

1. two optimizer steps under the GPU's memory (`capstone.memory_mib`): an OOM there is the job's OOM, and the
   peak of the second (AdamW's states and DDP's buckets exist by then) is the job's memory. On the emulated cluster that is a `MemoryBudget` around those two steps only (it
   inspects every tensor, which would slow the timed steps); on a GPU a memory fraction above what the process
   held before the job (cuBLAS's workspaces included: they come from the same allocator);
2. `steps` more, timed on `labkit.runtime.clock`, taking turns with the other jobs step by step (so a slow
   moment of the machine hits them all alike);
3. `trace_steps` under `labkit.trace.capture` (after one profiled warm-up step), into `trace_dir/<name>/`.

The mistakes (`MISTAKES`), each one of the course's labs, and the knob that plants it:

* "oom_batch" (lab 02): `micro_batch` = the rank's whole share of the global batch, which does not fit; the
  fix keeps the global batch (micro-batches and gradient accumulation under `no_sync`);
* "per_tensor_allreduce" (lab 03): `grad_sync="per_tensor"`, every gradient all-reduced on its own after
  backward; fixed by DDP's buckets during backward;
* "straggler" (lab 05): `eval_rank=r`, one rank evaluates the whole held-out batch every step while the others
  wait for it; fixed by sharing the evaluation out (`eval_rank=None`);
* "data_loading" (lab 05): `tokenize="in_loader"`, a slow tokenizer in the training process; fixed by
  tokenizing once before training (`"ahead"`);
* "sync_logging" (lab 05): `accuracy="gathered"`, every rank's logits all-gathered, blocking, between forward
  and backward to log a global accuracy; fixed by a local metric whose all-reduce is waited for at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from labkit import emulate, runtime, validate
from labkit.batch import accumulation_steps
from labkit.experiments.common import seeded_model
from labkit.experiments.script import Where, run_lab
from labkit.experiments.unprofiled_run import SequenceDataset, tokenizer_passes
from labkit.models import GPTConfig, synthetic_batch
from labkit.parallel.data import allreduce_gradients_naive
from labkit.trace.capture import capture
from labkit.trace.phases import phase

__all__ = ["DEFAULTS", "MISTAKES", "Capstone", "TrainingJob", "draw", "headline", "job_name", "main", "train"]

MISTAKES = ("oom_batch", "per_tensor_allreduce", "straggler", "data_loading", "sync_logging")
_MIB = 2**20


@dataclass(frozen=True)
class TrainingJob:
    """The job's knobs, as its training script's config would hold them (`dataclasses.replace` to change)."""

    global_batch: int = 16  # sequences per optimizer step, all ranks together: the job's contract, keep it
    micro_batch: int = 4  # sequences per rank in one forward and backward
    grad_sync: str = (
        "ddp"  # "ddp": DDP's buckets, all-reduced during backward; "per_tensor": each one after it
    )
    bucket_cap_mb: float = 1.0  # DDP's bucket size
    eval_rank: int | None = (
        None  # the held-out batch, every step: None, each rank its share; r: rank r all of it
    )
    tokenize: str = (
        "ahead"  # "ahead": every sample tokenized once before training; "in_loader": as it is fetched
    )
    accuracy: str = (
        "local"  # the logged metric: "local" (reduced asynchronously) or "gathered" (logits, blocking)
    )
    checkpointing: bool = (
        False  # activation checkpointing of every block (recomputes the forward in backward)
    )

    def accumulation(self, world_size: int) -> int:
        """Micro-batches per optimizer step on each rank (`labkit.batch.accumulation_steps`)."""
        return accumulation_steps(self.global_batch, self.micro_batch, world_size)

    def check(self, world_size: int) -> None:
        """Raise ValueError, with the value and the fix, for a knob this job cannot run with."""
        self.accumulation(world_size)
        validate.one_of("grad_sync", self.grad_sync, ("ddp", "per_tensor"), 'grad_sync="ddp"')
        validate.one_of("tokenize", self.tokenize, ("ahead", "in_loader"), 'tokenize="ahead"')
        validate.one_of("accuracy", self.accuracy, ("local", "gathered"), 'accuracy="local"')
        validate.positive_number("bucket_cap_mb", self.bucket_cap_mb, "1.0 (MiB)")
        if self.eval_rank is not None and not 0 <= self.eval_rank < world_size:
            raise ValueError(
                f"eval_rank={self.eval_rank} is not a rank of {world_size}: None (shared) or "
                f"0..{world_size - 1}"
            )


@dataclass(frozen=True)
class Capstone:
    """One dealt capstone: the model, the job as handed over (mistakes in it), its GPU's memory, the ranks.

    `planted` and `clean` are the answer key, kept out of the repr: the check reads them, you should not.
    """

    seed: int
    world_size: int
    model: GPTConfig
    job: TrainingJob
    memory_mib: float  # each rank's GPU memory for this job
    planted: tuple[str, ...] = dataclasses.field(repr=False)
    clean: TrainingJob = dataclasses.field(repr=False)

    @property
    def eval_samples(self) -> int:
        """Held-out sequences evaluated every step (all ranks together): twice the global batch, so that one
        rank evaluating all of them computes about twice what the others do (`diagnose` names a straggler
        from 1.5x)."""
        return 2 * self.job.global_batch


def _plant(clean: TrainingJob, mistakes: Sequence[str], world_size: int, rng: random.Random) -> TrainingJob:
    knobs: dict[str, Any] = {}
    for m in mistakes:
        if m == "oom_batch":
            knobs["micro_batch"] = clean.global_batch // world_size
        elif m == "per_tensor_allreduce":
            knobs["grad_sync"] = "per_tensor"
        elif m == "straggler":
            knobs["eval_rank"] = rng.randrange(world_size)
        elif m == "data_loading":
            knobs["tokenize"] = "in_loader"
        elif m == "sync_logging":
            knobs["accuracy"] = "gathered"
    return dataclasses.replace(clean, **knobs)


def draw(
    seed: int, *, world_size: int = 2, model: GPTConfig | None = None, memory_mib: float | None = None
) -> Capstone:
    """Deal the capstone of `seed`: two or three of `MISTAKES` planted in one data-parallel job.

    `memory_mib`: each rank's GPU memory; by default 1.6x what the clean job's step needs by
    `labkit.memory.estimate` (Adam, fp32, micro-batch 4): room for the clean job and for the logging mistake's
    gathered logits, not for twice the micro-batch (measured on the default GPT, emulated: clean 15.8 MiB,
    gathered logits 19.8 MiB, micro-batch 8 25.9 MiB, against 21.9 MiB)."""
    from labkit.memory import estimate  # memory sits above models; imported here to keep import light

    validate.positive_int("world_size", world_size, "draw(seed, world_size=2)")
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: the capstone is a data-parallel job; use 2 or more ranks")
    model = model or GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=2048, seq_len=64)
    rng = random.Random(seed)
    planted = tuple(sorted(rng.sample(MISTAKES, rng.choice((2, 3))), key=MISTAKES.index))
    clean = TrainingJob(global_batch=8 * world_size, micro_batch=4)
    job = _plant(clean, planted, world_size, rng)
    if memory_mib is None:
        need = estimate(
            model=model, micro_batch=clean.micro_batch, optimizer="adam", precision="fp32", keep_grads=True
        ).peak  # accumulating: gradients beside the next micro-batch's activations
        memory_mib = round(1.6 * need / _MIB, 1)
    validate.positive_number("memory_mib", memory_mib, "draw(seed, memory_mib=64)")
    return Capstone(seed, world_size, model, job, float(memory_mib), planted, clean)


def job_name(job: TrainingJob, clean: TrainingJob | None = None) -> str:
    """A short folder name for a job: the knobs that differ from `clean` (default `TrainingJob()`)."""
    base = dataclasses.asdict(clean or TrainingJob())
    diff = [f"{k}-{v}" for k, v in dataclasses.asdict(job).items() if base[k] != v]
    return "_".join(diff) or "clean"


class _Run:
    """One job on this rank: its own seeded model (under DDP or not), data, optimizer and held-out batch."""

    def __init__(
        self, cap: Capstone, job: TrainingJob, batches: int, group: dist.ProcessGroup | None
    ) -> None:
        job.check(dist.get_world_size(group))
        self.job, self.group = job, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.acc = job.accumulation(self.world)
        self.dev = dev = runtime.device()
        self.model = seeded_model(cap.model, cap.seed, dev, checkpointing=job.checkpointing)
        self.ddp = (
            self.model
            if job.grad_sync == "per_tensor"
            else DistributedDataParallel(
                self.model,
                device_ids=[dev.index] if dev.type == "cuda" else None,
                bucket_cap_mb=job.bucket_cap_mb,
                gradient_as_bucket_view=True,
                process_group=group,
            )
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        share = job.micro_batch * self.acc
        # the slow tokenizer costs about what the step's forward and backward do, measured on this machine
        passes = tokenizer_passes(self.model, cap.model, share, cap.seed, dev, share=1.0)
        data = SequenceDataset(cap.model, share * batches, cap.seed * 1000 + self.rank, passes)
        if job.tokenize == "ahead":
            data.prepare()  # before training: in no step
        self.batches = iter(
            torch.utils.data.DataLoader(data, batch_size=job.micro_batch, shuffle=False, num_workers=0)
        )
        # every rank holds the held-out batch; who evaluates which rows is the job's choice
        self.val_x, self.val_y = synthetic_batch(cap.model, cap.eval_samples, seed=cap.seed + 7, device=dev)

    def _no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        if last or self.job.grad_sync == "per_tensor":
            return contextlib.nullcontext()
        return self.ddp.no_sync()  # accumulate locally; DDP all-reduces on the last micro-batch only

    def _log_accuracy(self, logits: torch.Tensor, y: torch.Tensor) -> Any:
        with phase("logging"):
            if (
                self.job.accuracy == "local"
            ):  # this rank's hits, reduced asynchronously: waited for at the end
                hits = (logits.argmax(-1) == y).float().sum()
                stats = torch.stack([hits, torch.tensor(float(y.numel()), device=hits.device)])
                return dist.all_reduce(stats.to(self.dev), group=self.group, async_op=True)
            everyone = torch.empty(
                (self.world * len(logits), *logits.shape[1:]), dtype=logits.dtype, device=self.dev
            )
            dist.all_gather_single(everyone, logits.detach().contiguous(), group=self.group)
            (everyone.argmax(-1) == y.repeat(self.world, 1)).float().mean()
            return None

    def _evaluate(self) -> None:
        n, m = len(self.val_x), self.job.micro_batch
        if self.job.eval_rank is None:  # each rank its rows
            rows = range(self.rank * n // self.world, (self.rank + 1) * n // self.world)
        elif self.rank == self.job.eval_rank:
            rows = range(n)
        else:
            return
        with phase("evaluation"), torch.no_grad():
            for start in range(rows.start, rows.stop, m):  # in micro-batches, as an eval loader would
                stop = min(start + m, rows.stop)
                self.model(self.val_x[start:stop], self.val_y[start:stop])

    def step(self) -> float:
        """One optimizer step; returns its loss (mean over the micro-batches)."""
        total, work = 0.0, None
        for i in range(self.acc):
            last = i == self.acc - 1
            with phase("data"):
                x, y = next(self.batches)
                x, y = x.to(self.dev), y.to(self.dev)
            with self._no_sync(last):
                logits = self.ddp(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / self.acc
                if i == 0:  # the step's first micro-batch is the one logged
                    work = self._log_accuracy(logits, y)
                loss.backward()
            total += float(loss.detach())
        if self.job.grad_sync == "per_tensor":
            allreduce_gradients_naive(self.model, self.group)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self._evaluate()
        if work is not None:
            work.wait()
        return total


@contextlib.contextmanager
def _memory_of_gpu(memory_mib: float, rank: int, run: _Run) -> Iterator[emulate.MemoryBudget | None]:
    """The job's steps inside this rank's GPU memory (the emulated budget, or None on a GPU)."""
    limit = int(memory_mib * _MIB)
    if runtime.on_gpu():
        dev = run.dev
        torch.cuda.empty_cache()  # blocks cached by earlier jobs would otherwise be memory beyond the cap
        total = torch.cuda.get_device_properties(dev).total_memory
        # what this process holds already (the model, other jobs' cached blocks, cuBLAS workspaces) stays
        # outside the job's memory: the cap is on reserved memory (set_per_process_memory_fraction)
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, (torch.cuda.memory_reserved(dev) + limit) / total), dev
        )
        try:
            yield None
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
        return
    with emulate.MemoryBudget(limit, rank=rank) as budget:
        budget.track(run.model, run.val_x, run.val_y)  # made before the budget started: on the GPU too
        yield budget


def _peak_mib(run: _Run, before: int) -> float:
    if runtime.on_gpu():
        return (torch.cuda.max_memory_allocated(run.dev) - before) / _MIB
    peak = runtime.peak_bytes()
    return peak[0] / _MIB if peak is not None else float("nan")


def train(
    cap: Capstone,
    jobs: Sequence[TrainingJob],
    trace_dir: str,
    *,
    steps: int = 2,
    warmup: int = 1,
    trace_steps: int = 3,
    same_core: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> list[dict[str, Any]]:
    """Every rank: run each of `jobs` (see the module docstring); per job this rank's memory, times and traces.

    An OOM in a job's memory steps raises `torch.OutOfMemoryError` (the launch then raises `RankError`).
    `same_core`: on the emulated cluster all ranks share one core (`labkit.runtime.share_one_core`), so that a
    slow core is not taken for a straggler.
    """
    validate.positive_int("steps", steps, "train(cap, jobs, dir, steps=2)")
    validate.positive_int("trace_steps", trace_steps, "train(cap, jobs, dir, trace_steps=3)")
    if dist.get_world_size(process_group) != cap.world_size:
        raise ValueError(
            f"the capstone was dealt for {cap.world_size} ranks, launched on "
            f"{dist.get_world_size(process_group)}: launch(train, ..., world_size={cap.world_size})"
        )
    if same_core:
        runtime.share_one_core()
    rank = dist.get_rank(process_group)
    runs, peaks = [], []
    for job in jobs:
        before = torch.cuda.memory_allocated(runtime.device()) if runtime.on_gpu() else 0
        run = _Run(cap, job, batches=2 + warmup + steps + 1 + trace_steps, group=process_group)
        with _memory_of_gpu(cap.memory_mib, rank, run) as budget:
            run.step()  # creates AdamW's states; DDP rebuilds its buckets in gradient order
            if (
                budget is not None
            ):  # DDP made its gradient buckets before the budget: the gradients view them now
                budget.track(*(p.grad for p in run.model.parameters() if p.grad is not None))
            runtime.reset_peak_memory_stats()
            run.step()  # the peak of a steady step: everything a step holds at once
            peaks.append(_peak_mib(run, before))
        runs.append(run)
    times: list[list[float]] = [[] for _ in runs]
    losses: list[float] = [0.0 for _ in runs]
    for _ in range(warmup + steps):
        for i, run in enumerate(runs):
            dist.barrier(group=process_group)
            t0 = runtime.clock()
            losses[i] = run.step()
            times[i].append((runtime.clock() - t0) * 1e3)
    out = []
    for i, (run, t, peak, loss) in enumerate(zip(runs, times, peaks, losses)):
        dist.barrier(group=process_group)
        folder = Path(trace_dir) / f"{i}_{job_name(run.job, cap.clean)}"  # the index: two jobs may be alike
        path = capture(run.step, steps=trace_steps, warmup=1, path=folder / "trace_rank{rank}.json")
        out.append(
            {
                "job": run.job,
                "rank": rank,
                "peak_mib": peak,
                "step_ms": t[warmup:],
                "median_ms": statistics.median(t[warmup:]),
                "loss": loss,
                "traces": str(path.parent),
            }
        )
    return out


# ----------------------------------------------------------------- as a script (labkit.experiments.script)

DEFAULTS: dict[str, Any] = {
    "world_size": 2,
    "capstone_seed": 0,
    "steps": 2,
    "trace_steps": 3,
    "trace_dir": "traces_06",
    "timeout_s": 120,
}
# A kind of labkit.trace.findings: the capstone mistake it shows, and the knobs that fix it (the notebook's exercise 2)
_KNOB_FIXES = {
    "small_collectives": ("per_tensor_allreduce", {"grad_sync": "ddp"}),
    "straggler": ("straggler", {"eval_rank": None}),
    "data_loading": ("data_loading", {"tokenize": "ahead"}),
    "sync_collective": ("sync_logging", {"accuracy": "local"}),
}


def headline(
    w: Where, capstone_seed: int, steps: int, trace_steps: int, trace_dir: str, timeout_s: float
) -> dict[str, Any]:
    """The capstone's records, found by measurement alone: the job as handed (its micro-batch cut to the largest
    whose estimate fits 90 % of the memory, if it runs out), then rounds of fixing the first of
    `labkit.trace.findings` until the traces show nothing; the limit is the clean job, in the final launch."""
    from labkit.memory import estimate  # above this module, as the trace's analysis is
    from labkit.trace import findings

    cap = draw(capstone_seed, world_size=w.world_size)
    folder = Path(trace_dir).resolve()

    def attempt(jobs: list[TrainingJob], name: str) -> list[list[dict[str, Any]]] | None:
        from labkit.launcher import RankError

        try:
            per_rank = w.launch(
                train,
                cap,
                jobs,
                str(folder / name),
                steps=steps,
                trace_steps=trace_steps,
                timeout_s=timeout_s,
                deadline_s=timeout_s * 3,
            )
        except RankError as err:
            if (
                err.exc_type != "OutOfMemoryError"
            ):  # under torchrun only the rank that raised has its __cause__
                raise
            return None
        return [[rank[i] for rank in per_rank] for i in range(len(jobs))]

    def ms(run: list[dict[str, Any]]) -> float:
        return max(r["median_ms"] for r in run)  # the job's step: its slowest rank's median

    found, job = [], cap.job
    runs = attempt([job], "as_handed")
    oom = runs is None
    if oom:
        found.append("oom_batch")
        share = job.global_batch // w.world_size
        fits = [
            m
            for m in range(share, 0, -1)
            if share % m == 0
            and estimate(
                model=cap.model, micro_batch=m, optimizer="adam", precision="fp32", keep_grads=m < share
            ).peak
            <= 0.9 * cap.memory_mib * _MIB
        ]
        job = dataclasses.replace(job, micro_batch=fits[0] if fits else 1)
        if (runs := attempt([job], "memory_fixed")) is None:
            raise RuntimeError(
                f"micro_batch={job.micro_batch} still runs out of {cap.memory_mib} MiB per rank"
            )
    before = ms(runs[0])
    rounds = [{"round": "as it runs", "step_ms": before}]
    seen = findings(Path(runs[0][0]["traces"]))
    for i in range(len(_KNOB_FIXES)):  # bounded: one fix per round
        first = next((d for d in seen if d.kind in _KNOB_FIXES), None)
        if first is None:
            break
        mistake, knobs = _KNOB_FIXES[first.kind]
        found.append(mistake)
        if (runs := attempt([job := dataclasses.replace(job, **knobs)], f"round{i + 1}")) is None:
            raise RuntimeError(f"the fix for {first.kind} ran out of memory: {job}")
        seen = findings(Path(runs[0][0]["traces"]))
        rounds.append({"round": f"{first.kind} fixed", "step_ms": ms(runs[0])})
    if (final := attempt([job, cap.clean], "final")) is None:
        raise RuntimeError(f"the fixed job or the clean one ran out of {cap.memory_mib} MiB per rank")
    return {
        "before": before,
        "after": ms(final[0]),
        "limit": ms(final[1]),
        "unit": "ms",
        "meaning": {
            "before": "step time of the job as it first ran (after its memory fix, if it did not fit)",
            "after": "step time with every mistake the traces pointed to fixed",
            "limit": "the same job with nothing planted, measured in the same launch as after",
        },
        "metric": "step time of a job with two or three planted mistakes, before and after finding and fixing them",
        "seed": capstone_seed,
        "oom_at_start": oom,
        "found": sorted(found),
        "rounds": rounds,
        "job_fixed": job.__dict__,
        "peak_mib": {
            "fixed": max(r["peak_mib"] for r in final[0]),
            "clean": max(r["peak_mib"] for r in final[1]),
            "memory": cap.memory_mib,
        },
    }


def main(argv: list[str] | None = None) -> int:
    return run_lab("06_capstone", headline, DEFAULTS, argv)


if __name__ == "__main__":
    from labkit.experiments import capstone  # by its own name, so launch pickles its functions by reference

    raise SystemExit(capstone.main())
