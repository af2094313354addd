"""Lab 04's driver: time pipeline-parallel steps of a GPT split into stages, and what each stage did.

`pipeline_steps` runs on every rank (launch it with `labkit.launch`, one rank per pipeline rank): for each
plan (a split, a micro-batch count, a schedule) it builds the same seeded GPT everywhere, keeps this rank's
stages of the split (`labkit.parallel.pipeline`), and runs `torch.distributed.pipelining` steps (GPipe, 1F1B
or interleaved 1F1B) with SGD, the plans taking turns step by step; it records per step the step time, the
time this rank waited, each forward and backward of each micro-batch (start and end on
`labkit.machine.timer.clock`: the virtual device clock on the emulated cluster), and the bytes it sent. It can
check the first step's gradients and loss against one process running the whole batch, and measure the peak
memory a step adds (activations in flight) on this rank. `summarize_pipeline` combines the ranks: step time,
busy and idle time per rank, the bubble next to its formula, the imbalance, and the ideal pipeline's time for
the same work (the limit). `layer_costs` measures what each layer costs
(`labkit.layer_profile.profile_layers`) on one rank."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from labkit import validate
from labkit.course.experiments.params import LabParams, ParamError, gpt_param, param, simulable_cluster
from labkit.course.experiments.script import LabRecords, Meaning, Where, main
from labkit.layer_profile import LayerProfile, profile_layers
from labkit.machine import device_memory, runtime, timer
from labkit.machine.timer import Mark
from labkit.models import GPTConfig, seeded_model, synthetic_batch
from labkit.parallel.pipeline import (
    StageLog,
    clock_stages,
    even_split,
    gpt_loss,
    layer_names,
    make_schedule,
    pipeline_stages,
)
from labkit.pipeline_plan import SCHEDULES, balance, bubble_fraction, choose_micro_batches, ideal_step_time

__all__ = [
    "Params",
    "PipelinePlan",
    "PipelineRankResult",
    "PipelineSummary",
    "headline",
    "layer_costs",
    "pipeline_steps",
    "summarize_pipeline",
]


@dataclass(frozen=True)
class PipelinePlan:
    """One way to run the pipeline: layers per stage over (embedding, blocks, head), the micro-batch count and
    the schedule ("gpipe", "1f1b" or "interleaved_1f1b": then v stages per rank)."""

    sizes: tuple[int, ...] | list[int]
    micro_batches: int
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        validate.positive_int("micro_batches", self.micro_batches, "PipelinePlan(sizes, micro_batches=8)")
        validate.one_of("schedule", self.schedule, SCHEDULES, 'PipelinePlan(sizes, 8, "1f1b")')


@dataclass
class PipelineRankResult:
    """What one pipeline rank measured. Times in ms; spans are of the last step, from its start."""

    rank: int
    stages: list[int]
    layers: list[list[str]]  # per stage held
    schedule: str
    micro_batches: int
    steps_ms: list[float]  # each measured step: schedule.step from a common start (after a barrier)
    waited_ms: list[float | None]  # of it, waiting for transfers (virtual clock only)
    spans: list[tuple[str, int, int, float, float]]  # (kind "F"/"B", stage, micro-batch, start, end)
    sent_bytes: int  # point-to-point, per step
    sends: int  # point-to-point transfers, per step
    peak_bytes: int | None = None  # memory a step adds at its peak (activations in flight, buffers)
    grad_error: float | None = None  # largest |gradient - one process's| on this rank's parameters
    loss_error: float | None = None  # last stage: |mean micro-batch loss - one process's loss|
    label: str = ""

    def busy_ms(self) -> list[float]:
        """Per step, time this rank computed: step less waiting on the virtual clock, else its spans."""
        span_ms = sum(e - s for _, _, _, s, e in self.spans)
        return [ms - w if w is not None else span_ms for ms, w in zip(self.steps_ms, self.waited_ms)]


def _timed_loss(log: StageLog, stage_index: int) -> Callable:
    """The GPT loss on the last stage, its time added to the forward span of the same micro-batch."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        start = Mark()
        out = gpt_loss(logits, targets)
        mb = sum(1 for k, s, *_ in log.spans if k == "L" and s == stage_index)
        log.spans.append(("L", stage_index, mb, start, Mark()))
        return out

    return loss


