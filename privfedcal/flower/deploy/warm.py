"""``privfedcal-clientapp-server``: a fork server that runs Flower's ClientApp processes warm.

Flower 1.41 starts one ``flwr-clientapp`` process per message; each imports torch, Flower
and privfedcal (seconds of CPU) before the app runs. This server imports them once, listens
on a unix socket in a folder only its user can enter (mode 700, checked), and for every
request from the ``flwr-clientapp`` shim (``flower/clientapp_shim.py``) forks a child that
takes the shim's stdin/stdout/stderr, argv, environment and working directory and runs
Flower's own entry point (``flwr.supernode.cli.flwr_clientapp``): the same code as a cold
``flwr-clientapp`` process, only without the imports. The exit status goes back to the shim.

Fork safety: the server never runs a torch operation, so it starts no intra-op thread pool
and initialises no CUDA (checked before serving); a child reseeds torch, ``random`` and
NumPy from the OS like a fresh process, and takes ``OMP_NUM_THREADS`` from the shim's
environment (the ClientApp then sets its own thread count, ``client_app.node_threads``).
Children run in their own session; they are SIGKILLed with their group when the shim's
connection drops (shim killed), and die with the server (``PR_SET_PDEATHSIG``). Stopping the
server (SIGTERM, SIGINT) kills the children it still has.

    privfedcal-clientapp-server [--socket PATH] [--preload MODULE ...]
    privfedcal-clientapp-server --install-shim DIR   # writes DIR/flwr-clientapp

See docs/flower.md ("A warm ClientApp launcher").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from privfedcal.flower.deploy import clientapp_shim as shim
from privfedcal.flower.deploy.warm_child import run_child
from privfedcal.flower.pulls import quick_object_pulls

#: imported before serving: what every privfedcal ClientApp process needs
#: (httpcore/h11: Flower's runtime API client imports them lazily, ~0.2 s per process;
#: privfedcal.data/calibration: imported when the client's experiment is built)
PRELOAD = ("torch", "numpy.ma", "httpx", "httpcore", "h11", "flwr.supernode.cli",
           "flwr.supernode.runtime.run_clientapp", "privfedcal.flower.client_app",
           "privfedcal.experiment", "privfedcal.privacy.planner", "privfedcal.data",
           "privfedcal.calibration")
MAX_REQUEST = 4 << 20  # bytes of argv + environment + cwd


def install_shim(folder: Path, python: str | None = None) -> Path:
    """Write the shim as ``folder/flwr-clientapp`` (executable, run by ``python``)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "flwr-clientapp"
    source = Path(shim.__file__).read_text()
    target.write_text(f"#!{python or sys.executable}\n# {shim.MARKER}\n{source}")
    target.chmod(0o755)
    return target


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    if len(data) < 4:
        raise ValueError("short request")
    size = struct.unpack(">I", data[:4])[0]
    if size > MAX_REQUEST:
        raise ValueError(f"request of {size} bytes")
    body = bytearray(data[4:])
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ValueError("truncated request")
        body += chunk
    return json.loads(bytes(body)), list(fds)


