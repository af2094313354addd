"""NCCL's flight recorder, read as the collective records of `labkit.machine.emulate.record`: a hang on GPUs
is named too.

On the emulated cluster every rank keeps a record of its collectives, and `diagnose_hang` says which operation
never completed and which rank skipped or mismatched it. On NCCL the same facts come from PyTorch's flight
recorder, which `launch` turns on for every rank (`env_for`; the variables are the documented ones of
ProcessGroupNCCL, see "PYTORCH ProcessGroupNCCL Environment Variables" and the Flight Recorder tutorial):

* `TORCH_NCCL_TRACE_BUFFER_SIZE` (newer releases also read `TORCH_FR_BUFFER_SIZE`): collectives kept in a
  ring;
* `TORCH_NCCL_DUMP_ON_TIMEOUT=1`: when the watchdog times a collective out, each rank writes its ring to
* `TORCH_FR_DUMP_TEMP_FILE` + its rank (here `<launch dir>/nccl_trace_rank_<r>`; the older name
  `TORCH_NCCL_DEBUG_INFO_TEMP_FILE` is read only when the new one is unset, so both are set), a pickled dict
  whose `entries` hold, per operation in the order issued (`record_id`), its `process_group` (name, desc),
  `collective_seq_id` (0 for point-to-point), `p2p_seq_id` (0 for collectives), `profiling_name`
  ("nccl:all_reduce", "nccl:send 0->1"), `state` ("scheduled", "started" or "completed"), `input_sizes` and
  `input_dtypes`. Each process group, and within it collectives and point-to-point ops, count on their own
  (torch/distributed/flight_recorder/components/types.py matches them so).

`read_collective_records(run_dir)` gives each dumped rank's record in `diagnose_hang`'s shape: the
first operation not completed (with its group), the operations of that group and kind counted, the last one,
and the status.

Under torchrun nothing is left to read the dumps once the watchdog has ended the ranks, so
`labkit.machine.torchrun` points them at `./nccl_dumps/` (unless the variables are set already) and, after the
job, a person runs

    python -m labkit.machine.flight_recorder nccl_dumps --world-size 16

which prints the same diagnosis `launch` gives (`main`).
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import Any

__all__ = [
    "DUMP_PREFIX",
    "DUMP_VARS",
    "dump_prefix",
    "dumped_ranks",
    "env_for",
    "main",
    "read_collective_records",
    "record_of",
]

DUMP_PREFIX = "nccl_trace_rank_"
_ENTRIES = 2000  # collectives kept per rank: a few steps of a lab, a few MB at most
# Where the dumps go: the first one set wins (FlightRecorder.cpp, DebugInfoWriter::getWriter)
DUMP_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def env_for(run_dir: str | Path) -> dict[str, str]:
    """The flight recorder's variables for the ranks of one launch, dumping into `run_dir`."""
    prefix = str(Path(run_dir) / DUMP_PREFIX)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(_ENTRIES),
        "TORCH_FR_BUFFER_SIZE": str(_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        **{var: prefix for var in DUMP_VARS},
    }


def dump_prefix(environ: dict[str, str]) -> str | None:
    """The prefix the dumps will be written to under `environ` (None when neither variable is set)."""
    return next((environ[v] for v in DUMP_VARS if environ.get(v)), None)


def _is_p2p(entry: dict[str, Any]) -> bool:
    return not entry.get("collective_seq_id") and bool(entry.get("p2p_seq_id"))


def _seq(entry: dict[str, Any]) -> int:
    return int(entry.get("p2p_seq_id" if _is_p2p(entry) else "collective_seq_id") or 0)


def _group(entry: dict[str, Any]) -> tuple[str, str]:
    """(name, description) of the entry's process group; the default group is named "0"."""
    pg = entry.get("process_group") or ("0", "default_pg")
    return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""


def _op(entry: dict[str, Any]) -> dict[str, Any]:
    words = str(entry.get("profiling_name", "?")).split(":", 1)[-1].split(" ")
    op = words[0]  # "nccl:all_reduce" -> "all_reduce"; "nccl:send 0->1" -> "send"
    peer = None
    if _is_p2p(entry) and len(words) > 1 and "->" in words[1]:
        src, dst = words[1].split("->", 1)
        peer = dst if op == "send" else src
    dtypes = entry.get("input_dtypes") or [""]
    name, desc = _group(entry)
    return {
        "seq": _seq(entry),
        "op": op,
        "shapes": [list(s) for s in entry.get("input_sizes", [])],
        "dtype": str(dtypes[0]).lower(),
        "peer": int(peer) if peer is not None and peer.isdigit() else None,
        "group": None if name == "0" else (desc if desc and desc != "undefined" else f"group {name}"),
    }


def record_of(dump: dict[str, Any]) -> dict[str, Any]:
    """One rank's dump as a collective record: pending (the first operation issued and not completed), count
    and last (of that operation's group and kind: collectives or point-to-point), status."""
    entries = [e for e in dump.get("entries", []) if _seq(e)]
    entries.sort(key=lambda e: int(e.get("record_id", 0)))  # the order the rank issued them
    pending = [e for e in entries if e.get("state") != "completed"]
    anchor = pending[0] if pending else (entries[-1] if entries else None)
    same = [
        e for e in entries if anchor and (_group(e)[0], _is_p2p(e)) == (_group(anchor)[0], _is_p2p(anchor))
    ]
    done = [e for e in same if e.get("state") == "completed"]
    return {
        "count": _seq(done[-1]) if done else 0,
        "last": _op(done[-1]) if done else None,
        "pending": [_op(e) for e in pending[:1]],
        "status": "running",
    }


def dumped_ranks(run_dir: str | Path) -> list[int]:
    """The ranks whose dump (`DUMP_PREFIX`<rank>) is in `run_dir`, in rank order."""
    names = (p.name.removeprefix(DUMP_PREFIX) for p in Path(run_dir).glob(f"{DUMP_PREFIX}*"))
    return sorted(int(n) for n in names if n.isdigit())


def read_collective_records(run_dir: str | Path) -> dict[int, dict]:
    """Each rank's record from its flight-recorder dump in `run_dir`; a rank without a (readable) dump is
    left out (`diagnose_hang`, told the world size, names it)."""
    records = {}
    for r in dumped_ranks(run_dir):
        try:
            with open(Path(run_dir) / f"{DUMP_PREFIX}{r}", "rb") as f:
                records[r] = record_of(pickle.load(f))
        except (OSError, pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError):
            continue
    return records


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit.machine.flight_recorder DIR --world-size N`: which collective hung, on which rank,
    and why."""
    from labkit.machine.emulate import diagnose_hang

    p = argparse.ArgumentParser(
        prog="python -m labkit.machine.flight_recorder",
        description="Read NCCL flight-recorder dumps and say which collective hung.",
    )
    p.add_argument("dir", help=f"the folder of the dumps ({DUMP_PREFIX}<rank> files)")
    p.add_argument("--world-size", type=int, required=True, help="ranks in the job (a missing dump is named)")
    args = p.parse_args(argv)
    records = read_collective_records(args.dir)
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
