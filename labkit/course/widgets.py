"""Calculators for the notebooks: GPU memory (`labkit.memory.estimate`) and pipeline schedules, with static
fallbacks.

`memory_figure(config, card_gib, ...)` draws one GPU's memory as a stacked bar (weights, gradients, optimizer
states, activations, temporaries) next to the card's capacity and the estimate's peak, for a model under a
dp x tp x pp layout with a ZeRO stage, a precision, a micro-batch and activation checkpointing.
`MemoryCalculator` puts sliders and presets (published model sizes, common cards) in front of it, redrawing on
every change; `memory_calculator()` shows it in JupyterLab and the static figure where widgets cannot render
(papermill, `labkit run`: `LABKIT_TEXT_ONLY`, see `widgets_can_render`). `pipeline_figure(p, m, schedule, v)`
draws the ideal schedule `labkit.schedules.simulate` runs (a Gantt chart per rank, with the bubble against its
formula and the activations in flight); `pipeline_explorer()` puts sliders in front of it.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # torch is imported on first use, so `labkit quiz` starts fast
    from labkit.memory import MemoryBreakdown
    from labkit.models import GPTConfig

__all__ = [
    "CARDS",
    "TEXT_ONLY_ENV",
    "AtPeak",
    "MemoryCalculator",
    "at_peak",
    "displayed",
    "memory_calculator",
    "memory_figure",
    "pipeline_explorer",
    "pipeline_figure",
    "widgets_can_render",
]

TEXT_ONLY_ENV = "LABKIT_TEXT_ONLY"


def widgets_can_render() -> bool:
    """True in a Jupyter kernel a browser looks at; False in a terminal, and where `LABKIT_TEXT_ONLY` is set
    (`labkit run`, `labkit grade` and the tests set it for papermill's kernels: a widget in an executed
    notebook file is an empty box)."""
    if os.environ.get(TEXT_ONLY_ENV):
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


def displayed(widget: Any) -> Any:
    """Show `widget` in the cell's output now and return it. A cell shows only its last expression, and
    none when the line ends with `;` (as the labs' lines do, so that the text and figure forms are not
    echoed): a widget that is only returned would not show at all, or only the last of a cell's two."""
    from IPython.display import display

    display(widget)
    return widget


# Memory per card in GiB as the datasheets give it (A100 40/80 GB, H100 SXM 80 GB, H200 141 GB, L40S 48 GB,
# RTX 4090 24 GB); the allocator and the CUDA context take some of it, which the 10 % line stands for.
CARDS: dict[str, float] = {
    "A100 40GB": 40.0,
    "A100 80GB": 80.0,
    "H100 80GB": 80.0,
    "H200 141GB": 141.0,
    "L40S 48GB": 48.0,
    "RTX 4090 24GB": 24.0,
}
_PARTS = (
    ("params", "weights", "tab:blue"),
    ("grads", "gradients", "tab:orange"),
    ("optimizer", "optimizer states", "tab:green"),
    ("activations", "activations", "tab:red"),
    ("other", "temporaries", "tab:gray"),
)
# At the peak of backward with activation checkpointing: parts of several categories (see `at_peak`).
_RECOMPUTED = ("backward", "backward with recomputation", "silver")
_GIB = 2**30


def breakdown(
    config: GPTConfig,
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    zero_stage: int = 0,
    precision: str = "mixed",
    micro_batch: int = 1,
    seq_len: int | None = None,
    checkpointing: bool = False,
    micro_batches: int = 1,
) -> MemoryBreakdown:
    """`estimate` for one GPU of the layout; gradients live through the step when it has several
    micro-batches."""
    from labkit.memory import estimate

    return estimate(
        model=config,
        dp=dp,
        tp=tp,
        pp=pp,
        zero_stage=zero_stage,
        precision=precision,
        micro_batch=micro_batch,
        seq_len=seq_len,
        checkpointing=checkpointing,
        micro_batches=micro_batches if pp > 1 else None,
        keep_grads=micro_batches > 1,
    )


class AtPeak(NamedTuple):
    """What an estimate holds at its peak: `alive`, (part, bytes) pairs that sum to the peak (a part of
    `_PARTS`, or "backward" for backward's mix with checkpointing); `when` that is; `note`, one sentence that
    compares the parts' sum with the peak and says why they differ."""

    alive: tuple[tuple[str, int], ...]
    when: str
    note: str


