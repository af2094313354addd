"""Benchmark: lab 03's headline ratios against the issue's targets, medians over several runs.

The lab's own check holds after/limit <= 1.25 and asks the fix to take off at least half of what
overlapping can take off in that run (its bound follows the run's balance of compute and links, which
another CPU or a shared host moves); the course's fixed targets are measured here, as medians:

    python3 benchmarks/lab03_ratios.py             # 3 papermill runs with the lab's defaults
    python3 benchmarks/lab03_ratios.py --check     # exit 1 unless median after/before <= 0.8
                                                   # and median after/limit <= 1.25
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import papermill

from labkit.course.records import read_records

NOTEBOOK = Path(__file__).resolve().parents[1] / "solutions" / "03_unoverlapped_comms.ipynb"
TARGETS = {"after/before": 0.8, "after/limit": 1.25}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cluster", default="cpu")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)

    ratios: dict[str, list[float]] = {k: [] for k in TARGETS}
    print(
        f"{'run':>3} {'before ms':>10} {'after ms':>9} {'limit ms':>9} {'after/before':>13} "
        f"{'after/limit':>12} {'s':>5}"
    )
    with tempfile.TemporaryDirectory(prefix="labkit-bench-") as tmp:
        for i in range(1, args.runs + 1):
            out = Path(tmp) / f"run{i}" / NOTEBOOK.name
            out.parent.mkdir()
            t0 = time.perf_counter()
            papermill.execute_notebook(
                str(NOTEBOOK),
                str(out),
                parameters={"cluster": args.cluster},
                cwd=str(out.parent),
                kernel_name="python3",
                progress_bar=False,
            )
            rec = read_records(out)
            ratios["after/before"].append(rec["after"] / rec["before"])
            ratios["after/limit"].append(rec["after"] / rec["limit"])
            world = "emulated" if rec.get("emulated") else "real GPUs"
            print(
                f"{i:3} {rec['before']:10.1f} {rec['after']:9.1f} {rec['limit']:9.1f} "
                f"{ratios['after/before'][-1]:13.2f} {ratios['after/limit'][-1]:12.2f} "
                f"{time.perf_counter() - t0:5.0f}  ({world})"
            )
    missed = []
    for key, target in TARGETS.items():
        med = statistics.median(ratios[key])
        print(f"median {key} = {med:.2f} (target <= {target})")
        if med > target:
            missed.append(f"{key} {med:.2f} > {target}")
    if args.check and missed:
        print("missed: " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
