"""labkit.widgets: the memory calculator (its bars are `labkit.memory.estimate`'s, its controls redraw it, a
refused layout says why, and without widgets it is the static figure) and the pipeline explorer (it draws
`labkit.schedules`' simulation and says why it cannot)."""

from __future__ import annotations

import matplotlib
import pytest

from labkit.memory import estimate
from labkit.models import GPTConfig
from labkit.widgets import (
    CARDS,
    MemoryCalculator,
    memory_calculator,
    memory_figure,
    pipeline_explorer,
    pipeline_figure,
)

matplotlib.use("Agg")


def test_the_figure_shows_the_estimate_and_the_card():
    import matplotlib.pyplot as plt

    config = GPTConfig.preset("llama2-7b")
    fig = memory_figure(config, 80.0, dp=8, zero_stage=1, micro_batch=1, seq_len=4096)
    b = estimate(model=config, dp=8, zero_stage=1, micro_batch=1, seq_len=4096)
    heights = [p.get_height() for p in fig.axes[0].patches]
    want = [v / 2**30 for v in (b.params, b.grads, b.optimizer, b.activations, b.other) if v > 0]
    assert heights == pytest.approx(want)
    assert {round(line.get_ydata()[0], 3) for line in fig.axes[0].lines} >= {80.0, round(b.peak / 2**30, 3)}
    plt.close(fig)


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