def at_peak(b: MemoryBreakdown, *, grads_kept: bool = False) -> AtPeak:
    """What estimate `b` holds at its peak, at the moment the estimate says (`b.peak_at`, one of
    `labkit.memory.PEAK_MOMENTS`): the weights and optimizer states live through the step, and so do the
    gradients when they are kept (`grads_kept`: several micro-batches add into them); the rest is what that
    moment holds. So the bar of all parts (`b.total`) stands above the peak by what never coexists."""
    from labkit.memory import PEAK_MOMENTS

    if b.peak_at not in PEAK_MOMENTS:
        raise ValueError(
            "at_peak needs an estimate (labkit.memory.estimate), which says when it peaks; "
            f"{b.source or 'this breakdown'} has peak_at={b.peak_at!r}"
        )
    steady = {"params": b.params, "optimizer": b.optimizer} | ({"grads": b.grads} if grads_kept else {})
    rest = int(b.peak) - sum(steady.values())  # type: ignore[arg-type]
    when, what = PEAK_MOMENTS[b.peak_at].split(": ", 1)
    if b.peak_at == "backward":
        alive = {**steady, "activations": rest - b.other, "other": b.other}
        if grads_kept:
            what = "every activation and the loss temporaries, and the gradients earlier micro-batches added"
    elif b.peak_at == "optimizer":
        alive = {**steady, "grads": b.grads}
    else:
        alive = {**steady, _RECOMPUTED[0]: rest}
    order = [key for key, _, _ in _PARTS] + [_RECOMPUTED[0]]
    alive_parts = tuple((key, alive[key]) for key in order if alive.get(key, 0) > 0)
    total, peak = b.total / _GIB, int(b.peak) / _GIB  # type: ignore[arg-type]
    when = f"at {when}" if b.peak_at != "recomputation" else "in backward, with recomputation"
    if b.peak < b.total:
        note = (
            f"The parts sum to {total:.1f} GiB, but not all are alive at once: the peak is {peak:.1f} GiB, "
            f"{when} ({what})."
        )
    elif b.peak == b.total:
        note = f"All parts are alive at once: the peak is their sum, {peak:.1f} GiB, {when} ({what})."
    else:
        note = (
            f"The peak, {peak:.1f} GiB, is above the parts' sum ({total:.1f} GiB): {when} ({what}), "
            "backward's temporaries belong to no part."
        )
    return AtPeak(alive_parts, when, note)


def _grads_kept(options: dict[str, Any]) -> bool:
    """Whether `breakdown(config, **options)` keeps the gradients through the step (as it decides)."""
    return options.get("micro_batches", 1) > 1


def memory_figure(config: GPTConfig, card_gib: float, *, title: str = "", **options):
    """One GPU's estimated memory: a stacked bar of what is alive at the estimate's peak, one of every part
    at its largest (their sum, when that differs from the peak), the card's capacity and a note on why the
    two bars differ (`at_peak`); returns the Figure."""
    b = breakdown(config, **options)
    return _figure(
        b,
        at_peak(b, grads_kept=_grads_kept(options)),
        card_gib,
        title,
    )


def _figure(b: MemoryBreakdown, peak_parts: AtPeak, card_gib: float, title: str = ""):
    """`memory_figure` of the estimate `b` (patches named by `gid`: "at peak: <part>", "parts: <part>"; the
    note's text is "peak note")."""
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    style = {key: (name, color) for key, name, color in (*_PARTS, _RECOMPUTED)}
    fig, ax = plt.subplots(figsize=(7.4, 4.7))
    peak, total = int(b.peak) / _GIB, b.total / _GIB  # type: ignore[arg-type]
    bars = [(f"alive at the peak ({peak_parts.when})", peak_parts.alive, 1.0, "at peak")]
    if b.peak != b.total:
        parts = tuple((key, getattr(b, key)) for key, _, _ in _PARTS if getattr(b, key) > 0)
        label = f"every part at its largest (sum {total:.1f} GiB, not all at once)"
        bars.append((label, parts, 0.45, "parts"))
    for x, (_, segments, alpha, gid) in enumerate(bars):
        bottom = 0.0
        for key, value in segments:
            color = style[key][1]
            ax.bar(
                x,
                value / _GIB,
                bottom=bottom,
                width=0.6,
                color=color,
                alpha=alpha,
                gid=f"{gid}: {key}",
                hatch="//" if key == _RECOMPUTED[0] else None,
                edgecolor="white",
            )
            bottom += value / _GIB
    ax.set_xticks(range(len(bars)), [textwrap.fill(label, 26) for label, *_ in bars], fontsize=8)
    ax.set_xlim(*((-0.6, 1.6) if len(bars) > 1 else (-1.0, 1.0)))
    alive = dict(peak_parts.alive)
    shown = {key: getattr(b, key) for key, _, _ in _PARTS} | {_RECOMPUTED[0]: alive.get(_RECOMPUTED[0], 0)}
    absent = "" if _RECOMPUTED[0] in alive else " (not at the peak)"  # a mix holds some of every part
    handles = [
        Patch(
            color=style[key][1],
            hatch="//" if key == _RECOMPUTED[0] else None,
            label=f"{style[key][0]} {value / _GIB:.1f} GiB{'' if key in alive else absent}",
        )
        for key, value in shown.items()
        if value > 0
    ]
    handles.append(ax.axhline(peak, color="black", lw=1.2, label=f"peak {peak:.1f} GiB"))
    handles.append(ax.axhline(card_gib, color="firebrick", ls="--", lw=1.5, label=f"card {card_gib:g} GiB"))
    handles.append(ax.axhline(0.9 * card_gib, color="firebrick", ls=":", lw=1, label="90 % of the card"))
    fits = b.peak <= 0.9 * card_gib * _GIB
    ax.set(
        ylabel="GiB",
        ylim=(0, max(total, peak, card_gib) * 1.15),
        title=title or f"{'fits' if fits else 'does not fit'}: peak {peak:.1f} of {card_gib:g} GiB",
    )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.text(0.01, 0.01, textwrap.fill(peak_parts.note, 120), fontsize=8, va="bottom", gid="peak note")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    return fig


