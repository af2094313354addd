"""One fork server for every kernel of a session: a rank starts without its kernel importing torch again.

`labkit.launch` starts ranks from a fork server that has imported torch and labkit once (`preload`), so
that a rank starts in milliseconds. multiprocessing's fork server belongs to one process, so every notebook
kernel starts its own and pays for the imports again (about 4 CPU-s each on a 2-core VM: torch, and
dynamo through torch.distributed.pipelining). A session that runs many kernels (the test suite, `labkit run`,
`labkit grade`) starts one `RankServer` instead and names it to its kernels in `$LABKIT_RANK_SERVER`;
`launch` then asks it for its ranks (`served_context`), and starts its own fork server where there is none.

The protocol, one Unix-socket connection per rank, each message a length-prefixed pickle: the client sends
what the rank needs (`worker.main`'s arguments, its working directory, its `sys.path`, the labkit it imports);
the server forks, answers the child's pid (or why it will not), and when the child exits sends its exit code
(negative: the signal, as multiprocessing reports it) and closes. A client that closes its connection first
(its kernel died) has its rank killed. The ranks also die with the server (PR_SET_PDEATHSIG) and watch their
launcher (`worker.main`); the server ends with its owner.

What a served rank cannot differ in from its server: the labkit, torch and Python it imports and runs, and
CI's fake CUDA machine (`$LABKIT_FAKE_CUDA`, installed when labkit is imported, so in the server, which runs
without it): a client that differs starts its own fork server, as without a server.

Neighbours: `launcher` (the client), `worker` (what a served rank runs).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["ENV", "RankServer", "ServedProcess", "preload", "served_context", "serving"]

ENV = "LABKIT_RANK_SERVER"  # the socket of the session's server
FAKE_CUDA_ENV = "LABKIT_FAKE_CUDA"
_READY = "labkit rank server ready"
_HEADER = struct.Struct("!I")


def preload() -> list[str]:
    """What every rank imports, imported once by a fork server (the session's or `launch`'s own) instead:
    torch.distributed.pipelining pulls in dynamo, and a rank that unpickles a lab's function imports its
    module, and so labkit's layers and FSDP; paid per rank, that is seconds a launch on a few cores. Only
    torch and the launch's own modules on a CUDA build, where nothing may touch CUDA before the fork."""
    import torch

    modules = ["torch", "torch.distributed", "cloudpickle"]
    modules += ["labkit.machine.launcher", "labkit.machine.worker"]
    if torch.version.cuda is None:
        modules += [
            "torch.distributed.pipelining",
            "torch.distributed.fsdp",
            "labkit.memory",
            "labkit.parallel",
            "labkit.planner",
            "labkit.trace",
            "labkit.course.training",
        ]
    return modules


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    """One message, or None when the peer closed the connection."""
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    body = _recv_exactly(sock, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _build() -> str:
    """What a served rank and its client must share: the labkit and the torch they import, the Python."""
    import torch

    import labkit

    files = [str(Path(m.__file__ or "").resolve()) for m in (labkit, torch)]
    return " | ".join([*files, sys.version])


def _fake_cuda() -> str:
    return os.environ.get(FAKE_CUDA_ENV, "0") or "0"


# ------------------------------------------------------------------ the owner


class RankServer:
    """A fork server shared by the kernels this process starts; a context manager.

        with RankServer() as server:
            os.environ[rank_server.ENV] = server.address   # inherited by the kernels started now

    The server imports `modules` (default: `preload()`) before it says it is ready."""

    def __init__(self, modules: list[str] | None = None, start_timeout_s: float = 120.0) -> None:
        self._modules = modules
        self._start_timeout_s = start_timeout_s
        self._dir: str | None = None
        self._proc: subprocess.Popen | None = None
        self.address = ""

    def __enter__(self) -> RankServer:
        self._dir = tempfile.mkdtemp(prefix="labkit-ranks-")
        self.address = str(Path(self._dir) / "ranks.sock")
        command = [sys.executable, "-m", "labkit.machine.rank_server", self.address, str(os.getpid())]
        if self._modules is not None:
            command += self._modules
        env = dict(os.environ)
        env.pop(FAKE_CUDA_ENV, None)  # installed when labkit is imported: served ranks run without it
        self._proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env
        )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self._proc.stdout, selectors.EVENT_READ)
        if not selector.select(self._start_timeout_s):
            raise RuntimeError(f"the rank server did not start within {self._start_timeout_s:.0f} s")
        line = self._proc.stdout.readline().strip()
        if line != _READY:
            raise RuntimeError(f"the rank server did not start (exit code {self._proc.poll()}): {line!r}")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()  # it kills the ranks it still serves, then exits
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