def _merge_loss(spans: list) -> list:
    """Fold each loss span into its micro-batch's forward (the head's forward includes the loss)."""
    loss = {(s, mb): e for k, s, mb, _, e in spans if k == "L"}
    return [
        (k, s, mb, a, max(b, loss.get((s, mb), b)) if k == "F" else b) for k, s, mb, a, b in spans if k != "L"
    ]


@dataclass
class _OneProcess:
    """One process's first step on the whole batch: its gradients by parameter name and its mean loss."""

    grads: dict[str, torch.Tensor]
    loss: float


def _one_process(config: GPTConfig, seed: int, global_batch: int, dev: torch.device) -> _OneProcess:
    """The reference every plan's first step is checked against: the same seeded model, step 0's batch. The
    same for every plan, so a rank computes it once, not once per plan (lab 04's notebook checks five)."""
    x, y = synthetic_batch(config, global_batch, seed=seed, step=0)
    ref = seeded_model(config, seed, dev)
    loss = ref(x.to(dev), y.to(dev))  # mean over every token = mean of the equal micro-batches' means
    loss.backward()
    return _OneProcess({n: p.grad for n, p in ref.named_parameters()}, loss.item())


def _reference_errors(
    reference: _OneProcess, model: torch.nn.Module, stages: list, losses: list
) -> tuple[float, float | None]:
    """This rank's gradients and (last stage) mean loss against one process on the whole batch."""
    held = {id(p) for st in stages for p in st.submod.parameters()}
    error = max(
        (p.grad - reference.grads[n]).abs().max().item()
        for n, p in model.named_parameters()
        if id(p) in held and p.grad is not None
    )
    loss_error = abs(float(torch.stack(losses).detach().mean()) - reference.loss) if losses else None
    return error, loss_error


