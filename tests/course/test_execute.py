"""labkit.course.execute: a run's output holds the notebook's story, not the kernel's own log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat

_DRIVER = """
import sys
from labkit.course.execute import execute
for i in range(2):
    done = execute(sys.argv[1], sys.argv[2] + f"/out{i}.ipynb")
    assert done.ok, done.error
print("ran")
"""


def _drive(driver: str, notebook: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `driver` (a script calling `execute`) on `notebook` in a fresh interpreter, its output captured."""
    command = [sys.executable, "-c", driver, str(notebook), str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def test_a_passing_run_that_launches_ranks_prints_nothing_from_the_kernel(tmp_path: Path, labkit_env):
    """Two runs of a notebook that starts two ranks: jupyter_client interrupts every kernel before it shuts
    it down, which made ipykernel log "KeyboardInterrupt caught in kernel" in passing runs (issue 28, point 7)
    and a fork server still importing torch print a traceback."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import labkit\n\ndef f():\n    return 1\n"),
        nbformat.v4.new_code_cell("assert labkit.launch(f, world_size=2, cluster='cpu') == [1, 1]"),
    ]
    nbformat.write(nb, tmp_path / "two_ranks.ipynb")
    proc = _drive(_DRIVER, tmp_path / "two_ranks.ipynb", tmp_path, labkit_env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stdout + proc.stderr
    assert proc.stderr.strip() == "", proc.stderr


_DEAD_DRIVER = """
import sys
from labkit.course.execute import execute
done = execute(sys.argv[1], sys.argv[2] + "/out.ipynb")
print(done.ok, done.ename)
"""


def test_a_kernel_that_dies_is_reported_in_the_execution_not_printed_by_papermill(tmp_path: Path, labkit_env):
    """A kernel that dies mid-cell (as one did when Ctrl-C's SIGINT reached it first, in CI): nbclient logs
    "Kernel died while waiting for execute reply." through papermill's logger, which has no handler, so Python
    printed it to stderr beside `labkit run`'s one line; the death is in the returned `Execution` instead."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import os\nos._exit(1)")]
    nbformat.write(nb, tmp_path / "dies.ipynb")
    proc = _drive(_DEAD_DRIVER, tmp_path / "dies.ipynb", tmp_path, labkit_env)
    ran = proc.stdout.split()
    assert proc.returncode == 0 and ran == ["False", "DeadKernelError"], proc.stdout + proc.stderr
    assert "Kernel died" not in proc.stderr, proc.stderr


def test_what_a_kernel_writes_to_its_stderr_as_it_ends_is_kept_beside_the_run_not_printed(
    tmp_path: Path, labkit_env
):
    """A kernel that C++ ends with std::terminate, as one did when the SIGINT jupyter_client sends before a
    shutdown landed inside torch: ipykernel echoes its file descriptor 2 to the stderr it started with, so
    the two lines stood beside `labkit run`'s one line after Ctrl-C; they go to a file beside the executed
    copy."""
    nb = nbformat.v4.new_notebook()
    line = "terminate called after throwing an instance of 'pybind11::error_already_set'\\n"
    source = f'import os, time\nos.write(2, b"{line}")\ntime.sleep(1)  # echoed meanwhile\nos.abort()'
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(nb, tmp_path / "terminates.ipynb")
    proc = _drive(_DEAD_DRIVER, tmp_path / "terminates.ipynb", tmp_path, labkit_env)
    assert proc.stdout.split() == ["False", "DeadKernelError"], proc.stdout + proc.stderr
    assert "terminate called" not in proc.stderr, proc.stderr
    assert "terminate called" in (tmp_path / "out.kernel-stderr.txt").read_text()


def test_the_kernel_talks_over_unix_sockets_in_a_folder_removed_after(tmp_path: Path, kernel_finds_labkit):
    """No TCP ports: jupyter_client picks free ports, closes them and lets the kernel bind them later, and in
    a full suite a rank's gloo listener took one in between (the kernel then hung on "Address already in
    use"). The kernel gets its sockets in a temporary folder, which is gone after the run."""
    import tempfile

    from labkit.course.execute import execute

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from ipykernel import get_connection_info\n"
            "info = get_connection_info(unpack=True)\n"
            "print(info['transport'], info['ip'])"
        )
    ]
    nbformat.write(nb, tmp_path / "transport.ipynb")
    before = set(Path(tempfile.gettempdir()).glob("labkit-kernel-*"))
    done = execute(tmp_path / "transport.ipynb", tmp_path / "out.ipynb")
    assert done.ok, done.error
    transport, ip = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[0].outputs[0].text.split()
    assert transport == "ipc" and Path(ip).is_absolute() and not Path(ip).parent.exists()
    assert set(Path(tempfile.gettempdir()).glob("labkit-kernel-*")) == before


def test_a_kernel_that_fails_before_it_answers_is_reported_with_its_stderrs_last_line(
    tmp_path: Path, monkeypatch, kernel_finds_labkit
):
    """A kernel that dies while it starts (as one did on a port taken by another process) said only "Kernel
    died before replying to kernel_info"; its own last word, kept in the stderr file, is in the error."""
    import json

    from labkit.course.execute import execute

    spec = tmp_path / "jupyter" / "kernels" / "fails"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-c", "import sys; sys.exit('zmq.error.ZMQError: Address already in use')"]
    kernel_json = {"argv": argv, "display_name": "fails", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel_json))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("1")]
    nbformat.write(nb, tmp_path / "any.ipynb")
    done = execute(tmp_path / "any.ipynb", tmp_path / "out.ipynb", kernel="fails")
    assert not done.ok
    said = "zmq.error.ZMQError: Address already in use"
    assert done.error.endswith(f"(the kernel's stderr, out.kernel-stderr.txt, ends: {said})"), done.error
