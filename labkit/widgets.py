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

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported on first use, so `labkit quiz` starts fast
    from labkit.memory import MemoryBreakdown
    from labkit.models import GPTConfig

__all__ = [
    "CARDS",
    "TEXT_ONLY_ENV",
    "MemoryCalculator",
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


def memory_figure(config: GPTConfig, card_gib: float, *, title: str = "", **options):
    """One GPU's estimated memory as a stacked bar, its peak and the card's capacity; returns the Figure."""
    import matplotlib.pyplot as plt

    b = breakdown(config, **options)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    bottom = 0.0
    for key, name, color in _PARTS:
        value = getattr(b, key) / _GIB
        if value > 0:
            ax.bar(["this GPU"], [value], bottom=bottom, color=color, label=f"{name} {value:.1f} GiB")
            bottom += value
    peak = b.peak / _GIB
    ax.axhline(peak, color="black", lw=1.2, label=f"peak (not all at once) {peak:.1f} GiB")
    ax.axhline(card_gib, color="firebrick", ls="--", lw=1.5, label=f"card {card_gib:g} GiB")
    ax.axhline(0.9 * card_gib, color="firebrick", ls=":", lw=1, label="90 % of the card")
    fits = peak <= 0.9 * card_gib
    ax.set(
        ylabel="GiB",
        ylim=(0, max(bottom, card_gib) * 1.15),
        title=title or f"{'fits' if fits else 'does not fit'}: peak {peak:.1f} of {card_gib:g} GiB",
    )
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.tight_layout()
    return fig


class MemoryCalculator:
    """Sliders and presets over `memory_figure`; `controls` by name, `breakdown` the last estimate, `error`
    the last refusal (a tp that does not divide the heads, ...), `widget` to display."""

    def __init__(self, model: str = "llama2-7b", card: str = "H100 80GB", **options: Any) -> None:
        import ipywidgets as w

        from labkit.models import PRESETS

        self.output = w.Output()
        self.message = w.HTML()
        sizes = [1, 2, 4, 8, 16, 32, 64]
        self.controls = {
            "model": w.Dropdown(options=[*sorted(PRESETS), "custom"], value=model, description="model"),
            "n_layers": w.IntSlider(value=24, min=1, max=128, description="layers"),
            "d_model": w.SelectionSlider(
                options=[512, 1024, 2048, 4096, 8192, 12288], value=2048, description="hidden"
            ),
            "card": w.Dropdown(options=list(CARDS), value=card, description="card"),
            "seq_len": w.SelectionSlider(
                options=[512, 1024, 2048, 4096, 8192], value=2048, description="sequence"
            ),
            "micro_batch": w.SelectionSlider(options=sizes[:6], value=1, description="micro-batch"),
            "micro_batches": w.SelectionSlider(options=sizes, value=1, description="micro-batches"),
            "precision": w.Dropdown(
                options=["mixed", "mixed_fp32_grads", "bf16", "fp32"], value="mixed", description="precision"
            ),
            "zero_stage": w.ToggleButtons(options=[0, 1, 2, 3], value=0, description="ZeRO"),
            "dp": w.SelectionSlider(options=sizes, value=8, description="dp"),
            "tp": w.SelectionSlider(options=sizes[:5], value=1, description="tp"),
            "pp": w.SelectionSlider(options=sizes[:6], value=1, description="pp"),
            "checkpointing": w.Checkbox(value=False, description="activation checkpointing"),
        }
        unknown = sorted(set(options) - set(self.controls))
        if unknown:
            raise ValueError(
                f"memory_calculator(..., {unknown[0]}=...): not a control; the controls are "
                f"{', '.join(self.controls)}"
            )
        for name, value in options.items():  # the notebook's arguments are where the sliders start
            self.controls[name].value = value
        self.breakdown: MemoryBreakdown | None = None
        self.error = ""
        for c in self.controls.values():
            c.observe(lambda _: self.update(), names="value")
        self.widget = w.HBox([w.VBox(list(self.controls.values())), w.VBox([self.output, self.message])])
        self.update()

    def config(self) -> GPTConfig:
        from labkit.models import PRESETS, GPTConfig

        v = {k: c.value for k, c in self.controls.items()}
        if v["model"] != "custom":
            return replace(PRESETS[v["model"]], seq_len=max(PRESETS[v["model"]].seq_len, v["seq_len"]))
        return GPTConfig(
            n_layers=v["n_layers"],
            d_model=v["d_model"],
            n_heads=max(1, v["d_model"] // 128),
            vocab_size=32000,
            seq_len=v["seq_len"],
        )

    def update(self) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import display

        v = {k: c.value for k, c in self.controls.items()}
        options = {
            k: v[k]
            for k in (
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
        }
        config = self.config()
        try:
            self.breakdown = breakdown(config, **options)
            self.error = ""
        except ValueError as exc:
            self.breakdown, self.error = None, str(exc)
        self.output.clear_output(wait=True)
        if self.breakdown is None:
            self.message.value = f"<span style='color:firebrick'>{self.error}</span>"
            return
        b, cap = self.breakdown, CARDS[v["card"]]
        self.message.value = (
            f"{config.num_params() / 1e9:.2f} B parameters; per GPU: {b} ; "
            f"{'fits' if b.peak <= 0.9 * cap * _GIB else 'does not fit'} a {v['card']}"
        )
        fig = memory_figure(config, cap, **options)
        with self.output:
            display(fig)
        plt.close(fig)  # displayed once, in the output widget, and not again at the cell's end


def memory_calculator(
    model: str = "llama2-7b", card: str = "H100 80GB", widgets: bool | None = None, **options
):
    """The calculator in JupyterLab, its controls starting at `options`; under papermill or in a terminal the
    static figure of `model` on `card` with `options` (dp, tp, pp, zero_stage, precision, micro_batch,
    seq_len, checkpointing, micro_batches)."""
    from labkit.models import PRESETS

    if widgets_can_render() if widgets is None else widgets:
        return displayed(MemoryCalculator(model, card, **options).widget)
    return memory_figure(PRESETS[model], CARDS[card], **options)


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
