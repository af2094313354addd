"""Each `labkit run` in a folder of its own, and the facts a report needs to be read later.

`new_run_dir(base)` makes `base/<YYYYmmdd-HHMMSS>/` (never reusing one), so a run never mixes its
notebooks, figures and HTML with an earlier run's. `point_latest` makes `base/latest` a link to a run, and
`labkit run` moves it only for a `complete` run (every lab, each passed): a failed, interrupted or one-lab
run keeps its own folder and says where `latest` points, so `runs/latest/report.md` is the last good full
report instead of whatever ran last. `run_context` says where
and with what the run was made: the machine, the cluster (real or emulated, its links and
their calibration), torch and labkit versions, the git commit and the date; the report
(`report.py`) prints it as its header.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["complete", "new_run_dir", "point_latest", "run_context"]


def new_run_dir(base: str | Path) -> Path:
    """A new, empty folder `base/<timestamp>` (with a suffix if that second is taken)."""
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = base / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path.resolve()
        except FileExistsError:
            continue
    raise RuntimeError(f"could not make a new run folder in {base}")


def complete(results: list[dict[str, Any]], every_lab: bool) -> bool:
    """Is a run worth `latest`: it ran `every_lab` of the course and each one passed?"""
    return every_lab and bool(results) and all(r.get("status") == "passed" for r in results)


def point_latest(base: str | Path, run_dir: Path) -> Path:
    """Make `base/latest` a relative link to `run_dir`; return the link (or `run_dir` if links fail)."""
    link = Path(base) / "latest"
    try:
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.is_dir():  # a real folder from labkit before per-run folders: keep it, renamed
            link.rename(link.with_name(f"latest-before-{_dt.datetime.now():%Y%m%d-%H%M%S}"))
        link.symlink_to(os.path.relpath(run_dir, link.parent), target_is_directory=True)
        return link
    except OSError:
        return run_dir


def _git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return (commit + (" (with local changes)" if dirty else "")) if out.returncode == 0 and commit else None


def run_context(root: Path, cluster_spec: str) -> dict[str, Any]:
    """Where and with what a run was made, for the report's header."""
    import torch

    import labkit
    from labkit import calibrate
    from labkit.cluster import Cluster

    try:
        cluster = Cluster.resolve(cluster_spec, 2).describe()
    except ValueError as exc:
        cluster = f"not available: {exc}"
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores",
        "python": platform.python_version(),
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        "labkit": labkit.__version__,
        "commit": _git_commit(root),
        "cluster": cluster,
        "calibration": calibrate.cpu_gflops().to_dict(),
    }