class _Pipeline:
    """One plan on this rank: its own seeded model, stages, schedule, optimizer and what it measured."""

    def __init__(
        self,
        config: GPTConfig,
        plan: PipelinePlan,
        global_batch: int,
        lr: float,
        seed: int,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        if global_batch % plan.micro_batches:
            m = plan.micro_batches
            raise ValueError(
                f"global_batch={global_batch} must divide into micro_batches={m} equal "
                f"micro-batches; e.g. global_batch={m * max(1, global_batch // m)}"
            )
        self.config, self.global_batch, self.seed, self.group = config, global_batch, seed, process_group
        self.dev = runtime.device()
        self.model = seeded_model(config, seed, self.dev)
        self.stages = pipeline_stages(self.model, list(plan.sizes), process_group, self.dev)
        self.log = clock_stages(self.stages)
        last = [st for st in self.stages if st.is_last]
        loss = _timed_loss(self.log, last[0].stage_index) if last else gpt_loss
        self.schedule = make_schedule(self.stages, plan.schedule, plan.micro_batches, loss)
        params = [p for st in self.stages for p in st.submod.parameters()]
        self.opt = torch.optim.SGD(params, lr=lr, **runtime.optimizer_options())
        names = layer_names(config)
        starts = [sum(plan.sizes[:k]) for k in range(len(plan.sizes) + 1)]
        cluster = runtime.current_cluster()
        self.result = PipelineRankResult(
            dist.get_rank(process_group),
            [st.stage_index for st in self.stages],
            [names[starts[k] : starts[k + 1]] for k in (st.stage_index for st in self.stages)],
            plan.schedule,
            plan.micro_batches,
            [],
            [],
            [],
            0,
            0,
            label=cluster.label if cluster else "",
        )

    def forward_backward(self, step: int) -> list:
        x, y = synthetic_batch(self.config, self.global_batch, seed=self.seed, step=step, device=self.dev)
        losses: list = []
        self.opt.zero_grad(set_to_none=False)
        # return_outputs=False: merging every micro-batch's logits into one tensor is not training work
        kwargs: dict[str, Any] = {"return_outputs": False}
        if any(st.is_last for st in self.stages):
            kwargs.update(target=y, losses=losses)
        if any(st.is_first for st in self.stages):
            self.schedule.step(x, **kwargs)
        else:
            self.schedule.step(**kwargs)
        return losses

    def timed_step(self, step: int, measured: bool, reference: _OneProcess | None) -> None:
        """One step; its time kept if `measured`; its gradients checked against `reference` if given."""
        self.log.clear()
        dist.barrier(group=self.group)  # a common start: the pipeline's step time is its last rank's end
        w0 = timer.waited()
        start = Mark()
        losses = self.forward_backward(step)
        ms = Mark().ms_since(start)
        waited = (timer.waited() - w0) * 1e3 if w0 is not None else None
        r = self.result
        if reference is not None:
            r.grad_error, r.loss_error = _reference_errors(reference, self.model, self.stages, losses)
        self.opt.step()
        if measured:
            r.steps_ms.append(ms)
            r.waited_ms.append(waited)
            spans = [(k, st, mb, a.ms_since(start), b.ms_since(start)) for k, st, mb, a, b in self.log.spans]
            r.spans = _merge_loss(spans)
            r.sends, r.sent_bytes = self.log.sends, self.log.sent_bytes


def pipeline_steps(
    config: GPTConfig,
    plans: Sequence[PipelinePlan],
    *,
    global_batch: int = 16,
    steps: int = 3,
    warmup: int = 1,
    lr: float = 0.1,
    seed: int = 0,
    check: bool = False,
    measure_memory: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> list[PipelineRankResult]:
    """Train pipeline steps of `GPT(config)` under each plan, interleaved step by step; every rank calls it.

    One stage per rank, or v per rank for "interleaved_1f1b". Each plan trains its own copy of the same seeded
    model with SGD; step s of every plan trains on `synthetic_batch(config, global_batch, seed=seed, step=s)`
    cut into equal micro-batches. The plans take turns step by step, so a slow moment of the machine hits all
    of them rather than one. `check`: compare each plan's first step with one process on the whole batch.
    `measure_memory`: one more step per plan, measured for the peak memory it adds
    (`labkit.machine.device_memory.step_peak`). Returns this rank's result for each plan, in order.
    """
    validate.positive_int("steps", steps, "pipeline_steps(..., steps=3)")
    validate.non_negative_int("warmup", warmup, "pipeline_steps(..., warmup=1)")
    if not plans:
        raise ValueError("pipeline_steps needs at least one plan: [PipelinePlan(sizes, micro_batches), ...]")
    runs = [_Pipeline(config, plan, global_batch, lr, seed, process_group) for plan in plans]
    check = check and not runtime.on_simulated()  # a simulated machine computes no values to check
    reference = _one_process(config, seed, global_batch, runtime.device()) if check else None
    for step in range(warmup + steps):
        for run in runs:
            run.timed_step(step, measured=step >= warmup, reference=reference)
        reference = None  # step 0 is checked; its gradients are not kept through the later steps
    if measure_memory:
        for run in runs:
            dist.barrier(group=process_group)
            _, peak = device_memory.step_peak(lambda run=run: run.forward_backward(warmup + steps))
            run.result.peak_bytes = peak.added_bytes
    return [run.result for run in runs]


@dataclass
class PipelineSummary:
    """The ranks of one pipeline run combined (ms; the median over measured steps)."""

    schedule: str
    sizes: list[int]
    micro_batches: int
    chunks: int  # stages per rank (v)
    step_ms: float  # the slowest rank's end
    busy_ms: list[float]  # per rank
    idle_ms: list[float]  # per rank: step_ms - busy
    bubble: float  # measured: mean idle / step
    bubble_formula: float  # labkit.pipeline_plan.bubble_fraction
    imbalance: float  # max busy / mean busy
    limit_ms: float  # the same work on a perfectly balanced ideal pipeline of this schedule
    peak_bytes: list[int | None]
    grad_error: float | None
    loss_error: float | None
    spans: list[list[tuple[str, int, int, float, float]]]  # per rank, the last step
    layers: list[list[str]]  # per stage
    sent_bytes: list[int]
    sends: list[int]
    label: str = ""
    steps_ms: list[float] = field(default_factory=list)  # each step: its slowest rank's end

    @property
    def ranks(self) -> int:
        return len(self.busy_ms)

    @property
    def stage_ms(self) -> list[float]:
        """Each rank's compute per micro-batch (forward + backward of all it holds)."""
        return [b / self.micro_batches for b in self.busy_ms]


def summarize_pipeline(results: Sequence[PipelineRankResult]) -> PipelineSummary:
    """Combine `pipeline_steps`'s results (rank order) into step, busy, idle, bubble, imbalance, limit."""
    if not results:
        raise ValueError("summarize_pipeline needs the ranks' results: labkit.launch(pipeline_steps, ...)")
    p, m = len(results), results[0].micro_batches
    n_stages = sum(len(r.stages) for r in results)
    v = n_stages // p
    schedule = results[0].schedule
    busy_by_step = list(zip(*(r.busy_ms() for r in results)))  # [step][rank]
    steps = [max(r.steps_ms[i] for r in results) for i in range(len(busy_by_step))]

    def limit_of(busy: Sequence[float]) -> float:
        # The ideal: every rank's work per micro-batch the mean, fill and drain (p-1)/v micro-batch slots.
        per_mb = [b / m for b in busy]
        return (
            sum(per_mb) / p * (m + (p - 1) / v)
            if schedule == "interleaved_1f1b"
            else ideal_step_time(per_mb, m)
        )

    # Each measure is taken step by step (the ranks' busy times of one step go with that step's end), then
    # the median over steps: a slow moment of the host in one step does not mix with another step's numbers.
    med = statistics.median
    bubble = med(sum(t - b for b in busy) / (p * t) for t, busy in zip(steps, busy_by_step))
    imbalance = med(max(busy) / (sum(busy) / p) for busy in busy_by_step)
    limit = med(limit_of(busy) for busy in busy_by_step)
    step = med(steps)
    busy = [med(col) for col in zip(*busy_by_step)]
    idle = [step - b for b in busy]
    layers: list[list[str]] = [[] for _ in range(n_stages)]
    for r in results:
        for s, names in zip(r.stages, r.layers):
            layers[s] = names
    errors = [r.grad_error for r in results if r.grad_error is not None]
    loss_errors = [r.loss_error for r in results if r.loss_error is not None]
    return PipelineSummary(
        schedule=schedule,
        sizes=[len(x) for x in layers],
        micro_batches=m,
        chunks=v,
        step_ms=step,
        busy_ms=busy,
        idle_ms=idle,
        bubble=bubble,
        bubble_formula=bubble_fraction(p, m, schedule, v),
        imbalance=imbalance,
        limit_ms=limit,
        peak_bytes=[r.peak_bytes for r in results],
        grad_error=max(errors) if errors else None,
        loss_error=max(loss_errors) if loss_errors else None,
        spans=[r.spans for r in results],
        layers=layers,
        sent_bytes=[r.sent_bytes for r in results],
        sends=[r.sends for r in results],
        label=results[0].label,
        steps_ms=steps,
    )


def layer_costs(
    config: GPTConfig, micro_batch: int, *, seed: int = 0, repeats: int = 5
) -> list[LayerProfile]:
    """On one rank: `profile_layers` of the seeded GPT on a micro-batch of `micro_batch` sequences,
    on this rank's device (one thread on the emulated cluster, as every emulated GPU computes). A simulated
    GPU's step repeats exactly (each operator's modelled time), so there one pass is timed, unwarmed."""
    validate.positive_int("micro_batch", micro_batch, "layer_costs(config, micro_batch=2)")
    dev = runtime.device()
    model = seeded_model(config, seed, dev)
    x, y = synthetic_batch(config, micro_batch, seed=seed, device=dev)
    if runtime.on_simulated():
        return profile_layers(model, x, y, repeats=1, warmup=0)
    return profile_layers(model, x, y, repeats=repeats)


# ----------------------------------------------------------------- as a script
# (labkit.course.experiments.script)


@dataclass(frozen=True)
class Params(LabParams):
    """Lab 04's parameters."""

    cluster: str = simulable_cluster()

    stages: int = param(4, "pipeline ranks p, one stage each (2 on a node with two GPUs)", minimum=2)
    n_layers: int = gpt_param("n_layers", 24)
    d_model: int = gpt_param("d_model", 64)
    vocab_size: int = gpt_param(
        "vocab_size", 8192, "a large one: the LM head (and the embedding's gradient) is heavy"
    )
    seq_len: int = gpt_param("seq_len", 64)
    global_batch: int = param(
        32, "sequences per step (the whole batch: no data parallelism in this lab)", minimum=1
    )
    few_micro_batches: int | None = param(
        None, "micro-batches of the naive run (None: p, the fewest 1F1B accepts)", minimum=1, example=4
    )
    max_bubble: float = param(
        0.3, "the bubble you are willing to pay, as a fraction of the step", minimum=0, strict=True
    )
    activation_mib: float = param(
        64, "memory per rank for activations in flight (bounds the micro-batch count)", minimum=0, strict=True
    )
    steps: int = param(3, "timed steps per run (medians are reported)", minimum=1)
    warmup: int = param(1, "untimed steps first", minimum=0)
    interleaved: bool = param(True, "also run the interleaved 1F1B schedule (2 chunks per rank)")

    GPT_FIXED = {"n_heads": 4}
    # On GPUs at d_model 64 every layer is launch-bound: the head costs about one block, more micro-batches
    # only cost more, and the fix slows the step (labkit.course.forecast.pipeline_forecast: after/before 1.6
    # on 4 stages). A 1024-wide model with a 32 K vocabulary makes the head a few blocks' work and each block
    # compute-bound: after/before 0.69 on 4 stages and 0.58 on 8 of a DGX H100
    # (tests/course/test_forecast.py); on 2 stages the imbalance is too small to show (0.81), and the notebook
    # says so
    GPU_SIZES = {
        "n_layers": 16,
        "d_model": 1024,
        "vocab_size": 32768,
        "seq_len": 128,
        "global_batch": 64,
        "activation_mib": 16384,
    }
    LAB = "04_imbalanced_pipeline"
    RANKS_WHY = (
        "a stage per rank, as many as its forecast shows the lesson on (DGX H100, GPU sizes: 8 stages x0.58, "
        "4 x0.69, 2 x0.81 too little); under 4 GPUs 4 emulated stages, the layers also profiled on a GPU"
    )
    RANKS = "stages"
    NOTEBOOK_SIMULATED = True  # its gradients are checked on the emulated cluster, the rest runs there
    TEST = {"cluster": "cpu"}
    SMOKE = {"n_layers": 4, "d_model": 32, "vocab_size": 1024, "seq_len": 16, "global_batch": 8, "steps": 1}

    @classmethod
    def ranks_on(cls, gpus: int) -> int | None:
        # The stage counts the forecast shows the lesson on at the GPU sizes
        # (tests/course/experiments/test_params.py pins it): 4 and 8; 8 the most (the head is a larger share
        # of a shorter stage), 2 too little, 16 not at all (one block a stage: the head's stage alone sets the
        # pace, after/limit 1.65). The naive run takes one micro-batch per stage, which must divide
        # global_batch (32, 64 on GPUs): powers of two
        if gpus >= 8:
            return 8
        return 4 if gpus >= 4 else None

    def check(self) -> None:
        self.check_multiple("d_model", 4, "the lab's GPT has 4 attention heads")
        self.check_at_least("n_layers", self.stages, "stages", "every stage holds a block")

    def resolve(self, *, on_gpu: bool = False) -> Params:
        p = self.gpu_sized(on_gpu)
        if p.few_micro_batches is None:  # one micro-batch per stage: the stages must divide the batch
            if p.global_batch % p.stages:
                fits = [s for s in (2, 4, 8, 16) if p.global_batch % s == 0 and s <= p.n_layers]
                raise ParamError(
                    "stages",
                    p.stages,
                    f"a divisor of global_batch={p.global_batch} (the naive run takes one micro-batch per "
                    f"stage, few_micro_batches defaults to stages): "
                    f"{', '.join(map(str, fits)) or 'none here'}",
                    min(fits, key=lambda s: abs(s - p.stages)) if fits else p.global_batch,
                )
            p = replace(p, few_micro_batches=p.stages)
        p.check_at_least(
            "few_micro_batches", p.stages, "stages", "1F1B needs a micro-batch in flight on every stage"
        )
        if p.global_batch % p.few_micro_batches:
            raise ParamError(
                "global_batch",
                p.global_batch,
                f"a multiple of few_micro_batches={p.few_micro_batches}",
                p.few_micro_batches * max(1, p.global_batch // p.few_micro_batches),
            )
        return p



def headline(w: Where, p: Params) -> LabRecords:
    """Lab 04's records: 1F1B over one stage per rank, split by layer count with few micro-batches, then split
    by measured layer cost (`labkit.pipeline_plan.balance`) with the micro-batches the bubble and the
    activation memory allow; the limit is the same work perfectly balanced under GPipe or 1F1B, mean stage
    cost x (m + p - 1) (interleaved and zero-bubble schedules have a lower ideal)."""
    config = p.config()
    stages = w.world_size
    one = profile_layers(seeded_model(config), *synthetic_batch(config, 1), repeats=1)  # sizes only
    m = choose_micro_batches(
        stages,
        p.global_batch,
        p.max_bubble,
        "1f1b",
        memory_bytes=p.activation_mib * 2**20,
        activation_bytes_per_sample=sum(layer.activation_bytes for layer in one) / stages,
    )
    # Every rank profiles (they share the machine as in the run); rank 0's costs, gathered, split on every
    # rank. Simulated GPUs share nothing and every one is the same: one rank profiles.
    profiling = 1 if w.simulated else w.world_size
    costs = [
        layer.ms
        for layer in w.launch(
            layer_costs, config, p.global_batch // m, world_size=profiling, timeout_s=p.timeout_s
        )[0]
    ]
    naive, balanced = even_split(config, stages), balance(costs, stages)
    plans = [PipelinePlan(naive, p.few_micro_batches), PipelinePlan(balanced, m)]
    per_rank = w.launch(
        pipeline_steps,
        config,
        plans,
        global_batch=p.global_batch,
        steps=p.steps,
        warmup=p.warmup,
        check=True,
        timeout_s=p.timeout_s,
        deadline_s=p.timeout_s * 4,
    )
    before, after = (summarize_pipeline([rank[i] for rank in per_rank]) for i in range(2))
    return LabRecords(
        before.step_ms,
        after.step_ms,
        after.limit_ms,
        "ms",
        Meaning(
            before=f"1F1B step, {stages} stages split by layer count, {p.few_micro_batches} micro-batches",
            after=f"1F1B step, stages balanced by measured layer cost, {m} micro-batches",
            limit="the same run's work perfectly balanced under GPipe or 1F1B: mean stage cost per "
            "micro-batch x (m + p - 1)",
        ),
        "pipeline step time: split by layer count vs balanced by measured cost",
        {
            "sizes_before": naive,
            "sizes_after": balanced,
            "micro_batches": m,
            "stage_ms_before": before.stage_ms,
            "stage_ms_after": after.stage_ms,
            "imbalance_before": before.imbalance,
            "imbalance_after": after.imbalance,
            "bubble_measured": after.bubble,
            "bubble_formula": after.bubble_formula,
            # None on a simulated machine, which computes no values
            "max_abs_diff": None if w.simulated else max(before.grad_error, after.grad_error),
        },
    )


if __name__ == "__main__":
    main(__spec__.name)
