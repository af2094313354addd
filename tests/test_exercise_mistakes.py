"""Mutation tests: plausible wrong answers to each exercise fail at its check, in bounded time, with the hint
that names the mistake (issue: exercise checks). Each wrong answer replaces the solution block of the solution
notebook's exercise cell; the notebook is cut to the cells the check needs (parameters, imports, the exercise,
its check) and run with papermill on the emulated cluster."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import papermill
import pytest
from test_labs import _env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _kernel_finds_labkit(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])


# lab, the exercise cell's marker, the check cell's marker, and per mistake: the answer and the hint's words
SUM = ("00_cluster_tour", "def sum_over_ranks", "check_sum_over_ranks(results")
TP_COMM = (
    "01_parallelism_choice",
    "def my_tp_comm_ms(config, micro_batch, tp, link)",
    "check_tp_comm(my_tp_comm_ms",
)
LAYOUT = ("01_parallelism_choice", "my_layout = (mine.dp, mine.tp, mine.pp)", "check_layout_choice(my_layout")
ACCUMULATE = ("02_oom_batch", "def accumulate(ddp, batches)", "check_accumulation(fixed")
DDP_HOOK = ("03_unoverlapped_comms", "class MyOverlappedDDP", "check_overlapped_ddp(drill")
BALANCE = ("04_imbalanced_pipeline", "def my_balance(costs, stages)", "check_balance(my_balance")
STRAGGLER = (
    "05_unprofiled_run",
    "def my_find_straggler(breakdown)",
    "check_find_straggler(my_find_straggler",
)

_DP = ("    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]", "    return sizes[::-1]")
_GREEDY = """    target, sizes, count, total = sum(costs) / stages, [], 0, 0.0
    for i, c in enumerate(costs):
        if count and total + c > target and len(sizes) < stages - 1:
            sizes.append(count)
            count, total = 0, 0.0
        count, total = count + 1, total + c
    return sizes + [count]"""
_EVEN = "    return [n // stages + (1 if s < n % stages else 0) for s in range(stages)]"

MISTAKES = {
    "forward all-reduces only": (
        TP_COMM,
        {"config.n_layers * 4 * collective_time_s": "config.n_layers * 2 * collective_time_s"},
        "backward has two more",
    ),
    "a 1/tp shard all-reduced": (
        TP_COMM,
        {"config.d_model * 4\n": "config.d_model * 4 // tp\n"},
        "1/tp shard",
    ),
    "one block only": (
        TP_COMM,
        {"config.n_layers * 4 * collective_time_s": "4 * collective_time_s"},
        "multiply by the",
    ),
    "plain data parallelism": (
        LAYOUT,
        {"my_layout = (mine.dp, mine.tp, mine.pp)": "my_layout = (8, 1, 1)"},
        "more model parallelism",
    ),
    "tensor parallel over every GPU": (
        LAYOUT,
        {"my_layout = (mine.dp, mine.tp, mine.pp)": "my_layout = (1, 8, 1)"},
        "tp group crosses nodes",
    ),
    "a slow layout that fits": (
        LAYOUT,
        {"my_layout = (mine.dp, mine.tp, mine.pp)": "my_layout = (1, 4, 2)"},
        "more than 10 % above the fastest",
    ),
    # a product that is not the world size, and a reason without the plan's numbers: tests/test_planner.py
    "all_reduce result assigned": (SUM, {"dist.all_reduce(t)": "t = dist.all_reduce(t)"}, "returns None"),
    "sum divided by world size": (
        SUM,
        {"dist.all_reduce(t)": "dist.all_reduce(t)\n    t /= dist.get_world_size()"},
        "do not divide",
    ),
    "no all_reduce": (SUM, {"dist.all_reduce(t)": "pass"}, "still holds its own value"),
    "forward outside no_sync": (
        ACCUMULATE,
        {
            "        with ddp.no_sync():\n            (ddp(x, y) / n).backward()": "        loss = ddp(x, y) / n\n        with ddp.no_sync():\n            loss.backward()"
        },
        "its forward as well as its backward",
    ),
    "no_sync on every micro-step": (
        ACCUMULATE,
        {
            "    x, y = batches[-1]\n    (ddp(x, y) / n).backward()": "    x, y = batches[-1]\n    with ddp.no_sync():\n        (ddp(x, y) / n).backward()"
        },
        "Run the last micro-batch outside",
    ),
    "last micro-batch forgotten": (
        ACCUMULATE,
        {"    x, y = batches[-1]\n    (ddp(x, y) / n).backward()": ""},
        "7 forward passes for 8 micro-batches",
    ),
    "buckets flushed as they complete": (
        DDP_HOOK,
        {
            "        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:\n"
            "            self._flush(self.buckets[self._next_bucket])\n"
            "            self._next_bucket += 1": "        if bucket.pending == 0:\n            self._flush(bucket)\n            self._next_bucket += 1"
        },
        "in index order",
    ),
    "next bucket never advanced": (DDP_HOOK, {"            self._next_bucket += 1\n": ""}, "flushed again"),
    "async_op forgotten": (DDP_HOOK, {", async_op=True)": ")"}, "async_op=True"),
    "divided in the flush": (
        DDP_HOOK,
        {
            "        self._after_launch(bucket, t0)": "        self._after_launch(bucket, t0)\n"
            "        bucket.work.wait()\n"
            "        bucket.buffer.div_(dist.get_world_size())"
        },
        "divided by the world size twice",
    ),
    "the base class called": (
        DDP_HOOK,
        {
            "        bucket = self._bucket_of[id(param)]\n": "        super()._on_grad_ready(param)\n        return\n"
        },
        "yours to write",
    ),
    "greedy split": (BALANCE, {_DP: _GREEDY}, "greedy"),
    "split by layer count": (BALANCE, {_DP: _EVEN}, "split by layer count"),
    "cut positions returned": (
        BALANCE,
        {
            "    return sizes[::-1]": "    out, total = [], 0\n    for k in sizes[::-1]:\n        total += k\n        out.append(total)\n    return out"
        },
        "cut positions",
    ),
    "sum minimised instead of the bottleneck": (
        BALANCE,
        {
            "value = max(best[k - 1][j], prefix[i] - prefix[j])": "value = best[k - 1][j] + prefix[i] - prefix[j]"
        },
        "not a sum",
    ),
    "empty stages allowed": (
        BALANCE,
        {
            "        for i in range(k, n - (stages - k) + 1):\n            for j in range(k - 1, i):": "        for i in range(n + 1):\n            for j in range(i + 1):"
        },
        "at least one layer",
    ),
    "bad input not refused": (
        BALANCE,
        {
            "    if stages > n:\n        raise ValueError(": "    if False:\n        raise ValueError(",
            '            raise ValueError(f"costs[{i}]': '            pass  # (f"costs[{i}]',
        },
        "raise ValueError",
    ),
    "step times compared": (
        STRAGGLER,
        {
            "key=lambda b: b.compute_ms)": "key=lambda b: b.step_ms)",
            "[b.compute_ms for b in": "[b.step_ms for b in",
            "ratio = slow.compute_ms /": "ratio = slow.step_ms /",
        },
        "compute_ms",
    ),
    "the waiting rank named": (
        STRAGGLER,
        {
            "key=lambda b: b.compute_ms)": "key=lambda b: b.wait_ms)",
            "[b.compute_ms for b in": "[b.wait_ms for b in",
            "ratio = slow.compute_ms /": "ratio = slow.wait_ms /",
        },
        "waits the most",
    ),
    "no threshold": (
        STRAGGLER,
        {"return (slow.rank, ratio) if ratio >= 1.25 else None": "return (slow.rank, ratio)"},
        "noise",
    ),
    "mean of every rank": (
        STRAGGLER,
        {
            "ratio = slow.compute_ms / statistics.median(others)": "ratio = slow.compute_ms / statistics.mean([b.compute_ms for b in breakdown])"
        },
        "median of the other ranks",
    ),
}


def _mutated(lab: str, exercise: str, check: str, edits: dict[str, str]) -> nbformat.NotebookNode:
    nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    # the parameters, the imports, cells the exercise needs (tagged exercise_setup), the exercise and its check
    keep = code[:2] + [
        c
        for c in code[2:]
        if exercise in c.source or check in c.source or "exercise_setup" in c.metadata.get("tags", [])
    ]
    (cell,) = [c for c in keep if exercise in c.source]
    # the solution blocks of the cell (### BEGIN SOLUTION ... ### END SOLUTION) take the edits
    parts = cell.source.split("### END SOLUTION")
    for old, new in edits.items():
        first, last = (
            old if isinstance(old, tuple) else (old, old)
        )  # a (first line, last line) pair: that range
        hits = [i for i, part in enumerate(parts) if first in part.split("### BEGIN SOLUTION")[-1]]
        assert hits, f"the mutation's text {first!r} is not in a solution block of {lab}"
        head, _, block = parts[hits[0]].rpartition("### BEGIN SOLUTION")
        a = block.index(first)
        b = block.index(last, a) + len(last)
        parts[hits[0]] = head + "### BEGIN SOLUTION" + block[:a] + new + block[b:]
    cell.source = "### END SOLUTION".join(parts)
    nb.cells = keep
    return nb


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_plausible_mistake_fails_at_its_check_with_its_hint(name, tmp_path):
    (lab, exercise, check), edits, hint = MISTAKES[name]
    path = tmp_path / f"{lab}.ipynb"
    nbformat.write(_mutated(lab, exercise, check, edits), path)
    t0 = time.time()
    with pytest.raises(papermill.PapermillExecutionError) as info:
        papermill.execute_notebook(
            str(path),
            str(tmp_path / "out.ipynb"),
            parameters={"cluster": "cpu"},
            cwd=str(tmp_path),
            kernel_name="python3",
            progress_bar=False,
            execution_timeout=120,
        )
    took = time.time() - t0
    err = info.value
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    (failed,) = [c for c in out.cells if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    # the check cell, or the exercise cell itself when the ranks catch the mistake while it runs
    assert check in failed.source or exercise in failed.source, f"{name}: failed before its exercise"
    assert hint in str(err.evalue), f"{name}: the hint does not name the mistake: {err.evalue}"
    assert took < 60, f"{name}: took {took:.0f} s to fail"


@pytest.mark.parametrize(
    "lab,exercise,check", [SUM, TP_COMM, LAYOUT, ACCUMULATE, DDP_HOOK, BALANCE, STRAGGLER]
)
def test_the_cut_notebook_keeps_the_solution_s_cells_in_order(lab, exercise, check):
    """The right answer passes each check in the whole solution notebook (tests/test_labs.py runs it), and each
    mistake above must fail in its exercise or check cell with its own hint, so a cut that lost a cell the
    check needs fails there. What is left to hold: the cut keeps the solution's own cells, unchanged and in order,
    its exercise before its check. (Running the seven cut notebooks with the right answer took ~65 s.)"""
    cut = _mutated(lab, exercise, check, {})
    solution = [
        c.source
        for c in nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4).cells
        if c.cell_type == "code"
    ]
    kept = [c.source for c in cut.cells]
    positions = [solution.index(src) for src in kept]
    assert positions == sorted(positions) and positions[:2] == [0, 1]  # parameters and imports first
    where = {
        name: next(i for i, src in enumerate(kept) if marker in src)
        for name, marker in (("exercise", exercise), ("check", check))
    }
    assert where["exercise"] <= where["check"]
