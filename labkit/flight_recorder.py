"""NCCL's flight recorder, read as the collective records of `labkit.emulate.record`: a hang on GPUs is named
too.

On the emulated cluster every rank keeps a record of its collectives, and `diagnose_hang` says which operation
never completed and which rank skipped or mismatched it. On NCCL the same facts come from PyTorch's flight
recorder, which `launch` turns on for every rank (`env_for`; the variables are the documented ones of
ProcessGroupNCCL, see "PYTORCH ProcessGroupNCCL Environment Variables" and the Flight Recorder tutorial):

* `TORCH_NCCL_TRACE_BUFFER_SIZE` (newer releases also read `TORCH_FR_BUFFER_SIZE`): collectives kept in a
  ring;
* `TORCH_NCCL_DUMP_ON_TIMEOUT=1`: when the watchdog times a collective out, each rank writes its ring to
* `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` + its rank (here `<launch dir>/nccl_trace_rank_<r>`), a pickled dict whose
  `entries` hold, per collective, `collective_seq_id`, `profiling_name` ("nccl:all_reduce"), `state`
  ("scheduled", "started" or "completed"), `input_sizes` and `input_dtypes`.

`read_collective_records(run_dir, world_size)` gives each dumped rank's record in `diagnose_hang`'s shape: the
collectives counted, the last one, the first one not completed, and the status.

Under torchrun nothing is left to read the dumps once the watchdog has ended the ranks, so `labkit.torchrun`
points them at `./nccl_dumps/` (unless the variables are set already) and, after the job, a person runs

    python -m labkit.flight_recorder nccl_dumps --world-size 16

which prints the same diagnosis `launch` gives (`main`).
"""

from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path
from typing import Any

__all__ = ["DUMP_PREFIX", "env_for", "main", "read_collective_records", "record_of", "wait_for_dumps"]

DUMP_PREFIX = "nccl_trace_rank_"
_ENTRIES = 2000  # collectives kept per rank: a few steps of a lab, a few MB at most


def env_for(run_dir: str | Path) -> dict[str, str]:
    """The flight recorder's variables for the ranks of one launch, dumping into `run_dir`."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(_ENTRIES),
        "TORCH_FR_BUFFER_SIZE": str(_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(run_dir) / DUMP_PREFIX),
    }


def _op(entry: dict[str, Any]) -> dict[str, Any]:
    name = str(entry.get("profiling_name", "?"))
    op = name.split(":", 1)[-1].split(" ", 1)[
        0
    ]  # "nccl:all_reduce" -> "all_reduce"; "nccl:send 1->2" -> "send"
    dtypes = entry.get("input_dtypes") or [""]
    return {
        "seq": int(entry.get("collective_seq_id", 0)),
        "op": op,
        "shapes": [list(s) for s in entry.get("input_sizes", [])],
        "dtype": str(dtypes[0]).lower(),
        "peer": None,
    }


def record_of(dump: dict[str, Any]) -> dict[str, Any]:
    """One rank's dump as a collective record: count, last, pending (the first not completed), status."""
    entries = [e for e in dump.get("entries", []) if e.get("collective_seq_id")]
    entries.sort(key=lambda e: e["collective_seq_id"])
    pending = [_op(e) for e in entries if e.get("state") != "completed"]
    return {
        "count": entries[-1]["collective_seq_id"] if entries else 0,
        "last": _op(entries[-1]) if entries else None,
        "pending": pending[:1],
        "status": "running",
    }


def wait_for_dumps(run_dir: str | Path, ranks: list[int], seconds: float = 5.0) -> None:
    """Once one rank has dumped (a watchdog timed out), give the others a moment to finish theirs: they dump
    at about the same time. Without any dump (a rank simply raised) there is nothing to wait for."""
    paths = [Path(run_dir) / f"{DUMP_PREFIX}{r}" for r in ranks]
    if not any(p.exists() for p in paths):
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(p.exists() for p in paths):
        time.sleep(0.2)


def read_collective_records(run_dir: str | Path, world_size: int) -> dict[int, dict]:
    """Each rank's record from its flight-recorder dump; ranks without a (readable) dump are left out."""
    records = {}
    for r in range(world_size):
        try:
            with open(Path(run_dir) / f"{DUMP_PREFIX}{r}", "rb") as f:
                records[r] = record_of(pickle.load(f))
        except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError):
            continue
    return records


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit.flight_recorder DIR --world-size N`: which collective hung, on which rank, and
    why."""
    from labkit.emulate import diagnose_hang

    p = argparse.ArgumentParser(
        prog="python -m labkit.flight_recorder",
        description="Read NCCL flight-recorder dumps and say which collective hung.",
    )
    p.add_argument("dir", help=f"the folder of the dumps ({DUMP_PREFIX}<rank> files)")
    p.add_argument("--world-size", type=int, required=True, help="ranks in the job (a missing dump is named)")
    args = p.parse_args(argv)
    records = read_collective_records(args.dir, args.world_size)
    if not records:
        print(
            f"no readable dump ({DUMP_PREFIX}<rank>) in {args.dir}: the watchdog wrote none (was "
            "TORCH_NCCL_DUMP_ON_TIMEOUT=1 set before the group was made, and did a collective time out?)"
        )
        return 1
    diag = diagnose_hang(records, args.world_size)
    print(f"dumps of ranks {sorted(records)} of {args.world_size}")
    print(diag[0] if diag else "every collective in the dumps completed: the hang was outside a collective")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
