"""Figures a lab keeps for `labkit run`'s report, and only there.

A notebook draws its figures inline; `save_figure(fig, "03_step_times.png")` also writes one as a PNG into the
folder `labkit run` names in `LABKIT_FIGURES_DIR` (the run's `<lab>/` folder, whose figures the report shows).
In JupyterLab, under plain papermill or in a grader's run the variable is unset and nothing is written, so a
learner's working folder does not fill with PNGs (issue 28: `my-labs/02_memory_bars.png` and the like).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["FIGURES_ENV", "save_figure"]

FIGURES_ENV = "LABKIT_FIGURES_DIR"


def save_figure(fig: Any, name: str, dpi: int = 100) -> Path | None:
    """Write matplotlib figure `fig` as `name` (a PNG file name, no folder) into `LABKIT_FIGURES_DIR` when
    it is set; return the path, or None when nothing was written."""
    if not name or Path(name).name != name or not name.endswith(".png"):
        raise ValueError(f"save_figure(fig, {name!r}): give a file name ending in .png, without a folder")
    folder = os.environ.get(FIGURES_ENV)
    if not folder:
        return None
    path = Path(folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path
