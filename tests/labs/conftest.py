"""What every lab's tests share: its solution notebook run with papermill on its `Params.TEST`, its lab
notebook checked against its solution up to the first exercise, its script under torchrun on `Params.SMOKE`,
and plausible wrong answers to its exercises run through the notebook's own cells (mutation tests). Each lab's
test file (tests/labs/test_<lab>.py) holds that lab's expectations once and applies them to each run."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from labkit.course.execute import execute
from labkit.course.experiments import registry
from labkit.course.forecast import verdict
from labkit.course.records import read_records

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


@pytest.fixture(autouse=True)
def _kernels_find_labkit(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", _env()["PYTHONPATH"])


@pytest.fixture
def run_solution(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """`run_solution(lab, **overrides)`: the solution notebook run with its Params.TEST (and `overrides`); its
    records. A failing cell fails the test with papermill's error (no retry)."""

    def run(lab: str, **overrides: Any) -> dict[str, Any]:
        params = {**registry.params_of(lab).TEST, **overrides}
        out = tmp_path / f"{lab}.ipynb"
        done = execute(
            ROOT / "solutions" / f"{lab}.ipynb", out, parameters=params, cwd=tmp_path, cell_timeout=300
        )
        assert done.ok, f"{lab} with {params}: {done.error}"
        return read_records(out)

    return run


@pytest.fixture
def run_on_fake_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., tuple[dict[str, Any], str]]:
    """`run_on_fake_cuda(lab, gpus=2, **overrides)`: the solution notebook's real-GPU branch, run with papermill
    on CI's fake CUDA machine of `gpus` GPUs (`labkit.machine.emulate.fake_cuda`: torch.cuda's memory API on labkit's
    caching-allocator model, tensors on the CPU, collectives on the virtual clock) with cluster "auto", its
    Params.TEST and `overrides`; (its records, the text it printed). A failing cell fails the test."""

    def run(lab: str, gpus: int = 2, **overrides: Any) -> tuple[dict[str, Any], str]:
        monkeypatch.setenv("LABKIT_FAKE_CUDA", str(gpus))
        params = {**registry.params_of(lab).TEST, "cluster": "auto", **overrides}
        out = tmp_path / f"{lab}_fake_cuda.ipynb"
        done = execute(
            ROOT / "solutions" / f"{lab}.ipynb", out, parameters=params, cwd=tmp_path, cell_timeout=300
        )
        assert done.ok, f"{lab} on fake CUDA with {params}: {done.error}"
        return read_records(out), printed(out)

    return run


def printed(path: Path) -> str:
    """Everything a run notebook printed (its stream outputs), in order."""
    nb = nbformat.read(path, as_version=4)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


@pytest.fixture
def read_printed() -> Callable[[Path], str]:
    """`read_printed(path)`: what a run notebook printed (`printed`), for tests that run it themselves."""
    return printed


def code_cells(path: Path) -> list[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


@pytest.fixture
def lab_matches_solution() -> Callable[[str], None]:
    """Up to its first stub a lab is its solution's code, cell for cell: the solution's papermill run runs
    exactly those cells, so the lab runs until its first exercise (no solution-only cell may come before
    it)."""

    def check(lab: str) -> None:
        mine = code_cells(ROOT / "labs" / f"{lab}.ipynb")
        first_stub = next(i for i, src in enumerate(mine) if "raise NotImplementedError(" in src)
        solution = code_cells(ROOT / "solutions" / f"{lab}.ipynb")
        first_exercise = next(i for i, src in enumerate(solution) if "### BEGIN SOLUTION" in src)
        assert mine[:first_stub] == solution[:first_exercise], (
            f"{lab}: before its first exercise the lab's code differs from its solution's (a solution-only "
            "cell, or labs/ out of date: run labkit build)"
        )

    return check


@pytest.fixture
def torchrun_lab(tmp_path: Path) -> Callable[..., tuple[subprocess.CompletedProcess, dict[str, Any] | None]]:
    """`torchrun_lab(lab, n, *args)`: `torchrun --standalone --nproc-per-node n -m <lab's module>` with its
    Params.SMOKE (then `args`); (the finished process, its records or None)."""

    def run(lab: str, n: int, *args: str, timeout: float = 300):
        params = registry.params_of(lab)
        sets = [a for k, v in params.SMOKE.items() for a in ("--set", k, json.dumps(v))]
        out = tmp_path / f"{lab}_{n}.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(n),
            "-m",
            registry.module_of(lab),
            "--out",
            str(out),
            *sets,
            *args,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=_env())
        return proc, (json.loads(out.read_text()) if out.exists() else None)

    return run


