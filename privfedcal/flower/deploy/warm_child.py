"""The child side of ``privfedcal-clientapp-server`` (``flower/warm.py``): what a forked
process does before and while it runs Flower's ``flwr-clientapp`` entry point."""

from __future__ import annotations

import os
import signal
import sys


def _die_with_parent(parent: int) -> None:
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the server died before prctl took effect
        os._exit(1)


def run_child(server: int, req: dict, fds: list[int], close: list[int]) -> None:
    """In a child forked by the server (pid ``server``): close the server's descriptors
    ``close``, take the shim's stdio ``fds``, argv, environment and working directory from
    ``req``, and exit with what Flower's ``flwr_clientapp()`` exits with. Never returns."""
    code = 1
    try:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        os.setsid()  # its own process group: the server kills it with the group
        _die_with_parent(server)
        for fd in close:
            os.close(fd)
        import fcntl

        # above 2 first, so that no dup2 below overwrites a descriptor still to be moved
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3) for fd in fds]
        for fd in fds:
            os.close(fd)
        for target, fd in enumerate(high):
            os.dup2(fd, target)  # dup2's copy is inheritable: 0, 1, 2 stay open on exec
            os.close(fd)
        os.chdir(req.get("cwd") or "/")
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
        sys.argv = [str(a) for a in req["argv"]]
        fresh_process_state()
        from flwr.supernode.cli import flwr_clientapp

        try:
            flwr_clientapp()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - a child must never return into the server loop
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def fresh_process_state() -> None:
    """What a fresh ``flwr-clientapp`` process would have: OS-seeded RNGs (a fork copies the
    server's state to every child) and the environment's ``OMP_NUM_THREADS``."""
    import random

    import torch

    random.seed()
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) >= 1:
        torch.set_num_threads(int(threads))
