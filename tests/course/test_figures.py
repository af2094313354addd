"""labkit.course.figures: a lab's figures are written only where `labkit run` asks for them."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from labkit.course.figures import FIGURES_ENV, save_figure


def test_nothing_is_written_outside_labkit_run(tmp_path, monkeypatch):
    monkeypatch.delenv(FIGURES_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    fig, _ = plt.subplots()
    assert save_figure(fig, "02_memory_bars.png") is None
    assert list(tmp_path.iterdir()) == []  # the learner's working folder stays as it was
    plt.close(fig)


def test_labkit_runs_folder_gets_the_png(tmp_path, monkeypatch):
    monkeypatch.setenv(FIGURES_ENV, str(tmp_path / "02_oom_batch"))
    fig, _ = plt.subplots()
    path = save_figure(fig, "02_memory_bars.png")
    assert path == tmp_path / "02_oom_batch" / "02_memory_bars.png"
    assert path.read_bytes()[:4] == b"\x89PNG"
    plt.close(fig)


@pytest.mark.parametrize("name", ["", "plots/a.png", "a.pdf"])
def test_a_name_with_a_folder_or_another_kind_is_refused(name):
    with pytest.raises(ValueError, match=r"ending in \.png, without a folder"):
        save_figure(None, name)
