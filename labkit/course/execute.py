"""The one way the course runs a notebook: papermill, with what `labkit run`, `labkit grade` and the tests
need.

`execute(path, out, parameters=..., cwd=...)` runs `path` into `out` with papermill in the `python3` kernel
(ipykernel's own spec: this interpreter), each cell limited to `cell_timeout` seconds, and returns an
`Execution`: whether it ran to the end, and where and how it failed (the cell's index among the notebook's own
cells, its error). `allow_errors=True` runs every cell whatever fails (grading reads each check cell after).
Ctrl-C raises `Interrupted`, which names the cell that was running and the partly executed copy, so that a
command can say in one line where it stopped and what it kept (papermill's, nbclient's and asyncio's own
tracebacks are not shown).

The kernel logs only its critical errors: a cell's error is in the executed notebook and in `Execution`, never
in the kernel's log, whose ERROR lines were noise in passing runs: jupyter_client interrupts the kernel before
every shutdown (`KernelManager._async_shutdown_kernel`), and an idle ipykernel logs "KeyboardInterrupt caught
in kernel" when that SIGINT lands while it handles a message; after Ctrl-C it logged the closed sockets'
ZMQError tracebacks. Its event loop logs nothing either (`_QUIET_ASYNCIO`). Nor does papermill's client
print its errors (`_QuietErrors`): each is what `Execution` reports (a dead kernel, a cell over its limit),
and "Kernel died while waiting for execute reply." printed beside the one line of an interrupted run, when
Ctrl-C's SIGINT reached the kernel before the client saw it (nbclient logs it with no handler configured, so
Python's last-resort handler wrote it to stderr).

The kernel's own stderr goes to a file beside the executed copy (`<out>.kernel-stderr.txt`, removed when
empty), not to this process's: ipykernel echoes every write to its file descriptor 2 there (`OutStream`'s
`_watch_pipe_fd`, "to capture errors in terminals"), and when the SIGINT that jupyter_client sends before
shutting a kernel down lands inside torch's C++ (an import, a hook), C++ ends the kernel with std::terminate's
two lines ("terminate called after throwing an instance of 'pybind11::error_already_set'"), which stood
beside the one line of an interrupted `labkit run`. A run that fails outside a cell's own error (a kernel that
died or never answered, a cell over its limit) names the file's last line, where such a kernel left its cause.

The kernel talks to papermill over Unix domain sockets in a temporary folder (jupyter_client's "ipc"
transport), not TCP: jupyter_client picks free TCP ports, closes them and writes them to the connection file,
and the kernel binds them later; another process (a rank's gloo or TCPStore listener on an ephemeral port)
can take one in between, and the kernel then stops at "ZMQError: Address already in use" without answering
("Kernel didn't respond in 60 seconds")."""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nbformat
import papermill

__all__ = ["Execution", "Interrupted", "execute"]


@dataclass
class Execution:
    """How one papermill run of a notebook went."""

    notebook: Path  # the executed copy (papermill writes it as it goes, unless the kernel never started)
    ok: bool
    seconds: float
    error: str = ""  # "cell 12 (execution 9): AssertionError: ..." or the run's own failure (a timeout)
    ename: str = ""
    evalue: str = ""
    traceback: list[str] = field(default_factory=list)
    source: str = ""  # the failing cell's source

    @property
    def ran(self) -> bool:
        """Did the kernel write an executed copy at all?"""
        return self.notebook.exists()


class Interrupted(KeyboardInterrupt):
    """Ctrl-C while a notebook ran: the partly executed copy (`notebook`, written up to the cell that was
    running where the kernel had started) and that cell's index among the notebook's own cells (None when no
    cell had started), of its `cells` cells (as `Execution.error` counts them: markdown too)."""

    def __init__(self, notebook: Path, cell: int | str | None, cells: int) -> None:
        super().__init__(f"interrupted at cell {cell} of {cells}")
        self.notebook, self.cell, self.cells = notebook, cell, cells


# Run in the kernel before the first cell, defining no name there: its event loop's own log (asyncio's logger)
# printed "Task was destroyed but it is pending!" for the control channel's task at shutdown in passing runs.
_QUIET_ASYNCIO = (
    "--IPKernelApp.exec_lines=[\"__import__('logging').getLogger('asyncio').setLevel(50)\"]"
)


