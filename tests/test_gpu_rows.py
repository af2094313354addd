"""tests/gpu_rows.py, the one-rank table of tests/gpu_check.sh, tried here on the emulated cluster at the
labs' emulated sizes, so that its rows do not rot between the rare runs on a GPU (the forecast row skips)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def test_every_one_rank_row_runs_and_passes_on_the_emulated_cluster(capsys):
    spec = importlib.util.spec_from_file_location("gpu_rows", Path(__file__).with_name("gpu_rows.py"))
    gpu_rows = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_rows)
    assert gpu_rows.main() == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "one rank on emulated" in out and out.count(" pass ") == len(gpu_rows.ROWS) + 1, out