# Controls that give the model its shape: a preset sets them, and moving one makes a custom model from it.
_SHAPE = ("n_layers", "d_model")
# Wide enough for every description ("sequence length", "micro-batches") in JupyterLab's font; the browser
# test checks that none is cut off.
_DESCRIPTION = {"description_width": "8.5em"}


def _model_config(base: GPTConfig, n_layers: int, d_model: int, seq_len: int) -> GPTConfig:
    """`base` with `n_layers` blocks and width `d_model`, its position table long enough for `seq_len`: a new
    width keeps the head size where it divides the width (else their common divisor), the MLP's ratio to the
    width and the k/v heads where they still divide the heads."""
    if d_model != base.d_model:
        heads = d_model // math.gcd(d_model, base.head_dim)
        kv_heads = base.n_kv_heads if base.n_kv_heads and heads % base.n_kv_heads == 0 else None
        ffn = base.ffn_hidden and 64 * max(1, round(base.ffn_hidden * d_model / base.d_model / 64))
        base = replace(base, d_model=d_model, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden=ffn)
    return replace(base, n_layers=n_layers, seq_len=max(base.seq_len, seq_len))


def _start(model: str) -> GPTConfig:
    """The model a calculator shows for `model`: the preset, or for "custom" a 24-layer model of width 2048
    (16 heads of 128) for sequences of 2048."""
    from labkit.models import PRESETS, GPTConfig

    if model == "custom":
        return GPTConfig(n_layers=24, d_model=2048, n_heads=16, vocab_size=32000, seq_len=2048)
    if model not in PRESETS:
        raise ValueError(f"model={model!r}: use one of {', '.join(sorted(PRESETS))} or 'custom'")
    return PRESETS[model]


