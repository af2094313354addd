"""What each emulated rank's collectives were, and which rank made a collective hang.

Every rank of the emulated cluster keeps a `CollectiveRecord` of the collectives it issued,
in a small memory-mapped file, so that the launcher can still read it after gloo aborted
the process. `diagnose_hang` compares the records of all ranks and says which operation
never completed and which rank skipped or mismatched it; `labkit.launch` puts that into
its `RankError`. The process group that writes the records is `process_group.py`.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from pathlib import Path
from typing import Any

import torch

__all__ = ["CollectiveRecord", "diagnose_hang", "read_collective_records"]


class CollectiveRecord:
    """The collectives a rank issued, kept for hang and mismatch diagnosis.

    With a `path`, every change is also written to a small memory-mapped file, so the
    launcher can read what a rank was doing even after gloo aborted the process (a size
    mismatch ends in `std::terminate` inside a gloo thread, where Python cannot catch it).
    """

    SIZE = 4096

    def __init__(self, path: str | None = None) -> None:
        self.seq = 0
        self.status = "running"
        self.last: dict[str, Any] | None = None
        self.in_flight: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._mm: mmap.mmap | None = None
        if path:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, self.SIZE)
                self._mm = mmap.mmap(fd, self.SIZE)
            finally:
                os.close(fd)
            self._write()

    def issued(self, op: str, tensors: list[torch.Tensor], peer: int | None = None) -> int:
        with self._lock:
            self.seq += 1
            entry = {
                "seq": self.seq,
                "op": op,
                "shapes": [list(t.shape) for t in tensors],
                "dtype": str(tensors[0].dtype).replace("torch.", "") if tensors else "",
                "peer": peer,
            }
            self.last = entry
            self.in_flight[self.seq] = entry
            self._write()
            return self.seq

    def completed(self, seq: int) -> None:
        with self._lock:
            self.in_flight.pop(seq, None)
            self._write()

    def finish(self, status: str) -> None:
        """Mark how the rank's function ended: "returned" or "raised"."""
        with self._lock:
            self.status = status
            self._write()

    def _snapshot(self) -> dict[str, Any]:
        pending = sorted(self.in_flight.values(), key=lambda e: e["seq"])
        return {"count": self.seq, "last": self.last, "pending": pending[:1], "status": self.status}

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return self._snapshot()

    def _write(self) -> None:
        if self._mm is not None:
            data = json.dumps(self._snapshot()).encode()[: self.SIZE]
            self._mm[:] = data.ljust(self.SIZE, b" ")

    @staticmethod
    def read(path: str) -> dict[str, Any] | None:
        """A rank's record from its file, or None when absent or torn."""
        try:
            with open(path, "rb") as f:
                return json.loads(f.read().decode())
        except (OSError, ValueError):
            return None


def read_collective_records(run_dir: Path) -> dict[int, dict]:
    """Each rank's collective record, from the files (record<rank>.json) the emulated process group keeps in
    `run_dir`; a rank that left none is left out (`diagnose_hang`, told the world size, names it)."""
    records = {}
    for path in sorted(Path(run_dir).glob("record*.json")):
        rank = path.stem.removeprefix("record")
        if rank.isdigit() and (rec := CollectiveRecord.read(str(path))) is not None:
            records[int(rank)] = rec
    return records


def _fmt_op(e: dict | None) -> str:
    if not e:
        return "no collective"
    shapes = ", ".join("x".join(str(d) for d in s) or "scalar" for s in e.get("shapes", []))
    peer = "" if e.get("peer") is None else f" {'to' if e['op'] == 'send' else 'from'} rank {e['peer']}"
    group = f" in {e['group']}" if e.get("group") else ""  # the flight recorder's subgroups
    return f"{e['op']} #{e['seq']}{peer} ({e.get('dtype', '')}[{shapes}]){group}"


_STATUS_WORDS = {"returned": "returned from fn", "raised": "raised", "running": "was running elsewhere"}


def diagnose_hang(records: dict[int, dict], world_size: int) -> tuple[str, int | None] | None:
    """From each rank's collective record, say which operation hung and which rank is at fault."""
    pending = {r: rec["pending"][0] for r, rec in records.items() if rec.get("pending")}
    if not pending:
        return None
    stuck_rank, op = min(pending.items(), key=lambda kv: kv[1]["seq"])
    lines = [f"{_fmt_op(op)} on rank {stuck_rank} never completed."]
    culprit = None
    for r in range(world_size):
        if r == stuck_rank:
            continue
        rec = records.get(r)
        if rec is None:
            lines.append(f"rank {r} left no record of its collectives.")
            culprit = r if culprit is None else culprit
            continue
        other = rec["pending"][0] if rec.get("pending") else None
        if other is None:
            done = rec.get("count", 0)
            lines.append(
                f"rank {r} {_STATUS_WORDS.get(rec.get('status'), 'stopped')} after "
                f"{done} collective(s) (last: {_fmt_op(rec.get('last'))}) and never called "
                f"{op['op']} #{op['seq']}: rank {r} is missing."
            )
            culprit = r if culprit is None else culprit
        elif (
            other["seq"] != op["seq"]
            or other.get("group") != op.get("group")
            or other["op"] != op["op"]
            or other["shapes"] != op["shapes"]
            or other["dtype"] != op["dtype"]
        ):
            lines.append(
                f"rank {r} was in {_fmt_op(other)} at the same time: mismatched collective "
                f"(op, order, shape or dtype differ between rank {stuck_rank} and rank {r})."
            )
            culprit = r if culprit is None else culprit
        else:
            lines.append(f"rank {r} was waiting in the same {_fmt_op(other)}.")
    lines.append(
        "Every rank must call the same collectives, in the same order, with the same shapes and dtypes."
    )
    return "\n".join(lines), culprit