class Server:
    def __init__(self, path: str) -> None:
        self.path = path
        self.sel = selectors.DefaultSelector()
        self.children: dict[int, tuple[socket.socket | None, int]] = {}  # pid: conn, pidfd
        self.started: dict[int, float] = {}  # pid: time.monotonic() at fork
        self.listener: socket.socket | None = None
        self.pid = os.getpid()

    # ---- socket -----------------------------------------------------------------------------
    def bind(self) -> None:
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, mode=0o700, exist_ok=True)
        problem = shim.private_folder_problem(folder)
        if problem:
            raise SystemExit(f"privfedcal-clientapp-server: {problem}")
        if os.path.exists(self.path):
            live = shim.connect(self.path)
            if live is not None:
                live.close()
                raise SystemExit(f"privfedcal-clientapp-server: a server already listens on "
                                 f"{self.path}")
            os.unlink(self.path)  # stale: its server is gone
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self.listener.listen(64)
        self.sel.register(self.listener, selectors.EVENT_READ, ("accept", 0))

    # ---- loop -------------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            for key, _ in self.sel.select():
                what, pid = key.data
                if what == "accept":
                    self._accept()
                elif what == "exit":
                    self._reap(pid)
                else:
                    self._shim_spoke(pid)

    def _accept(self) -> None:
        assert self.listener is not None
        conn, _ = self.listener.accept()
        conn.settimeout(10.0)
        fds: list[int] = []
        try:
            if _peer_uid(conn) != os.getuid():
                raise ValueError("peer of another user")
            req, fds = _recv_request(conn)
            if req.get("ping"):
                conn.sendall(json.dumps({"ok": True, "pid": os.getpid()}).encode() + b"\n")
                conn.close()
                return
            if len(fds) != 3 or not isinstance(req.get("argv"), list):
                raise ValueError("a request needs argv and 3 file descriptors")
        except (OSError, ValueError) as exc:
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(json.dumps({"error": str(exc)}).encode() + b"\n")
            except OSError:
                pass
            conn.close()
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            own = [self.listener, conn, *(c for c, _ in self.children.values() if c)]
            self.sel.close()
            run_child(self.pid, req, fds, [s.fileno() for s in own if s is not None]
                      + [pidfd for _, pidfd in self.children.values()])  # never returns
        for fd in fds:
            os.close(fd)
        self.started[pid] = time.monotonic()
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (conn, pidfd)
        self.sel.register(pidfd, selectors.EVENT_READ, ("exit", pid))
        self.sel.register(conn, selectors.EVENT_READ, ("conn", pid))
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            self._shim_spoke(pid)

    def _shim_spoke(self, pid: int) -> None:
        """The shim sends nothing after its request: readable means it is gone."""
        conn, pidfd = self.children[pid]
        if conn is not None:
            self.sel.unregister(conn)
            conn.close()
            self.children[pid] = (None, pidfd)
        _kill_group(pid, signal.SIGKILL)

    def _reap(self, pid: int) -> None:
        conn, pidfd = self.children.pop(pid)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        # one line per ClientApp process (benchmarks/flower/flower_overhead.py reads the seconds)
        print(f"child {pid}: exit {code} after {time.monotonic() - self.started.pop(pid):.3f} s",
              flush=True)
        _kill_group(pid, signal.SIGKILL)  # anything the ClientApp left in its session
        if conn is not None:
            self.sel.unregister(conn)
            reply = {"exit": code} if code >= 0 else {"signal": -code}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        for pid in list(self.children):
            _kill_group(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        if self.listener is not None:
            self.listener.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # ---- the child ----------------------------------------------------------------------------


def _kill_group(pid: int, signum: int) -> None:
    for kill in (lambda: os.killpg(pid, signum), lambda: os.kill(pid, signum)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def preload(modules: list[str]) -> None:
    for name in modules:
        importlib.import_module(name)
    # a forked child asks for its message while its SuperNode is still fetching it
    if not quick_object_pulls():
        print("privfedcal-clientapp-server: this Flower has no initial_backoff for object "
              "pulls; children keep its own", file=sys.stderr)
    torch = sys.modules["torch"]
    if torch.cuda.is_initialized():  # a forked child cannot use an initialised CUDA context
        raise SystemExit("privfedcal-clientapp-server: a preloaded module initialised CUDA")


def ping(path: str) -> int | None:
    """The pid of the server listening on ``path``, or None."""
    sock = shim.connect(path)
    if sock is None:
        return None
    with sock:
        body = json.dumps({"ping": True}).encode()
        sock.sendall(struct.pack(">I", len(body)) + body)
        line = sock.makefile("rb").readline()
    return int(json.loads(line)["pid"]) if line else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="privfedcal-clientapp-server",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--socket", default=None,
                    help=f"unix socket (default: ${shim.SOCKET_ENV}, else "
                    "/tmp/privfedcal-clientapp-<uid>/server.sock)")
    ap.add_argument("--preload", action="append", default=[], metavar="MODULE",
                    help="import MODULE too before serving (your own ClientApp's module)")
    ap.add_argument("--install-shim", type=Path, metavar="DIR",
                    help="write the flwr-clientapp shim into DIR and exit")
    args = ap.parse_args(argv)
    if args.install_shim is not None:
        print(install_shim(args.install_shim))
        return 0
    path = args.socket or shim.default_socket()
    try:
        preload([*PRELOAD, *args.preload])
    except ImportError as exc:
        print(f"privfedcal-clientapp-server: cannot preload {exc.name}: {exc}", file=sys.stderr)
        return 2
    server = Server(path)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.bind()
        print(f"privfedcal-clientapp-server: pid {os.getpid()} serving on {path}", flush=True)
        server.serve()
    except KeyboardInterrupt:
        pass
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