@pytest.fixture
def simulated_lab(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """`simulated_lab(lab, n, *args)`: the lab's script on a simulated DGX H100 node (`--cluster sim:dgx-h100
    --world-size n`, its GPU sizes, then `args`); its records, with "wall_s" added. A failure fails the test
    with the script's output."""

    def run(lab: str, n: int, *args: str, timeout: float = 300) -> dict[str, Any]:
        out = tmp_path / f"{lab}_sim{n}.json"
        cmd = [
            sys.executable,
            "-m",
            registry.module_of(lab),
            "--cluster",
            "sim:dgx-h100",
            "--world-size",
            str(n),
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*cmd, "--out", str(out), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
            env=_env(),
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - t0}

    return run


def _check_common(rec: dict[str, Any], lab: str, *, torchrun: bool, world_size: int) -> None:
    """What every lab's records hold, wherever they were measured."""
    for key in ("before", "after", "limit", "unit", "meaning", "metric", "params"):
        assert key in rec, f"{lab}: no {key!r}"
    assert set(rec["meaning"]) == {"before", "after", "limit"}
    assert isinstance(rec["before"], float) and isinstance(rec["after"], float) and rec["after"] > 0
    if torchrun:
        assert rec["lab"] == lab and rec["torchrun"] is True and rec["world_size"] == world_size
        assert rec["emulated"] is False and ("torchrun on CPU" in rec["where"] or "on GPU" in rec["where"])


@pytest.fixture
def check_common() -> Callable[..., None]:
    """`check_common(rec, lab, torchrun=..., world_size=...)`: what every lab's records hold."""
    return _check_common


def _check_verdict(rec: dict[str, Any], text: str, *, targets: str = "time") -> None:
    """The verdict printed is the one the measured numbers call for (`labkit.course.forecast.verdict`), whichever.

    For CI's fake CUDA machine: there compute is the CPU time of Python-heavy toy operators on a shared
    2-core runner, which spreads a lesson's ratios by a fifth or more, so the course's targets themselves are
    held on the emulated and simulated clusters' deterministic clocks. The hint after "does not show" is
    left out."""
    before, after, limit = rec["before"], rec["after"], rec["limit"]
    printed = verdict(before, after, limit, rec["where"], targets=targets, hint="").rstrip()
    assert printed in text, (printed, text[-2000:])


@pytest.fixture
def check_verdict() -> Callable[..., None]:
    """`check_verdict(rec, text, targets="time")`: the printed verdict is the one its numbers call for."""
    return _check_verdict


# --------------------------------------------------------------------------------- mutation tests


def cut_notebook(lab: str, exercise: str, check: str) -> nbformat.NotebookNode:
    """The solution notebook cut to what one exercise's check needs: the parameters, the imports, the cells
    tagged exercise_setup, the exercise and its check, in the solution's order."""
    nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    keep = code[:2] + [
        c
        for c in code[2:]
        if exercise in c.source or check in c.source or "exercise_setup" in c.metadata.get("tags", [])
    ]
    nb.cells = keep
    return nb


def mutate(source: str, edits: dict[Any, str], lab: str) -> str:
    """`source` with each edit made inside its solution blocks (### BEGIN SOLUTION ... ### END SOLUTION); a
    key that is a (first line, last line) pair replaces that range."""
    parts = source.split("### END SOLUTION")
    for old, new in edits.items():
        first, last = old if isinstance(old, tuple) else (old, old)
        hits = [i for i, part in enumerate(parts) if first in part.split("### BEGIN SOLUTION")[-1]]
        assert hits, f"the mutation's text {first!r} is not in a solution block of {lab}"
        head, _, block = parts[hits[0]].rpartition("### BEGIN SOLUTION")
        a = block.index(first)
        b = block.index(last, a) + len(last)
        parts[hits[0]] = head + "### BEGIN SOLUTION" + block[:a] + new + block[b:]
    return "### END SOLUTION".join(parts)


@pytest.fixture(scope="module")
def mutations_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, tuple[str, str]]]:
    """`mutations_run(lab, exercise, check, mistakes)`: in one kernel, the cut notebook's cells before the
    exercise once, then for each mistake the exercise cell with its edits and the check cell (and the right
    answer last); per mistake, (the source of the cell that failed, its error's text) — ("", "") if nothing
    failed — and where the exercise's own cell failed, under "<mistake>, then its check", what the check cell
    says when run after it. One kernel per lab: each mistake's cells run after the setup, as a learner's
    re-run of the two cells."""
    cache: dict[tuple, dict[str, tuple[str, str]]] = {}

    def run(
        lab: str, exercise: str, check: str, mistakes: dict[str, dict[Any, str]]
    ) -> dict[str, tuple[str, str]]:
        key = (lab, exercise, check, tuple(mistakes))
        if key in cache:
            return cache[key]
        nb = cut_notebook(lab, exercise, check)
        at = next(i for i, c in enumerate(nb.cells) if exercise in c.source)
        setup, rest = nb.cells[:at], nb.cells[at:]
        # the parameters cell, then the test's overrides as papermill would inject them, then the rest of the
        # setup
        overrides = "\n".join(f"{k} = {v!r}" for k, v in registry.params_of(lab).TEST.items())
        cells = [setup[0], nbformat.v4.new_code_cell(overrides), *setup[1:]]
        out: dict[str, tuple[str, str]] = {}
        cwd = tmp_path_factory.mktemp(lab)
        client = NotebookClient(
            nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
        )
        nb.cells = []

        def execute_cell(cell: nbformat.NotebookNode) -> None:
            nb.cells.append(cell)  # nbclient writes each executed cell back into its notebook
            client.execute_cell(cell, len(nb.cells) - 1)

        with client.setup_kernel():
            for cell in cells:
                execute_cell(cell)
            for name, edits in [*mistakes.items(), ("the right answer", {})]:
                trial = [
                    nbformat.v4.new_code_cell(
                        mutate(c.source, edits, lab) if exercise in c.source else c.source
                    )
                    for c in rest
                ]
                out[name] = ("", "")
                for k, cell in enumerate(trial):
                    try:
                        execute_cell(cell)
                    except CellExecutionError as err:
                        out[name] = (cell.source, str(err))
                        # the learner runs the check next all the same: it must not answer for an earlier
                        # attempt (issue 44), kept as "<name>, then its check"
                        if exercise in cell.source and check not in cell.source:
                            later = next(c for c in trial[k + 1 :] if check in c.source)
                            try:
                                execute_cell(later)
                                out[f"{name}, then its check"] = (later.source, "")
                            except CellExecutionError as then:
                                out[f"{name}, then its check"] = (later.source, str(then))
                        break
        cache[key] = out
        return out

    return run