def _kernel_manager(stderr_path: Path, sockets: str) -> type:
    """nbclient's kernel manager, starting the kernel with its stderr in `stderr_path` and its sockets in the
    folder `sockets` (module docstring; TCP where Unix domain sockets are missing)."""
    from jupyter_client import AsyncKernelManager

    class KernelManager(AsyncKernelManager):
        def __init__(self, **kw: Any) -> None:
            if sys.platform != "win32":
                # an absolute path: the client and the kernel (started in the notebook's cwd) meet there
                kw = {"transport": "ipc", "ip": str(Path(sockets) / "kernel"), **kw}
            super().__init__(**kw)

        async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
            with open(stderr_path, "ab") as stderr:  # the kernel has its own copy once it has started
                await super()._async_launch_kernel(kernel_cmd, **{**kw, "stderr": stderr})

    return KernelManager


def _last_line(path: Path) -> str:
    """The last non-blank line of a text file; "" when there is none."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


class _QuietErrors(logging.Filter):
    """Drops the papermill logger's ERROR records (its warnings pass): see the module docstring."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def execute(
    path: str | Path,
    out: str | Path,
    *,
    parameters: Mapping[str, Any] | None = None,
    cwd: str | Path | None = None,
    cell_timeout: float = 600,
    kernel: str = "python3",
    progress: bool = False,
    allow_errors: bool = False,
) -> Execution:
    """Run notebook `path` into `out` (see the module docstring); `cwd` defaults to `out`'s folder."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    quiet = _QuietErrors()
    papermill_log = logging.getLogger("papermill")
    papermill_log.addFilter(quiet)
    kernel_stderr = out.with_name(f"{out.stem}.kernel-stderr.txt")
    sockets = tempfile.TemporaryDirectory(prefix="labkit-kernel-")
    try:
        papermill.execute_notebook(
            str(path),
            str(out),
            parameters=dict(parameters or {}),
            cwd=str(cwd or out.parent),
            kernel_name=kernel,
            execution_timeout=cell_timeout,
            progress_bar=progress,
            log_output=False,
            allow_errors=allow_errors,
            extra_arguments=["--IPKernelApp.log_level=CRITICAL", _QUIET_ASYNCIO],
            kernel_manager_class=_kernel_manager(kernel_stderr, sockets.name),
        )
    except KeyboardInterrupt:
        # the event loop's tasks that Ctrl-C cut short are collected later and would each log a traceback
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        raise Interrupted(out, _running_cell(Path(path), out), _cells(Path(path))) from None
    except papermill.PapermillExecutionError as exc:
        index = _own_index(Path(path), exc.source)
        return Execution(
            out,
            False,
            time.perf_counter() - t0,
            f"cell {index} (execution {exc.exec_count}): {exc.ename}: {exc.evalue}",
            exc.ename,
            exc.evalue,
            list(exc.traceback),
            exc.source,
        )
    except Exception as exc:  # a cell over its time limit, a kernel that died or never started
        first = str(exc).splitlines()[0] if str(exc) else ""  # whole: a grade's CSV keeps it so
        if said := _last_line(kernel_stderr):
            first += f" (the kernel's stderr, {kernel_stderr.name}, ends: {said})"
        return Execution(
            out, False, time.perf_counter() - t0, f"{type(exc).__name__}: {first}", type(exc).__name__, first
        )
    finally:
        papermill_log.removeFilter(quiet)
        sockets.cleanup()
        if kernel_stderr.exists() and kernel_stderr.stat().st_size == 0:
            kernel_stderr.unlink()
    return Execution(out, True, time.perf_counter() - t0)


def _running_cell(path: Path, out: Path) -> int | str | None:
    """The own index of the cell Ctrl-C stopped: the first code cell of the executed copy `out` that papermill
    did not see end (its cleanup marks every cell "completed", so the end time tells); None if none."""
    try:
        cells = nbformat.read(out, as_version=4).cells
    except (OSError, ValueError):
        return None
    for cell in cells:
        if cell.cell_type == "code" and not cell.get("metadata", {}).get("papermill", {}).get("end_time"):
            return _own_index(path, cell.source)
    return None


def _cells(path: Path) -> int:
    return len(nbformat.read(path, as_version=4).cells)


def _own_index(path: Path, source: str) -> int | str:
    """The index of the cell with `source` among the notebook's own cells (papermill's counts the cell it
    injects); "the injected parameters cell" when it is that one."""
    for index, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type == "code" and cell.source == source:
            return index
    return "the injected parameters cell"
