"""Fixtures shared by several test modules (a test module never imports another one; what they share is here).

The tree mirrors the package's three homes: `tests/<package>/test_<module>.py` tests
`labkit/<package>/<module>.py` (`tests/machine/`, `tests/course/`, `tests/parallel/`, ...),
`tests/test_<module>.py` a top-level module, and `tests/labs/` each lab's notebook. No test asserts on the
wall clock (the emulated cluster's virtual time is a model output and may be asserted); how fast things are is
measured by `benchmarks/`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest
import torch

import labkit.course  # noqa: F401  # first: jsonschema without rfc3987-syntax's grammars (its __init__)
from labkit.machine import rank_server

# The kernels papermill starts in the tests print quizzes as text (labkit.course.quiz.show), as `labkit run`
# does.
os.environ.setdefault("LABKIT_TEXT_ONLY", "1")

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Each process that runs tests starts one rank server for itself and the kernels it starts
    (`labkit.machine.rank_server`: a kernel's ranks then start without a fork server of its own importing
    torch again). Under pytest-xdist (pyproject's `-n 2`), each worker also gets a temp folder of its own,
    inherited by the kernels and ranks it starts: the labs write traces to the default temp folder
    (`labkit.trace.capture`), and two notebooks capturing at once must not read each other's files."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker and getattr(config.option, "numprocesses", None):
        return  # xdist's controller: its workers run the tests
    if not worker:
        _serve_ranks(config)
        return
    folder = Path(tempfile.gettempdir()) / f"labkit-tests-{os.getuid()}-{worker}"
    folder.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    # Each worker has one of the runner's two cores: one intra-op thread in it and in the kernels and ranks
    # it starts (launched ranks set their own count), so two busy workers never spin four OpenMP threads.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    _serve_ranks(config)


def _serve_ranks(config) -> None:
    stack = contextlib.ExitStack()
    stack.enter_context(rank_server.serving())
    config.add_cleanup(stack.close)


def pytest_collection_modifyitems(config, items):
    """The labs' tests first: each runs a notebook or a script for 15-80 s, and started early they leave short
    tests for the end, where one xdist worker would otherwise run a long one while the other idles. Tests
    marked `gpu` need CUDA; without it they are skipped and the summary (-ra) says why."""
    # A stable sort: the labs' tests, then the rest, each part in its own order.
    items.sort(key=lambda item: not item.nodeid.startswith("tests/labs/"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (none here); tests/gpu_check.sh runs these on a GPU node"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def repo() -> Path:
    """The checkout's root (solutions/, labs/, pyproject.toml)."""
    return REPO


@pytest.fixture(scope="session")
def labkit_env() -> dict[str, str]:
    """The environment of a subprocess (a kernel, `python -m labkit.course.cli`) that must import this
    checkout's labkit even where it is not pip-installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


@pytest.fixture
def kernel_finds_labkit(monkeypatch: pytest.MonkeyPatch, labkit_env: dict[str, str]) -> None:
    """Let the kernels (papermill, nbclient) this test starts import this checkout's labkit."""
    monkeypatch.setenv("PYTHONPATH", labkit_env["PYTHONPATH"])


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module: its models are tiny, and on a busy 2-core runner thread
    hand-offs cost more than the math. Byte counts and numerics do not depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def lab_step():
    """A factory of lab 02's training step on one process, for measuring its memory:
    `lab_step(config, micro_batch, precision, checkpointing, set_to_none, accumulate=1)` gives
    (step, model, optimizer) of a seeded GPT with Adam (bf16 weights for "bf16", bf16 autocast for
    "autocast")."""
    from labkit.models import GPT, synthetic_batch

    def make(config, micro_batch, precision="fp32", checkpointing=False, set_to_none=True, accumulate=1):
        torch.manual_seed(0)
        model = GPT(config, checkpointing=checkpointing)
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step() -> None:
            for i in range(accumulate):
                x, y = synthetic_batch(config, micro_batch, step=i)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
                    loss = model(x, y) / accumulate
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)

        return step, model, optimizer

    return make
