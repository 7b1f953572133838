"""A ``flwr-clientapp`` stand-in that asks privfedcal's warm server to run the ClientApp.

Flower's SuperExec starts one ``flwr-clientapp`` process per message, found by name on its
``PATH``, and never reads its exit status (``SubprocessExecutor.launch``: ``Popen(args)``).
A fresh process spends seconds importing torch, Flower and privfedcal before the first line
of the app runs. ``privfedcal-clientapp-server`` (``flower/warm.py``) has imported them once;
this shim, installed under the name ``flwr-clientapp`` in a folder put first on the
SuperExec's ``PATH``, hands it this process's argv, environment, working directory and
stdin/stdout/stderr (file descriptors over a unix socket), the server forks a child that runs
Flower's own ``flwr-clientapp`` entry point with them, and the shim exits with the child's
exit status (128 + N when a signal N ended it). SIGTERM, SIGINT and SIGHUP sent to the shim
go to the child's process group; if the shim dies, the server kills that group.

No server listening (or a socket folder that is not private to this user): the shim becomes
the real ``flwr-clientapp`` (``exec``), so installing it changes nothing until a server runs.

Standard library only, and nothing from privfedcal: ``install_shim`` writes this file, with
the Python interpreter in its ``#!`` line, as ``flwr-clientapp``; it must start in
milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import sys

MARKER = "privfedcal-clientapp-shim"  # found in the installed file: never exec'd as "real"
SOCKET_ENV = "PRIVFEDCAL_CLIENTAPP_SOCKET"


def default_socket() -> str:
    """``$PRIVFEDCAL_CLIENTAPP_SOCKET``, else ``/tmp/privfedcal-clientapp-<uid>/server.sock``."""
    return os.environ.get(SOCKET_ENV) or os.path.join(
        "/tmp", f"privfedcal-clientapp-{os.getuid()}", "server.sock")


def private_folder_problem(folder: str) -> str | None:
    """Why ``folder`` is not a safe home for the socket (None if it is): it must be a real
    folder owned by this user, with no access for group or others."""
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"{folder}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if st.st_uid != os.getuid():
        return f"{folder} belongs to uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o077:
        return f"{folder} has mode {stat.S_IMODE(st.st_mode):o}, not 700"
    return None


def connect(path: str) -> socket.socket | None:
    """A connection to the server at ``path``; None when none listens there or its folder is
    not private (then said on stderr, as the reason for starting cold)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(path):
        return None
    problem = private_folder_problem(folder)
    if problem:
        print(f"{MARKER}: not using the warm server: {problem}", file=sys.stderr)
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


def _is_shim(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return MARKER.encode() in f.read(4096)
    except OSError:
        return True


def real_clientapp() -> str | None:
    """The first ``flwr-clientapp`` that is not a shim: next to this interpreter, then on
    ``PATH``."""
    folders = [os.path.dirname(sys.executable)]
    folders += os.environ.get("PATH", "").split(os.pathsep)
    for folder in folders:
        cand = os.path.join(folder or ".", "flwr-clientapp")
        if os.path.isfile(cand) and os.access(cand, os.X_OK) and not _is_shim(cand):
            return cand
    return None


def run_cold() -> None:
    """Become the real ``flwr-clientapp`` with this process's arguments (never returns)."""
    real = real_clientapp()
    if real is not None:
        os.execv(real, [real, *sys.argv[1:]])
    # no console script found: Flower's own entry point under this interpreter
    code = "import sys; from flwr.supernode.cli import flwr_clientapp; sys.exit(flwr_clientapp())"
    os.execv(sys.executable, [sys.executable, "-c", code, *sys.argv[1:]])


def exit_status(reply: dict) -> int:
    """The shell's convention: the child's exit code, or 128 + N after signal N."""
    if "signal" in reply:
        return 128 + int(reply["signal"])
    return int(reply["exit"])


def run_warm(sock: socket.socket) -> int:
    """Hand this process's argv/env/cwd/stdio to the server; the child's exit status."""
    request = json.dumps({"argv": sys.argv, "env": dict(os.environ),
                          "cwd": os.getcwd()}).encode()
    data = struct.pack(">I", len(request)) + request
    sent = socket.send_fds(sock, [data], [0, 1, 2])
    sock.sendall(data[sent:])
    replies = sock.makefile("rb")
    child: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child:
            try:
                os.killpg(child[0], signum)
            except OSError:
                pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    for line in replies:
        reply = json.loads(line)
        if "pid" in reply:
            child.append(int(reply["pid"]))
        elif "error" in reply:
            print(f"{MARKER}: the warm server refused: {reply['error']}", file=sys.stderr)
            return 1
        else:
            return exit_status(reply)
    print(f"{MARKER}: the warm server closed the connection before the ClientApp ended",
          file=sys.stderr)
    return 1


def main() -> int:
    sock = connect(default_socket())
    if sock is None:
        run_cold()
    assert sock is not None
    with sock:
        return run_warm(sock)


if __name__ == "__main__":
    sys.exit(main())