@contextlib.contextmanager
def serving() -> Iterator[RankServer | None]:
    """A `RankServer` named in `$LABKIT_RANK_SERVER` while the block runs, for the kernels it starts; the one
    already named there where this process may use it (`served_context`). None (each kernel starts its own
    fork server, as without it) off Linux, under CI's fake CUDA machine, whose kernels could not use it, and
    where it does not start (said on stderr)."""
    if not sys.platform.startswith("linux") or _fake_cuda() != "0" or served_context() is not None:
        yield None
        return
    try:
        server = RankServer().__enter__()
    except (OSError, RuntimeError) as exc:
        print(f"labkit: no shared rank server ({exc}); each notebook starts its own", file=sys.stderr)
        yield None
        return
    previous = os.environ.get(ENV)
    os.environ[ENV] = server.address
    try:
        yield server
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
        server.__exit__(None, None, None)


# ------------------------------------------------------------------ the client


class ServedProcess:
    """A rank that the session's server starts: the part of `multiprocessing.Process` the launcher uses
    (`start`, `pid`, `sentinel`, `join`, `exitcode`, `is_alive`, `terminate`, `kill`, `close`)."""

    def __init__(self, address: str, args: tuple, name: str = "") -> None:
        self.name = name
        self._address = address
        self._args = args
        self._sock: socket.socket | None = None
        self.pid: int | None = None
        self.exitcode: int | None = None

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self._address)
            request = {
                "args": self._args,
                "cwd": os.getcwd(),
                "sys_path": list(sys.path),
                "build": _build(),
                "fake_cuda": _fake_cuda(),
            }
            _send(sock, request)
            answer = _recv(sock)
        except BaseException:
            sock.close()
            raise
        if not isinstance(answer, int):
            sock.close()
            raise RuntimeError(f"the rank server at {self._address} did not start the rank: {answer!r}")
        self._sock, self.pid = sock, answer

    @property
    def sentinel(self) -> int:
        """Readable once the rank has exited (its exit code has arrived) or the server is gone."""
        if self._sock is None:
            raise ValueError("the rank was not started")
        return self._sock.fileno()

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is not None or self._sock is None:
            return
        selector = selectors.DefaultSelector()
        with selector:
            selector.register(self._sock, selectors.EVENT_READ)
            if not selector.select(timeout):
                return
        code = _recv(self._sock)
        # the server gone without a word: its ranks died with it (PR_SET_PDEATHSIG)
        self.exitcode = code if isinstance(code, int) else -signal.SIGKILL

    def is_alive(self) -> bool:
        if self.pid is None:
            return False
        self.join(0)
        return self.exitcode is None

    def _signal(self, sig: int) -> None:
        if self.is_alive() and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _ServedContext:
    """What the launcher asks of a multiprocessing context: `Process(target=worker.main, ...)`."""

    def __init__(self, address: str) -> None:
        self.address = address

    def Process(self, target: Any, name: str = "", daemon: bool = True, args: tuple = ()) -> ServedProcess:
        from labkit.machine import worker

        if target is not worker.main:
            raise ValueError("the rank server runs labkit.machine.worker.main only")
        return ServedProcess(self.address, args, name)


