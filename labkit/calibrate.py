"""How fast one core of this CPU is: the figure the emulated links are scaled to.

The emulated cluster's links cost as much relative to this CPU's compute as an H100 node's
links cost relative to an H100 (`labkit.links.default_links`). That needs one number, the
single-thread fp32 matmul speed, and it must hold still: measured on the wall clock once
per process it moved between 26 and 102 GFLOP/s on one machine in one hour. So it is

* measured in **CPU time** of the measuring thread (other load does not count), one
  intra-op thread, the **best** of several runs (interruptions only make a run slower);
* **cached per machine** (CPU model and torch version) in the user's cache directory
  (`$XDG_CACHE_HOME/labkit/calibration.json`, else `~/.cache/...`), so every process and
  every run on the machine shares one figure and before/after comparisons stay comparable;
* **overridable**: `LABKIT_CPU_GFLOPS=40` fixes it; `labkit doctor --recalibrate` measures
  again and rewrites the cache. `labkit doctor` prints it and `labkit run` writes it into
  the report.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["ENV", "Calibration", "cache_path", "cpu_gflops", "machine_key", "measure_cpu_gflops"]

ENV = "LABKIT_CPU_GFLOPS"


@dataclass(frozen=True)
class Calibration:
    """This CPU's single-thread fp32 matmul GFLOP/s, and where the figure came from."""

    gflops: float
    source: str  # "measured", "cache" or the environment variable's name
    machine: str

    def describe(self) -> str:
        where = {"measured": "measured now", "cache": f"cached in {cache_path()}"}.get(
            self.source, f"${self.source}"
        )
        return f"{self.gflops:.1f} GFLOP/s per core (fp32 matmul, one thread; {where}; {self.machine})"

    def to_dict(self) -> dict:
        return asdict(self)


def machine_key() -> str:
    """What the figure depends on: the CPU model and the torch build."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} | torch {torch.__version__}"


def cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "labkit" / "calibration.json"


def measure_cpu_gflops(size: int = 512, repeats: int = 10) -> float:
    """Best-of-`repeats` fp32 matmul GFLOP/s of one thread, timed in that thread's CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            a @ b
            best = min(best, time.thread_time() - t0)
        return 2 * size**3 / max(best, 1e-9) / 1e9
    finally:
        torch.set_num_threads(threads)


def _read_cache(key: str) -> float | None:
    try:
        value = json.loads(cache_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _write_cache(key: str, gflops: float) -> None:
    path = cache_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        data = data if isinstance(data, dict) else {}
        data[key] = gflops
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)  # atomic: two processes calibrating at once never leave half a file
    except OSError:
        pass  # a read-only home: the figure still holds for this process


@functools.cache
def _cached_calibration() -> Calibration:
    key = machine_key()
    raw = os.environ.get(ENV)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise ValueError(f"{ENV}={raw!r} must be a number of GFLOP/s > 0, e.g. {ENV}=40")
        return Calibration(value, ENV, key)
    cached = _read_cache(key)
    if cached is not None:
        return Calibration(cached, "cache", key)
    value = measure_cpu_gflops()
    _write_cache(key, value)
    return Calibration(value, "measured", key)


def cpu_gflops(recalibrate: bool = False) -> Calibration:
    """This machine's calibration: the environment variable, else the cache, else measured (and cached)."""
    if recalibrate:
        _cached_calibration.cache_clear()
        key = machine_key()
        value = measure_cpu_gflops()
        _write_cache(key, value)
        if not os.environ.get(ENV):
            return Calibration(value, "measured", key)
    return _cached_calibration()
