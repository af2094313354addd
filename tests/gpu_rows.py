"""The one-rank rows of tests/gpu_check.sh, and the script's helpers.

`python tests/gpu_rows.py` runs the rows in one rank (the GPU where there is one, else the emulated cluster at
the labs' emulated sizes, to try the rows themselves), prints each as it finishes, then one table, and exits 1
if a row failed.

Rows: the warm baseline; lab 02's fixed step against its estimate (uncapped) and its OOM and fix under the
cap; the batch finder; the fragmentation pattern with each allocator option; the precisions; lab 04's layer
costs at its GPU sizes (the head heavier than a block); lab 03's compute at its GPU sizes against its
forecast. A row that raises is a failed row: the table shows the error's first line, the log its whole
traceback; an out-of-memory error also shows the allocator's figures (allocated, reserved, largest free
block) and, on a GPU, where its memory snapshot was written (open it at https://pytorch.org/memory_viz).

The helpers of tests/gpu_check.sh import neither torch nor labkit, so that they still report where torch is
broken (except `preflight`, whose job is to say how torch is):

    python tests/gpu_rows.py preflight LOGS          versions, labkit.machine._torch_compat.problems(), what's
    missing python tests/gpu_rows.py pytest ARGS...          pytest, stopped by SIGINT even if the shell
    ignored it python tests/gpu_rows.py step-rows LOGS STEP EXIT SECONDS LIMIT [--show-log]
                                                     a finished step's rows (from its junit file, its rows
                                                     file, its exit status and its log), printed and kept
    python tests/gpu_rows.py end-leftovers SID MARKER  end the processes a step left behind, saying which
    python tests/gpu_rows.py summary LOGS            every row so far, as one Markdown table; exit 1 if one
                                                     failed or timed out

A step's rows are dicts: step, check, result (passed / failed / timeout / skipped), seconds, reason (one
readable line) and detail (the whole text, for the log).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    # As a script, Python put tests/ first on sys.path, where tests/trace/ would shadow the standard library's
    # trace; this checkout's root instead (labkit from the checkout, not an install).
    sys.path[0] = str(ROOT)
else:
    sys.path.insert(0, str(ROOT))

Row = dict[str, Any]  # step, check, result, seconds, reason, detail
MiB = 2**20
WIDTH = 160  # a reason's readable first line in the tables; the whole text goes to the log
RESULTS = ("passed", "failed", "timeout", "skipped")
GRACE_S = 15  # SIGINT at a step's limit less this, KILL at its limit (tests/gpu_check.sh)


# ------------------------------------------------------------------ rows and tables (no torch)


def first_line(text: str, width: int = WIDTH) -> str:
    """The first non-empty line of `text`, cut at a word before `width` characters (with "...")."""
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    if len(line) <= width:
        return line
    cut = line[: width - 3]
    return (cut.rsplit(" ", 1)[0] if " " in cut[width // 2 :] else cut) + "..."


def row(
    step: str, check: str, result: str, seconds: float, reason: str = "", detail: str = "", width: int = WIDTH
) -> Row:
    """A row: its reason the first line of `reason` (at most `width` characters), its detail whole."""
    if result not in RESULTS:
        raise ValueError(f"result {result!r} is not one of {RESULTS}")
    return {
        "step": step,
        "check": check,
        "result": result,
        "seconds": round(float(seconds), 1),
        "reason": first_line(reason, width),
        "detail": detail or reason,
    }


def row_line(r: Row) -> str:
    """One row as plain text, as a step finishes."""
    reason = f": {r['reason']}" if r["reason"] else ""
    return f"  {r['result']:8} {r['seconds']:6.1f} s  {r['check']}{reason}"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[Row]) -> str:
    """The rows as one Markdown table (step, check, result, seconds, reason), to paste into a note."""
    lines = ["| step | check | result | s | reason |", "| --- | --- | --- | ---: | --- |"]
    for r in rows:
        cells = [r["step"], r["check"], r["result"], f"{r['seconds']:.1f}", r["reason"]]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def memory_figures(stats: dict[str, int], segments: list[dict[str, Any]]) -> dict[str, int]:
    """Allocated, reserved and the largest free block in bytes, from `torch.cuda.memory_stats()` and
    `torch.cuda.memory_snapshot()` (a segment's blocks that are "inactive" are cached and free)."""
    free = [b["size"] for s in segments for b in s.get("blocks", []) if b.get("state") == "inactive"]
    return {
        "allocated": int(stats.get("allocated_bytes.all.current", 0)),
        "reserved": int(stats.get("reserved_bytes.all.current", 0)),
        "largest_free": max(free, default=0),
    }


def oom_reason(message: str, figures: dict[str, int], snapshot: str | None) -> str:
    """An out-of-memory row's reason, one line: the error's first line (cut at WIDTH), what the allocator held
    when it failed, and the snapshot file's name (in the logs folder)."""
    held = (
        f"allocated {figures['allocated'] / MiB:,.1f} MiB, reserved {figures['reserved'] / MiB:,.1f} MiB, "
        f"largest free block {figures['largest_free'] / MiB:,.1f} MiB"
    )
    where = f"; memory snapshot {Path(snapshot).name}" if snapshot else ""
    return f"{first_line(message)} | {held}{where}"


def _append(path: Path, rows: list[Row]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _read(path: Path) -> list[Row]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ------------------------------------------------------------------ a finished step's rows (no torch)


def junit_rows(step: str, xml: Path) -> list[Row] | None:
    """One row per test case of a pytest junit file; None if there is none or it cannot be read (pytest was
    killed before writing it)."""
    try:
        cases = list(ET.parse(xml).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        return None
    out = []
    for c in cases:
        if not c.get("name"):  # the test that SIGINT interrupted: pytest leaves it an empty testcase
            continue
        result, reason, detail = "passed", "", ""
        for tag, name in (("failure", "failed"), ("error", "failed"), ("skipped", "skipped")):
            node = c.find(tag)
            if node is not None:
                result = name
                reason = node.get("message") or (node.text or "").strip()
                detail = (node.text or "").strip() or reason
                break
        check = f"{Path(c.get('classname', '').replace('.', '/')).name}::{c.get('name')}"
        out.append(row(step, check, result, float(c.get("time", 0) or 0), reason, detail))
    return out


_OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def running_test(log: str) -> str | None:
    """The test that was running when pytest -v stopped: the last test id its log shows without an outcome."""
    for line in reversed(log.splitlines()):
        match = re.match(r"^(\S+::\S+)", line)
        if match:
            return None if _OUTCOME.search(line) else match.group(1)
    return None


def stopped_at(log: str) -> str | None:
    """Where a test was when its step ran out of time: the line pytest reports on SIGINT, else the test's own
    frame (or the innermost one) in the first thread of faulthandler's last dump (faulthandler_timeout; the
    whole dump stays in the log)."""
    interrupted = re.findall(r"^(\S+:\d+): KeyboardInterrupt$", log, re.M)
    if interrupted:
        return interrupted[-1]
    if "Timeout (" not in log:
        return None
    dump = log.rsplit("Timeout (")[-1]
    threads = re.split(r"^(?:Current thread|Thread) 0x\w+ \(most recent call first\):$", dump, flags=re.M)
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', threads[1] if len(threads) > 1 else "")
    own = [f for f in frames if "/tests/" in f[0]] or frames
    return f"{own[0][0]}:{own[0][1]} in {own[0][2]}" if own else None


def tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def step_rows(logs: Path, step: str, code: int, seconds: float, limit: int) -> list[Row]:
    """The rows of a step that ended with exit status `code` after `seconds`: its test cases (junit file) or
    its own rows (rows file), then a row for the step itself where they do not explain how it ended."""
    log_path = logs / f"{step}.log"
    log = log_path.read_text(encoding="utf-8", errors="replace") if log_path.is_file() else ""
    out = junit_rows(step, logs / f"{step}.xml")
    if out is None:
        out = _read(logs / f"{step}.rows.jsonl")
    if code in (124, 137):  # timeout's status: the limit's SIGINT ended it (124) or the KILL after it (137)
        how = (
            f"interrupted (SIGINT) at {limit - GRACE_S} s"
            if code == 124
            else f"killed at {limit} s ({GRACE_S} s after SIGINT, which it did not end on)"
        )
        test, where = running_test(log), stopped_at(log)
        reason = f"over its limit: {how}" + (f", while running {test}" if test else "")
        reason += f" (at {where})" if where else ""
        detail = reason + "\n" + tail(log, 40)
        out.append(row(step, "(the step)", "timeout", seconds, reason, detail, 2 * WIDTH))  # all of it
    elif code not in (0, 5) and not any(r["result"] == "failed" for r in out):
        last = first_line(tail(log, 1)) or "(empty log)"
        reason = f"exit status {code}: {last}"
        out.append(row(step, "(the step)", "failed", seconds, reason, reason + "\n" + tail(log, 40)))
    elif not out:
        result = "skipped" if code == 5 else "passed"
        out.append(row(step, "(the step)", result, seconds, "no test marked gpu ran" if code == 5 else ""))
    return out


def report_step(logs: Path, step: str, code: int, seconds: float, limit: int, show_log: bool = False) -> int:
    """Print a finished step's rows (after its whole log with `show_log`), the last lines of each failure
    and, when it failed or timed out, where its log and junit file are and the log's tail; keep the rows for
    the summary. 1 if a row failed or timed out."""
    log = logs / f"{step}.log"
    text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    if show_log:
        print(text.rstrip())
    rows = step_rows(logs, step, code, seconds, limit)
    for r in rows:
        print(row_line(r))
    bad = [r for r in rows if r["result"] in ("failed", "timeout")]
    for r in bad:
        if r["check"] != "(the step)" and r["detail"] != r["reason"]:
            n = len(r["detail"].splitlines())
            print(f"\n--- {step} {r['check']}" + (f": the last 25 of {n} lines" if n > 25 else ""))
            print(tail(r["detail"], 25))
    if bad or code not in (0, 5):
        xml = logs / f"{step}.xml"
        print(f"\n--- {step}: exit status {code} after {seconds:.0f} s (limit {limit} s); log {log}"
              + (f", junit {xml}" if xml.is_file() else ", no junit file"))
        if not show_log:
            print(f"--- the log's last 30 lines:\n{tail(text, 30)}")
        print("---")
    _append(logs / "summary.jsonl", rows)
    return 1 if bad else 0


def summary(logs: Path) -> int:
    """Every step's rows as one Markdown table (also written to LOGS/summary.md); 1 if one failed."""
    rows = _read(logs / "summary.jsonl")
    counts = ", ".join(f"{sum(r['result'] == k for r in rows)} {k}" for k in RESULTS)
    text = f"{markdown_table(rows)}\n\n{counts}; logs: {logs}\n"
    (logs / "summary.md").write_text(text, encoding="utf-8")
    print(text, end="")
    return 1 if any(r["result"] in ("failed", "timeout") for r in rows) else 0


# ------------------------------------------------------------------ what a step left running (no torch)


def _proc(pid: str) -> tuple[str, int, int, bytes, str] | None:
    """(state, process group, session, environment, command line) of a process; None if it is gone or not
    ours (another user's environment cannot be read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        env = Path(f"/proc/{pid}/environ").read_bytes()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session, ...
    return fields[0], int(fields[2]), int(fields[3]), env, cmd.strip()


def leftovers(sid: int, marker: str) -> dict[int, str]:
    """The processes a step started that still run: those in its session (or process group) and those that
    carry its marker in their environment (a Jupyter kernel or a rank that started a session of its own)."""
    tag = f"GPU_CHECK_STEP={marker}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        info = _proc(entry.name)
        if info is None:
            continue
        state, pgrp, session, env, cmd = info
        if state == "Z":  # a zombie has ended already; its parent (or init) reaps it
            continue
        if (sid > 0 and sid in (pgrp, session)) or (marker and tag in env.split(b"\0")):
            found[int(entry.name)] = cmd
    return found


def end_leftovers(sid: int, marker: str, wait_s: float = 1.0) -> dict[int, str]:
    """End what a step left running: SIGTERM, then SIGKILL for those still there after `wait_s`. Returns
    the processes found, pid -> command line."""
    found = leftovers(sid, marker)
    for pid in found:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:  # gone already
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in found):
        time.sleep(0.05)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # ended on SIGTERM
            pass
    return found


# ------------------------------------------------------------------ preflight (imports torch)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])


def needed_torch() -> str:
    """The oldest torch labkit supports, from pyproject.toml."""
    match = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return match.group(1) if match else "0"


def _torch_checks(add: Callable[[str, bool, str, str], None]) -> list[str]:
    """Print torch's versions and GPUs and what labkit finds wrong with this torch, each as a row; the
    reasons the checks cannot run here (empty if they can)."""
    try:
        import torch
    except Exception as exc:  # torch itself is broken: nothing else can run
        add("import torch", False, f"{type(exc).__name__}: {exc}", traceback.format_exc())
        return ["torch does not import"]
    cuda = torch.cuda.is_available()
    nccl = "-"
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # a build without NCCL
            nccl = f"none ({type(exc).__name__})"
    cudnn = torch.backends.cudnn.version() if cuda else "-"
    versions = f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, cuDNN {cudnn}"
    print(versions)
    need = needed_torch()
    old = _version(torch.__version__) < _version(need)
    if old:
        banner = "!" * 100
        print(banner)
        print(f"!!! torch {torch.__version__} is OLDER than labkit needs (torch>={need}, pyproject.toml):")
        print(f"!!! expect failures from that first; install torch>={need} built for this driver's CUDA")
        print(banner)
    add("torch version", not old, f"{versions} (labkit needs torch>={need})", "")
    gpus = torch.cuda.device_count() if cuda else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    print(f"GPUs torch sees: {gpus} {names}")
    no_gpu = (
        "no CUDA build of torch with a visible GPU here: install one that matches the driver (nvidia-smi "
        "shows its CUDA version), e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128"
    )
    add("a GPU torch can use", gpus > 0, f"{gpus} GPU(s): {', '.join(names)}" if gpus else no_gpu, "")
    try:
        from labkit.machine import _torch_compat

        found = _torch_compat.problems()
    except Exception as exc:  # labkit does not import on this torch
        found = [f"labkit does not import: {type(exc).__name__}: {exc}"]
    print("labkit.machine._torch_compat.problems():", "none" if not found else "")
    for line in found:
        print(f"  {line}")
    add(
        "labkit.machine._torch_compat.problems()",
        not found,
        f"{len(found)}: {found[0]}" if found else "none",
        "\n".join(found),
    )
    return [] if gpus else ["no GPU torch can use"]


def preflight(logs: Path) -> int:
    """Print the versions and what labkit finds wrong with this torch, kept as rows. Writes LOGS/stop (and
    returns 2) when the checks cannot run here: no CUDA build of torch with a GPU, or a missing package."""
    import importlib.util
    import platform

    t0 = time.perf_counter()
    found_rows: list[Row] = []

    def add(check: str, ok: bool, reason: str, detail: str) -> None:
        seconds = time.perf_counter() - t0
        found_rows.append(row("preflight", check, "passed" if ok else "failed", seconds, reason, detail))

    print(f"python {platform.python_version()} ({sys.executable})")
    stop = _torch_checks(add)
    need = ["cloudpickle", "numpy", "matplotlib", "papermill", "nbformat", "pytest", "ipykernel"]
    missing = " ".join(m for m in need if importlib.util.find_spec(m) is None)
    fix = f"missing {missing} (pip install -e '.[test]' where there is a network)"
    add("Python packages", not missing, fix if missing else "all there", "")
    if missing:
        stop.append(f"missing {missing}")
    _append(logs / "preflight.rows.jsonl", found_rows)
    if stop:
        (logs / "stop").write_text("; ".join(stop) + "\n", encoding="utf-8")
        print(f"the GPU checks cannot run here: {'; '.join(stop)}")
        return 2
    return 0


def run_pytest(args: list[str]) -> int:
    """pytest with `args`, in this process: SIGINT stops it (it then writes its junit file) even where
    tests/gpu_check.sh was started with SIGINT ignored (see `_cli`), which `python -m pytest` would keep."""
    import pytest

    return int(pytest.main(args))


# ------------------------------------------------------------------ the one-rank rows (import torch)


def _lab02(on_gpu: bool) -> tuple[str, bool]:
    from labkit.course.experiments.oom_batch import Params, dp_train, fixed_micro_batch

    p = Params(world_size=1).resolve(on_gpu=on_gpu)
    micro, est = fixed_micro_batch(p)
    r = dp_train(p.config(), p.global_batch, micro, precision="autocast", checkpointing=True)
    ratio = est.peak / r.peak_bytes
    return f"micro-batch {micro}: estimate {est.peak / MiB:.1f} MiB / peak {r.peak_mib:.1f} = {ratio:.3f}", (
        abs(ratio - 1) < 0.10
    )


def _lab02_capped(on_gpu: bool) -> tuple[str, bool]:
    import torch

    from labkit.course.experiments.oom_batch import Params, dp_train, fixed_micro_batch
    from labkit.machine import device_memory

    p = Params(world_size=1).resolve(on_gpu=on_gpu)
    micro, _ = fixed_micro_batch(p)
    limit = int(p.memory_mib * MiB)
    try:
        with device_memory.memory_limit(limit):
            dp_train(p.config(), p.global_batch, p.global_batch)
        written = "fits"
    except torch.OutOfMemoryError:
        written = "OOM"
    with device_memory.memory_limit(limit):
        fixed = dp_train(p.config(), p.global_batch, micro, precision="autocast", checkpointing=True)
    return f"{p.memory_mib} MiB: as written {written}, fixed {fixed.peak_mib:.1f} MiB", written == "OOM"


def _finder(on_gpu: bool) -> tuple[str, bool]:
    from labkit.course.experiments.oom_batch import Params, max_micro_batch
    from labkit.machine import device_memory

    p = Params(world_size=1).resolve(on_gpu=on_gpu)
    with device_memory.memory_limit(int(p.memory_mib * MiB)):
        found = max_micro_batch(p.config(), precision="autocast", checkpointing=True, limit=256)
    measured = f"largest micro-batch {found.batch} in {len(found.trials)} trials ({p.memory_mib} MiB)"
    return measured, found.batch >= 1


def _fragmentation(fix: str | None) -> Callable[[bool], tuple[str, bool]]:
    def check(on_gpu: bool) -> tuple[str, bool]:
        from labkit.course.experiments.fragmentation import fragment

        r = fragment(180, fix)
        expect_oom = fix in (None, "empty_cache")
        return (
            f"{'OOM' if r['oom'] else 'fits'}, largest free block {r['largest_free_block_mib']:.0f} MiB",
            (r["oom"] is not None) == expect_oom,
        )

    return check


def _precisions(on_gpu: bool) -> tuple[str, bool]:
    from labkit.course.experiments.precision import compare_precisions
    from labkit.models import GPTConfig

    small = GPTConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=256, seq_len=32)
    r = compare_precisions(small, 4, steps=2)
    return f"ran: {', '.join(sorted(map(str, r)))}", True


def _lab04_layers(on_gpu: bool) -> tuple[str, bool]:
    import labkit
    from labkit.course.experiments.imbalanced_pipeline import Params
    from labkit.layer_profile import profile_layers
    from labkit.models import seeded_model, synthetic_batch

    p = Params().resolve(on_gpu=on_gpu)
    config = p.config()
    dev = labkit.device()
    micro = max(1, p.global_batch // p.stages)  # one micro-batch of the 1F1B split
    x, y = synthetic_batch(config, micro, device=dev)
    layers = profile_layers(seeded_model(config, device=dev), x, y, repeats=3)
    head, blocks = layers[-1].ms, [la.ms for la in layers[1:-1]]
    ratio = head / (sum(blocks) / len(blocks))
    return f"head {head:.2f} ms = {ratio:.1f} blocks of {sum(blocks) / len(blocks):.2f} ms", ratio > 1.3


def _lab03_compute(on_gpu: bool) -> tuple[str, bool]:
    import torch

    import labkit
    from labkit import Cluster
    from labkit.course.experiments.unoverlapped_comms import Params
    from labkit.course.forecast import fp32_flops_per_s, overlap_forecast
    from labkit.models import seeded_model, synthetic_batch

    if not on_gpu:
        return "skipped: the forecast is a GPU's", True
    p = Params(world_size=2).resolve(on_gpu=True)
    config, dev = p.config(), labkit.device()
    model = seeded_model(config, device=dev)
    x, y = synthetic_batch(config, p.micro_batch, device=dev)
    times = []
    for _ in range(4):
        t0 = labkit.clock()
        model(x, y).backward()
        times.append((labkit.clock() - t0) * 1e3)
    name = torch.cuda.get_device_name(dev)
    rate = fp32_flops_per_s(name) or fp32_flops_per_s("H100")
    link = Cluster.preset("dgx-h100").intra_node
    f = overlap_forecast(config, p.micro_batch, 2, link, rate, bucket_cap_mb=p.bucket_cap_mb)
    measured = sorted(times)[len(times) // 2]
    ratio = measured / f.terms["compute"]
    return f"fwd+bwd {measured:.1f} ms, forecast {f.terms['compute']:.1f} ms ({ratio:.2f}x, {name})", (
        0.5 < ratio < 2
    )


ROWS: list[tuple[str, Callable[[bool], tuple[str, bool]]]] = [
    ("lab 02: estimate vs measured peak, fixed step, uncapped", _lab02),
    ("lab 02: under the cap, the step as written OOMs and the fix fits", _lab02_capped),
    ("lab 02: the batch finder under the cap", _finder),
    *[(f"fragmentation: {fix or 'as written'}", _fragmentation(fix)) for fix in
      (None, "empty_cache", "expandable_segments", "max_split_size")],
    ("precisions: fp32, bf16 and fp16 autocast", _precisions),
    ("lab 04: layer costs at its GPU sizes (the heavy head)", _lab04_layers),
    ("lab 03: compute at its GPU sizes vs the forecast", _lab03_compute),
]


def _record_memory_history() -> bool:
    """Keep the allocator's recent history, so that an OOM can be dumped as a snapshot (torch's private
    API, hence guarded: labkit itself reaches private names only in labkit/machine/_torch_compat.py)."""
    import torch

    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    if record is None or not hasattr(torch.cuda.memory, "_dump_snapshot"):
        return False
    try:
        record(max_entries=20_000, stacks="python")  # Python stacks only: C++ unwinding slows every alloc
    except TypeError:  # an older signature
        record(max_entries=20_000)
    return True


def _oom_reason(exc: BaseException, check: str, out_dir: Path | None, history: bool) -> str:
    """The reason of a row that ran out of GPU memory: the allocator's figures now (the frames that held the
    memory are still alive, held by the exception) and, with history, a snapshot file."""
    import torch

    message = f"{type(exc).__name__}: {exc}"
    try:
        figures = memory_figures(torch.cuda.memory_stats(), torch.cuda.memory_snapshot())
        snapshot = None
        if history and out_dir is not None:
            slug = re.sub(r"[^a-z0-9]+", "_", check.lower()).strip("_")[:60]
            snapshot = str(out_dir / f"oom_{slug}.pickle")
            torch.cuda.memory._dump_snapshot(snapshot)
            print(f"memory snapshot of {check!r}: {snapshot} (open it at https://pytorch.org/memory_viz)")
    except Exception as err:  # the figures are extra: the error itself is still the row's reason
        return f"{message} (no memory figures: {type(err).__name__}: {err})"
    return oom_reason(message, figures, snapshot)


def rows(rows_file: str | None = None) -> list[Row]:
    """Every row, on this rank; each is printed (and appended to `rows_file`) as it finishes, so that a step
    stopped at its limit still has the rows before."""
    import torch

    import labkit
    from labkit.machine import device_memory

    on_gpu = labkit.device().type == "cuda"
    out_dir = Path(rows_file).parent if rows_file else None
    history = on_gpu and _record_memory_history()
    out: list[Row] = []

    def done(r: Row) -> None:
        out.append(r)
        print(row_line(r), flush=True)
        if rows_file:
            _append(Path(rows_file), [r])

    base = device_memory.baseline_bytes()
    ok = base > 0 or not on_gpu
    done(row("rows", "warm baseline (cuBLAS workspaces)", "passed" if ok else "failed", 0.0,
             f"{base / MiB:.1f} MiB"))
    for name, check in ROWS:
        t0 = time.perf_counter()
        try:
            measured, ok = check(on_gpu)
            r = row("rows", name, "passed" if ok else "failed", time.perf_counter() - t0, measured)
        except Exception as exc:  # a failed row, not a failed table: its whole traceback goes to the log
            detail = traceback.format_exc()
            print(detail, flush=True)
            reason, width = f"{type(exc).__name__}: {exc}", WIDTH
            if on_gpu and isinstance(exc, torch.OutOfMemoryError):
                reason, width = _oom_reason(exc, name, out_dir, history), 4 * WIDTH  # the figures too
                detail = f"{reason}\n{detail}"
            r = row("rows", name, "failed", time.perf_counter() - t0, reason, detail, width)
        done(r)
    return out


def main(rows_file: str | None = None) -> int:
    import labkit

    cluster = labkit.Cluster.resolve("auto", 1)
    print(f"one rank on {cluster.label}:", flush=True)
    (table,) = labkit.launch(rows, rows_file, world_size=1, cluster=cluster, timeout_s=300)
    print(f"\none rank on {cluster.label}: {'check':62} {'result':7} {'s':>5}  measured")
    for r in table:
        print(f"{r['check'][:62]:62} {r['result']:7} {r['seconds']:5.1f}  {r['reason']}")
    return 0 if all(r["result"] == "passed" for r in table) else 1


def _cli(argv: list[str]) -> int:
    # A background job of a non-interactive shell starts with SIGINT ignored, its children inherit that, and
    # Python then keeps it ignored: timeout's SIGINT at a step's limit would do nothing, and its KILL would
    # leave no junit file. Python's own handler makes SIGINT a KeyboardInterrupt again.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    command, args = (argv[0], argv[1:]) if argv else ("rows", [])
    if command == "rows":  # LOGS: where the rows file and OOM snapshots go
        return main(str(Path(args[0]) / "rows.rows.jsonl") if args else None)
    if command == "preflight":
        return preflight(Path(args[0]))
    if command == "pytest":
        return run_pytest(args)
    if command == "step-rows":  # LOGS STEP EXIT SECONDS LIMIT [--show-log]
        logs, step, code, seconds, limit = args[:5]
        return report_step(Path(logs), step, int(code), float(seconds), int(limit), "--show-log" in args[5:])
    if command == "end-leftovers":
        sid, marker = args
        for pid, cmd in end_leftovers(int(sid or 0), marker).items():
            print(f"  ended leftover process {pid}: {cmd[:200]}")
        return 0
    if command == "summary":
        return summary(Path(args[0]))
    print(f"unknown command {command!r}: rows, preflight, pytest, step-rows, end-leftovers or summary")
    return 2


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
