"""labkit.course.widgets: the memory calculator (its bars are `labkit.memory.estimate`'s, its controls redraw
it, a refused layout says why, and without widgets it is the static figure) and the pipeline explorer (it
draws `labkit.schedules`' simulation and says why it cannot)."""

from __future__ import annotations

import html
from dataclasses import replace

import matplotlib
import pytest

from labkit.course.widgets import (
    CARDS,
    MemoryCalculator,
    at_peak,
    breakdown,
    memory_calculator,
    memory_figure,
    pipeline_explorer,
    pipeline_figure,
)
from labkit.memory import estimate
from labkit.models import GPTConfig

matplotlib.use("Agg")


def _bar(fig, name: str) -> dict[str, float]:
    """Segments of one of the figure's bars ("at peak" or "parts"), part -> GiB."""
    return {
        p.get_gid().split(": ")[1]: p.get_height()
        for p in fig.axes[0].patches
        if (p.get_gid() or "").startswith(f"{name}: ")
    }


def _note(fig) -> str:
    return " ".join(t.get_text() for t in fig.texts if t.get_gid() == "peak note").replace("\n", " ")


def test_the_figure_shows_the_estimate_and_the_card():
    import matplotlib.pyplot as plt

    config = GPTConfig.preset("llama2-7b")
    fig = memory_figure(config, 80.0, dp=8, zero_stage=1, micro_batch=1, seq_len=4096)
    b = estimate(model=config, dp=8, zero_stage=1, micro_batch=1, seq_len=4096)
    parts = {k: getattr(b, k) / 2**30 for k in ("params", "grads", "optimizer", "activations", "other")}
    assert _bar(fig, "parts") == pytest.approx({k: v for k, v in parts.items() if v > 0})
    assert {round(line.get_ydata()[0], 3) for line in fig.axes[0].lines} >= {80.0, round(b.peak / 2**30, 3)}
    plt.close(fig)


@pytest.mark.parametrize(
    "options, when",
    [
        ({"seq_len": 4096}, "at the start of backward"),  # activations outweigh the gradients
        ({"seq_len": 512}, "at the optimizer step"),  # the gradients outweigh the activations
        ({"seq_len": 4096, "checkpointing": True}, "in backward, with recomputation"),
        ({"seq_len": 4096, "micro_batches": 4}, "at the start of backward"),  # gradients kept: all at once
    ],
)
def test_the_bar_above_the_peak_says_why(options, when):
    """The parts' bar stands above the peak by what never coexists (labkit.memory.estimate: gradients
    appear as activations are freed); the figure draws what is alive at the peak up to exactly the peak, and
    the figure and the calculator's text say both numbers and when the peak is."""
    import matplotlib.pyplot as plt

    config = GPTConfig.preset("llama2-7b")
    knobs = {"dp": 8, "zero_stage": 1, "micro_batch": 1, **options}
    b = breakdown(config, **knobs)
    total, peak = b.total / 2**30, b.peak / 2**30
    fig = memory_figure(config, 80.0, **knobs)
    alive = _bar(fig, "at peak")
    assert sum(alive.values()) == pytest.approx(peak)
    note = _note(fig)
    assert when in note and f"{peak:.1f} GiB" in note
    if b.peak < b.total:
        said = f"The parts sum to {total:.1f} GiB, but not all are alive at once: the peak is {peak:.1f} GiB"
        assert said in note
        assert sum(_bar(fig, "parts").values()) == pytest.approx(total)
    else:  # several micro-batches keep the gradients through the step: everything coexists, one bar
        assert b.peak == b.total and "All parts are alive at once" in note and not _bar(fig, "parts")
    if when == "at the start of backward":
        assert alive == pytest.approx({k: getattr(b, k) / 2**30 for k in b.as_dict() if k in alive})
        assert ("grads" in alive) == ("micro_batches" in options)
    plt.close(fig)
    calc = MemoryCalculator("llama2-7b", "H100 80GB", **knobs)
    assert calc.breakdown == b and calc.at_peak.note in html.unescape(calc.message.value)


def test_at_peak_follows_the_estimate_for_every_layout():
    """What is alive at the peak sums to the estimate's peak whatever the layout."""
    config = GPTConfig.preset("llama2-13b")
    for dp, tp, pp, zero, checkpointing, micro_batches in [
        (8, 1, 1, 0, False, 1),
        (8, 2, 1, 2, True, 1),
        (2, 1, 4, 1, False, 8),
        (2, 2, 2, 3, True, 4),
        (64, 1, 1, 3, False, 1),
    ]:
        knobs = dict(dp=dp, tp=tp, pp=pp, zero_stage=zero, checkpointing=checkpointing)
        b = breakdown(config, micro_batches=micro_batches, **knobs)
        p = at_peak(b, grads_kept=micro_batches > 1)
        assert sum(v for _, v in p.alive) == b.peak, knobs


def test_the_calculator_redraws_and_refuses_with_the_reason():
    calc = MemoryCalculator("llama2-7b", "H100 80GB")
    one = calc.breakdown
    calc.controls["tp"].value = 2
    assert calc.breakdown.params < one.params and "tp=2" in calc.breakdown.source
    calc.controls["zero_stage"].value = 3
    assert calc.breakdown.params < one.params / 2
    calc.controls["model"].value = "gpt2-xl"  # 25 heads: tp = 2 cannot split them
    assert calc.breakdown is None and "does not divide n_heads=25" in calc.error
    assert "does not divide" in calc.message.value
    calc.controls["tp"].value = 1
    assert calc.breakdown is not None and calc.error == ""
    assert set(CARDS) >= {"A100 80GB", "H100 80GB", "H200 141GB"}