class MemoryCalculator:
    """Sliders and presets over `memory_figure`; `controls` by name, `breakdown` the last estimate, `error`
    the last refusal (a tp that does not divide the heads, ...), `widget` to display.

    Choosing a preset sets the shape sliders (layers, hidden) and the sequence length to its values, then
    redraws once; moving a shape slider while a preset is chosen makes the model "custom": the preset with
    that slider's value (`config`). The sequence length is the run's, so moving it keeps the model."""

    def __init__(self, model: str = "llama2-7b", card: str = "H100 80GB", **options: Any) -> None:
        import ipywidgets as w

        from labkit.models import PRESETS

        self._base = _start(model)  # what a custom model starts from: the last preset shown
        self._from = "" if model == "custom" else model
        self._held = False
        self.output = w.Output()
        self.message = w.HTML(layout=w.Layout(max_width="46em"))
        sizes = [1, 2, 4, 8, 16, 32, 64]
        widths = sorted({512, 1024, 2048, 4096, 8192, 12288} | {c.d_model for c in PRESETS.values()})
        labelled = {"style": _DESCRIPTION, "layout": w.Layout(width="22em")}
        self.controls = {
            "model": w.Dropdown(
                options=[*sorted(PRESETS), "custom"], value=model, description="model", **labelled
            ),
            "n_layers": w.IntSlider(
                value=self._base.n_layers, min=1, max=128, description="layers", **labelled
            ),
            "d_model": w.SelectionSlider(
                options=widths, value=self._base.d_model, description="hidden", **labelled
            ),
            "card": w.Dropdown(options=list(CARDS), value=card, description="card", **labelled),
            "seq_len": w.SelectionSlider(
                options=[512, 1024, 2048, 4096, 8192],
                value=self._base.seq_len,
                description="sequence length",
                **labelled,
            ),
            "micro_batch": w.SelectionSlider(
                options=sizes[:6], value=1, description="micro-batch", **labelled
            ),
            "micro_batches": w.SelectionSlider(
                options=sizes, value=1, description="micro-batches", **labelled
            ),
            "precision": w.Dropdown(
                options=["mixed", "mixed_fp32_grads", "bf16", "fp32"],
                value="mixed",
                description="precision",
                **labelled,
            ),
            "zero_stage": w.ToggleButtons(
                options=[0, 1, 2, 3],
                value=0,
                description="ZeRO",
                style=_DESCRIPTION | {"button_width": "3em"},
            ),
            "dp": w.SelectionSlider(options=sizes, value=8, description="dp", **labelled),
            "tp": w.SelectionSlider(options=sizes[:5], value=1, description="tp", **labelled),
            "pp": w.SelectionSlider(options=sizes[:6], value=1, description="pp", **labelled),
            "checkpointing": w.Checkbox(
                value=False,
                description="activation checkpointing",
                indent=False,
                layout=w.Layout(width="22em"),
            ),
        }
        unknown = sorted(set(options) - set(self.controls))
        if unknown:
            raise ValueError(
                f"memory_calculator(..., {unknown[0]}=...): not a control; the controls are "
                f"{', '.join(self.controls)}"
            )
        self.breakdown: MemoryBreakdown | None = None
        self.at_peak: AtPeak | None = None
        self.error = ""
        for c in self.controls.values():
            c.observe(self._changed, names="value")
        with self._hold():  # the notebook's arguments are where the controls start
            for name, value in options.items():
                self.controls[name].value = value
            if any(getattr(self._base, k) != self.controls[k].value for k in _SHAPE) and model != "custom":
                self.controls["model"].value = "custom"
        # The controls keep their width (squeezed, they cut labels and readouts); the figure shrinks.
        controls = w.VBox(list(self.controls.values()), layout=w.Layout(flex="0 0 auto", width="23em"))
        figure = w.VBox([self.output, self.message], layout=w.Layout(flex="1 1 auto", min_width="0"))
        self.widget = w.HBox([controls, figure])
        self.update()

    @contextmanager
    def _hold(self) -> Iterator[None]:
        """Set controls without a redraw each (and in one message to the browser); the caller redraws once."""
        with ExitStack() as stack:
            for c in self.controls.values():
                stack.enter_context(c.hold_sync())
            held, self._held = self._held, True
            try:
                yield
            finally:
                self._held = held

    def _changed(self, change: Any) -> None:
        if self._held:
            return
        name = next(k for k, c in self.controls.items() if c is change.owner)
        if name == "model" and change.new != "custom":
            self.show_model(change.new)
            return
        if name in _SHAPE and self.controls["model"].value != "custom":
            with self._hold():
                self.controls["model"].value = "custom"  # a custom model from the preset shown
        self.update()

    def show_model(self, name: str) -> None:
        """Show preset `name`: its values on the shape sliders and the sequence length, then one redraw."""
        self._base, self._from = _start(name), name
        with self._hold():
            self.controls["model"].value = name
            for key in (*_SHAPE, "seq_len"):
                self.controls[key].value = getattr(self._base, key)
        self.update()

    def config(self) -> GPTConfig:
        """The model estimated: the preset chosen, or the custom model (the last preset shown, or the default
        custom model, with the shape sliders' values); its position table holds the sequence length."""
        v = {k: c.value for k, c in self.controls.items()}
        base = self._base if v["model"] == "custom" else _start(v["model"])
        if v["model"] != "custom":
            return replace(base, seq_len=max(base.seq_len, v["seq_len"]))
        return _model_config(base, v["n_layers"], v["d_model"], v["seq_len"])

    def _name(self, config: GPTConfig) -> str:
        model = self.controls["model"].value
        if model != "custom":
            return model
        origin = f", from {self._from}" if self._from else ""
        return f"custom ({config.n_layers} layers, hidden {config.d_model}, {config.n_heads} heads{origin})"

    def update(self) -> None:
        """Estimate what the controls say and redraw the figure and the text."""
        import matplotlib.pyplot as plt
        from IPython.display import display

        v = {k: c.value for k, c in self.controls.items()}
        options = {k: v[k] for k in _ESTIMATE_OPTIONS}
        try:
            config = self.config()
            self.breakdown = breakdown(config, **options)
            self.error = ""
        except ValueError as exc:
            self.breakdown, self.at_peak, self.error = None, None, str(exc)
        self.output.clear_output(wait=True)
        if self.breakdown is None:
            self.message.value = f"<span style='color:firebrick'>{html.escape(self.error)}</span>"
            return
        b, cap = self.breakdown, CARDS[v["card"]]
        self.at_peak = at_peak(b, grads_kept=_grads_kept(options))
        sizes = ((name, getattr(b, key) / _GIB) for key, name, _ in _PARTS if getattr(b, key))
        parts = ", ".join(f"{name} {gib:.1f}" for name, gib in sizes)
        fits = b.peak <= 0.9 * cap * _GIB
        self.message.value = html.escape(
            f"{self._name(config)}: {config.num_params() / 1e9:.2f} B parameters; per GPU: {parts} GiB. "
            f"{self.at_peak.note} It {'fits' if fits else 'does not fit'} the {v['card']}: the peak is "
            f"{'within' if fits else 'above'} 90 % of its {cap:g} GiB."
        )
        fig = _figure(b, self.at_peak, cap)
        with self.output:
            display(fig)
        plt.close(fig)  # displayed once, in the output widget, and not again at the cell's end