def served_context() -> _ServedContext | None:
    """The session's rank server, where `$LABKIT_RANK_SERVER` names one this process may use: not under CI's
    fake CUDA machine, which the server did not install (`$LABKIT_FAKE_CUDA`); else None."""
    address = os.environ.get(ENV, "")
    if not address or _fake_cuda() != "0":
        return None
    try:
        build = (Path(address).parent / "build").read_text()
    except OSError:
        return None  # gone, or not a rank server's
    return _ServedContext(address) if build == _build() else None


# ------------------------------------------------------------------ the server


def _refusal(request: Any, build: str) -> str | None:
    if not isinstance(request, dict) or "args" not in request:
        return "not a rank request"
    if request.get("build") != build:
        return f"this server runs {build}, the client {request.get('build')}"
    if request.get("fake_cuda") != "0":
        return "the client runs on CI's fake CUDA machine, which this server did not install"
    return None


def _run_rank(request: dict) -> None:
    """In the forked child: become the client's rank (never returns)."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        sys.path[:] = request["sys_path"]
        from labkit.machine import worker

        worker.main(*request["args"])  # ends the process itself
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


class _Server:
    def __init__(self, address: str, owner_pid: int) -> None:
        self.owner_pid = owner_pid
        self.build = _build()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(address)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        # A rank's exit wakes the loop at once (SIGCHLD through the wakeup fd, as multiprocessing's fork
        # server does): the launcher names the rank that ended first, so its exit code must not wait.
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.by_pid: dict[int, socket.socket] = {}
        self.by_conn: dict[socket.socket, int] = {}
        self.stopping = False

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        while not self.stopping and self._owner_alive():
            for key, _ in self.selector.select(0.2):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj == self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                else:
                    self._client_closed(key.fileobj)  # a client never writes after its request
            self._reap()
        for pid in list(self.by_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.by_pid and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)

    def _owner_alive(self) -> bool:
        try:
            os.kill(self.owner_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        conn.settimeout(30)  # a client sends its request at once
        try:
            request = _recv(conn)
            why = _refusal(request, self.build)
        except (OSError, pickle.UnpicklingError, EOFError) as exc:
            why = f"unreadable request: {exc}"
        if why is not None:
            with contextlib.suppress(OSError):
                _send(conn, why)
            conn.close()
            return
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            for fd in (self.wake_r, self.wake_w):
                os.close(fd)
            self.listener.close()
            for other in self.by_conn:
                other.close()
            conn.close()
            _run_rank(request)
        self.by_pid[pid], self.by_conn[conn] = conn, pid
        conn.settimeout(None)
        _send(conn, pid)
        self.selector.register(conn, selectors.EVENT_READ)

    def _client_closed(self, conn: Any) -> None:
        pid = self.by_conn.pop(conn, None)
        self.selector.unregister(conn)
        conn.close()
        if pid is not None:
            self.by_pid.pop(pid, None)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)

    def _reap(self) -> None:
        while self.by_pid:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.by_pid.pop(pid, None)
            if conn is None:
                continue
            self.by_conn.pop(conn, None)
            self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                _send(conn, os.waitstatus_to_exitcode(status))
            conn.close()


def main(argv: list[str]) -> None:
    """`python -m labkit.machine.rank_server SOCKET OWNER_PID [MODULE ...]`: import the modules (default:
    `preload()`), say ready on stdout, serve until the owner is gone or SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as launch's fork server: the owner stops the ranks
    if _fake_cuda() != "0":
        raise SystemExit(f"a rank server serves ranks without CI's fake CUDA machine: unset ${FAKE_CUDA_ENV}")
    address, owner_pid, modules = argv[0], int(argv[1]), argv[2:]
    for name in modules or preload():
        importlib.import_module(name)
    server = _Server(address, owner_pid)
    (Path(address).parent / "build").write_text(server.build)  # a client of another build starts its own
    print(_READY, flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)  # the owner reads one line; the ranks write to their own files
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    server.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