def test_without_widgets_it_is_the_static_figure():
    import matplotlib.pyplot as plt

    fig = memory_calculator("gpt2", "A100 40GB", widgets=False, dp=2)
    assert isinstance(fig, plt.Figure)
    plt.close(fig)
    assert memory_calculator(widgets=True).__class__.__name__ == "HBox"


def test_the_calculator_starts_where_the_notebook_asks():
    calc = MemoryCalculator("llama2-7b", "H100 80GB", dp=8, zero_stage=1, micro_batch=1, seq_len=4096)
    assert (calc.controls["zero_stage"].value, calc.controls["seq_len"].value) == (1, 4096)
    from labkit.memory import estimate
    from labkit.models import PRESETS

    want = estimate(model=PRESETS["llama2-7b"], dp=8, zero_stage=1, micro_batch=1, seq_len=4096)
    assert calc.breakdown.peak == want.peak
    with pytest.raises(ValueError, match="not a control; the controls are model"):
        MemoryCalculator("llama2-7b", "H100 80GB", zero=1)


def test_the_explorer_draws_and_reacts():
    import matplotlib.pyplot as plt

    fig = pipeline_figure(4, 8, "1f1b")
    assert "bubble 27.3% (formula 27.3%)" in fig.axes[0].get_title()
    plt.close(fig)
    box = pipeline_explorer(widgets=True)
    (_, m), (schedule, _) = box.children[0].children, box.children[1].children
    schedule.value = "interleaved_1f1b"
    m.value = 6  # not a multiple of p = 4: the explorer says why instead of drawing
    assert "not a multiple" in box.children[2].value
    m.value = 8
    assert box.children[2].value == ""
    plt.close("all")


def test_a_preset_sets_the_shape_sliders_and_redraws_once():
    """Issue 28: llama2-7b showed 24 layers and 2048 wide (the model is 32 x 4096), and the sliders moved
    nothing unless the model was "custom"."""
    from labkit.models import PRESETS

    calc = MemoryCalculator("llama2-7b", "H100 80GB", dp=8, zero_stage=1)
    shape = ("n_layers", "d_model", "seq_len")
    assert [calc.controls[k].value for k in shape] == [32, 4096, 4096]
    calls = []
    calc.update = lambda: calls.append(calc.controls["model"].value)  # type: ignore[method-assign]
    for name, preset in PRESETS.items():
        calls.clear()
        calc.controls["model"].value = name
        assert [calc.controls[k].value for k in shape] == [getattr(preset, k) for k in shape], name
        assert calls == [name], "one estimate per choice, with every slider set"
        assert calc.config().num_params() == preset.num_params()


def test_moving_a_shape_slider_makes_a_custom_model_from_the_preset():
    from labkit.models import PRESETS

    calc = MemoryCalculator("llama2-7b", "H100 80GB", dp=8, zero_stage=1, micro_batch=1, seq_len=4096)
    preset = calc.breakdown
    calc.controls["n_layers"].value = 96
    assert calc.controls["model"].value == "custom"
    custom = calc.config()
    assert custom == replace(PRESETS["llama2-7b"], n_layers=96)  # the preset with the moved slider changed
    assert calc.breakdown.peak > 2 * preset.peak and "custom (96 layers, hidden 4096" in calc.message.value
    calc.controls["d_model"].value = 8192  # a wider custom model keeps the head size and the MLP's ratio
    assert (calc.config().n_heads, calc.config().ffn_dim) == (64, 2 * custom.ffn_dim)
    calc.controls["seq_len"].value = 2048  # the run's sequence, not the model's shape
    assert calc.controls["model"].value == "custom"
    calc.controls["model"].value = "llama2-7b"  # the preset again: its values back on the sliders
    assert (calc.controls["n_layers"].value, calc.controls["d_model"].value) == (32, 4096)
    assert calc.breakdown == preset
    gpt2 = MemoryCalculator("gpt2", "A100 40GB", d_model=1024)  # a notebook's shape argument: custom too
    assert gpt2.controls["model"].value == "custom" and gpt2.config().n_heads == 16  # 64 channels each
    assert gpt2.config().vocab_size == 50257 and gpt2.config().tie_embeddings
    with pytest.raises(ValueError, match="model='llama-7b': use one of gpt2"):
        MemoryCalculator("llama-7b")


def test_the_static_figure_takes_the_same_model_as_the_calculator():
    import matplotlib.pyplot as plt

    calc = MemoryCalculator("llama2-7b", "H100 80GB", n_layers=40, seq_len=4096)
    fig = memory_calculator("llama2-7b", "H100 80GB", widgets=False, n_layers=40, seq_len=4096)
    assert f"{calc.breakdown.peak / 2**30:.1f} GiB" in _note(fig)
    plt.close(fig)


def test_every_description_is_shown_whole():
    """Issue 28: "micro-bat…": the descriptions get a width of their own (the browser test measures them)."""
    calc = MemoryCalculator()
    for name, c in calc.controls.items():
        if name != "checkpointing":  # a checkbox's description sits to its right, at its own width
            assert c.style.description_width not in ("", None), name
    assert calc.controls["seq_len"].description == "sequence length"