# The controls that are `breakdown`'s options (the others choose the model and the card).
_ESTIMATE_OPTIONS = (
    "dp",
    "tp",
    "pp",
    "zero_stage",
    "precision",
    "micro_batch",
    "seq_len",
    "checkpointing",
    "micro_batches",
)


def memory_calculator(
    model: str = "llama2-7b", card: str = "H100 80GB", widgets: bool | None = None, **options
):
    """The calculator in JupyterLab, its controls starting at `options`; under papermill or in a terminal the
    static figure of `model` on `card` with `options` (dp, tp, pp, zero_stage, precision, micro_batch,
    seq_len, checkpointing, micro_batches; n_layers and d_model make a custom model from `model`, as the
    sliders do)."""
    if widgets_can_render() if widgets is None else widgets:
        return displayed(MemoryCalculator(model, card, **options).widget)
    base = _start(model)
    shape = [options.pop(key, getattr(base, key)) for key in _SHAPE]
    config = _model_config(base, *shape, options.get("seq_len") or base.seq_len)
    return memory_figure(config, CARDS[card], **options)


def pipeline_figure(p: int = 4, m: int = 8, schedule: str = "1f1b", v: int = 2):
    """The ideal schedule as a Gantt chart: simulated bubble next to the formula, activations in flight."""
    from labkit.pipeline_plan import bubble_fraction
    from labkit.schedules import simulate
    from labkit.trace.plots import plot_pipeline

    sim = simulate(schedule, p, m, v)
    formula = bubble_fraction(p, m, schedule, sim.chunks)
    title = (
        f"{schedule}, p={p}, m={m}"
        + (f", v={sim.chunks}" if schedule == "interleaved_1f1b" else "")
        + f": bubble {sim.bubble:.1%} (formula {formula:.1%}); rank 0 holds {sim.in_flight[0]:g} "
        "micro-batches of activations"
    )
    return plot_pipeline(sim.spans, sim.step, title=title)


def pipeline_explorer(
    p: int = 4, m: int = 8, schedule: str = "1f1b", v: int = 2, widgets: bool | None = None
):
    """Sliders for p, m, the schedule and v over `pipeline_figure`; the static figure without widgets."""
    if not (widgets_can_render() if widgets is None else widgets):
        return pipeline_figure(p, m, schedule, v)
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    controls = {
        "p": w.IntSlider(value=p, min=2, max=8, description="stages p"),
        "m": w.IntSlider(value=m, min=1, max=32, description="micro-batches m"),
        "schedule": w.ToggleButtons(options=["gpipe", "1f1b", "interleaved_1f1b"], value=schedule),
        "v": w.IntSlider(value=v, min=1, max=4, description="chunks v"),
    }
    out, message = w.Output(), w.HTML()

    def draw(_=None) -> None:
        out.clear_output(wait=True)
        try:
            fig = pipeline_figure(**{k: c.value for k, c in controls.items()})
        except ValueError as exc:  # 1F1B wants m >= p, interleaving m a multiple of p
            message.value = f"<span style='color:firebrick'>{exc}</span>"
            return
        message.value = ""
        with out:
            display(fig)
        plt.close(fig)

    for c in controls.values():
        c.observe(draw, names="value")
    draw()
    return displayed(
        w.VBox([w.HBox(list(controls.values())[:2]), w.HBox(list(controls.values())[2:]), message, out])
    )