# ------------------------------------------------------------------------------ on GPUs (tests/gpu_check.sh)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _fewest_ranks(lab: str) -> int:
    """The fewest ranks a lab runs on (its ranks field's minimum)."""
    params = registry.params_of(lab)
    field = next(f for f in dataclasses.fields(params) if f.name == params.RANKS)
    return int(field.metadata.get("minimum") or 1)


@pytest.fixture
def gpu_notebook(tmp_path: Path) -> Callable[..., dict[str, Any]]:
    """`gpu_notebook(lab, **overrides)`: the solution notebook on this machine's GPUs (cluster="gpu"), on the
    ranks the lab takes on a node of this many GPUs (`Params.for_machine`), its Params.TEST and `overrides`;
    its records. Skipped, saying why, where the node has fewer GPUs than those ranks: a run that fell back to
    the emulated cluster would prove nothing about the GPU branch."""

    def run(lab: str, **overrides: Any) -> dict[str, Any]:
        params = registry.params_of(lab)
        gpus = _gpus()
        ranks = params().for_machine(gpus).ranks or 1
        if gpus < ranks:
            pytest.skip(f"{lab} takes {ranks} GPU ranks for its lesson; this node has {gpus}")
        parameters = {**params.TEST, "cluster": "gpu", **overrides}
        if params.RANKS:
            parameters.setdefault(params.RANKS, ranks)
        out = tmp_path / f"{lab}.ipynb"
        done = execute(
            ROOT / "solutions" / f"{lab}.ipynb", out, parameters=parameters, cwd=tmp_path, cell_timeout=300
        )
        assert done.ok, f"{lab} on {gpus} GPU(s) with {parameters}: {done.error}"
        return read_records(out)

    return run


@pytest.fixture
def gpu_torchrun(torchrun_lab) -> Callable[[str], dict[str, Any]]:
    """`gpu_torchrun(lab)`: the lab's script under torchrun on this node's GPUs (up to 4); its records."""

    def run(lab: str) -> dict[str, Any]:
        n = min(_gpus(), 4)
        if n < _fewest_ranks(lab):
            pytest.skip(f"{lab} needs {_fewest_ranks(lab)} ranks, {n} GPU(s) here")
        proc, rec = torchrun_lab(lab, n)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert rec["torchrun"] is True and rec["emulated"] is False and "measured on GPU" in rec["where"]
        return rec

    return run
