"""A throwaway Flower deployment on loopback: one SuperLink and K SuperNodes as processes.

Started with Flower's own commands (``flower-superlink``, ``flower-supernode``, ``flwr run``)
in insecure mode on free 127.0.0.1 ports, with ``FLWR_HOME`` in a private folder so the
user's Flower configuration is never read or written. Node k gets
``--node-config 'partition-id=k num-partitions=K'``. Every process is started in its own
process group and stopped on exit, even after an error: SIGTERM to the groups, then SIGKILL
to whatever is left of the processes they spawned (Flower detaches some of its helpers into
new sessions, so descendants are tracked by parent pid, not only by group).

For the deployment test and ``benchmarks/flower/flower_overhead.py``; not a production setup.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from flwr.common.config import flatten_dict

import privfedcal
from privfedcal.errors import UsageError
from privfedcal.flower.grid import app_run_config

LOOPBACK = "127.0.0.1"
CONNECTION = "privfedcal-local"
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


#: the environment variable a node reads its data seed from (``flower/client_app.py``)
DATA_SEED_ENV = "PRIVFEDCAL_DATA_SEED"

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    tree, seen, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            seen.append(child)
            todo.append(child)
    return seen


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    if isinstance(value, int | float):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


class LocalDeployment:
    """``with LocalDeployment(2, tmp) as dep: dep.run(app_dir, {"rounds": 2})``."""

    def __init__(self, num_nodes: int, workdir: Path, *, task_poll_interval: float = 0.1,
                 startup_timeout: float = 60.0, data_seed: int | None = None,
                 secure: bool = False, warm: bool = False, node_data_seed: bool = True,
                 server_dir: Path | None = None) -> None:
        self.num_nodes = num_nodes
        # server_dir: the SuperLink's working folder, which the ServerApp it starts inherits:
        # the app's own files (a plugin's run folder, a saved model) are written there
        # (default: workdir, with the logs and Flower's home)
        self.server_dir = Path(server_dir) if server_dir is not None else None
        # node_data_seed: give each SuperNode the shared data seed in its node config
        # (privfedcal's app reads it); off for an app that does not declare ``data-seed``
        self.node_data_seed = node_data_seed
        # warm: a privfedcal-clientapp-server (flower/warm.py) started first, and the
        # flwr-clientapp shim first on the SuperNodes' PATH, so that every ClientApp
        # process is forked from it with torch, Flower and privfedcal already imported
        self.warm = warm
        # secure: TLS on the SuperLink's port (a CA and certificate made here, for
        # 127.0.0.1) and SuperNode authentication (--enable-supernode-auth; each node's key
        # registered with `flwr supernode register` before it starts)
        self.secure = secure
        # the partition's seed, shared by the nodes and never given to the SuperLink/server:
        # OS entropy unless given
        self.data_seed = secrets.randbits(63) if data_seed is None else data_seed
        self.workdir = Path(workdir)
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.named: dict[str, subprocess.Popen] = {}  # by log name: "supernode-0", ...
        self.logs = self.workdir / "logs"
        self.home = self.workdir / "flwr-home"
        self.tls: dict[str, Path] = {}
        self.keys = self.workdir / "keys"
        self.env = dict(os.environ)
        repo = str(Path(privfedcal.__file__).resolve().parents[1])
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (repo, self.env.get("PYTHONPATH", "")) if p)
        # Flower starts its helpers (flower-superexec, flwr-clientapp) by name: find this
        # environment's first, whether or not it is activated
        self.env["PATH"] = os.pathsep.join(
            p for p in (str(Path(sys.executable).parent), self.env.get("PATH", "")) if p)
        self.env.update(FLWR_HOME=str(self.home), OMP_NUM_THREADS="1",
                        FLWR_SUPEREXEC_TASK_POLL_INTERVAL=str(task_poll_interval))
        self.env.pop("FLWR_TELEMETRY_ENABLED", None)
        self.env["FLWR_TELEMETRY_ENABLED"] = "0"

    # ---- processes -------------------------------------------------------------------------
    def _prepare_home(self) -> None:
        """Log folder and a private FLWR_HOME whose config points ``flwr`` at our SuperLink."""
        self.logs.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        if self.secure:
            from privfedcal.flower.deploy.credentials import make_tls

            self.tls = make_tls(self.workdir / "tls", [LOOPBACK, "localhost"])
            trust = f'root-certificates = "{self.tls["ca_cert"]}"\n'
        else:
            trust = "insecure = true\n"
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{LOOPBACK}:{self.port}"\n{trust}')

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        args = [_exe(args[0]), *args[1:]]
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        cwd = self.server_dir if name == "superlink" and self.server_dir else self.workdir
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                cwd=cwd, start_new_session=True)
        log.close()
        self.procs.append(proc)
        self.named[name] = proc
        return proc

    def _wait_port(self, port: int, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited early ({proc.returncode}):\n"
                                   + self.log_tail())
            with socket.socket() as s:
                if s.connect_ex((LOOPBACK, port)) == 0:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"nothing listens on {LOOPBACK}:{port} after "
                           f"{self.startup_timeout:g} s\n" + self.log_tail())

    def _start_warm_server(self) -> None:
        """The fork server on a socket in a private folder, the shim first on PATH."""
        from privfedcal.flower.deploy import clientapp_shim, warm

        folder = self.workdir / "clientapp-server"
        folder.mkdir(mode=0o700, exist_ok=True)
        folder.chmod(0o700)
        sock = str(folder / "server.sock")
        shim_dir = self.workdir / "bin"
        warm.install_shim(shim_dir)
        self.env["PATH"] = os.pathsep.join((str(shim_dir), self.env["PATH"]))
        self.env[clientapp_shim.SOCKET_ENV] = sock
        proc = self._start("clientapp-server", [sys.executable, "-m", "privfedcal.flower.deploy.warm",
                                                "--socket", sock])
        deadline = time.monotonic() + self.startup_timeout
        while warm.ping(sock) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the warm ClientApp server did not start:\n"
                                   + self.log_tail())
            time.sleep(0.1)

    def __enter__(self) -> LocalDeployment:
        self._prepare_home()
        try:
            if self.warm:
                self._start_warm_server()
            if self.secure:
                tls = ["--ssl-ca-certfile", str(self.tls["ca_cert"]),
                       "--ssl-certfile", str(self.tls["cert"]),
                       "--ssl-keyfile", str(self.tls["key"]), "--enable-supernode-auth"]
            else:
                tls = ["--insecure"]
            link = self._start("superlink", [
                "flower-superlink", *tls, "--host", LOOPBACK, "--port", str(self.port),
                "--disable-runtime-dependency-installation"])
            self._wait_port(self.port, link)
            for k in range(self.num_nodes):
                key = None
                if self.secure:
                    from privfedcal.flower.deploy.credentials import make_node_key

                    key, public = make_node_key(self.keys / f"supernode-{k}")
                    self.register(public)
                self.start_node(k, key)
        except BaseException:
            self.stop()
            raise
        return self

    def register(self, public_key: Path) -> None:
        """Allow the SuperNode of ``public_key`` to connect (``flwr supernode register``,
        over the Control API; only with ``secure``)."""
        done = subprocess.run([_flwr(), "supernode", "register", str(public_key), CONNECTION],
                              capture_output=True, text=True, env=self.env, cwd=self.workdir,
                              timeout=self.startup_timeout)
        if done.returncode != 0:
            raise RuntimeError(f"flwr supernode register {public_key} exited "
                               f"{done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def start_node(self, k: int, key: Path | None = None, *, tls: bool | None = None,
                   name: str | None = None) -> subprocess.Popen:
        """Start a SuperNode for partition ``k``: with TLS (``--root-certificates``, the
        CA made here) when the deployment is secure unless ``tls`` says otherwise, and
        signing with the private ``key`` if given (SuperNode authentication)."""
        tls = self.secure if tls is None else tls
        args = ["--root-certificates", str(self.tls["ca_cert"])] if tls else ["--insecure"]
        if key is not None:
            args += ["--auth-supernode-private-key", str(key)]
        return self._start(name or f"supernode-{k}", [
            "flower-supernode", *args, "--superlink", f"{LOOPBACK}:{self.port}",
            "--host", LOOPBACK, "--port", str(free_port()),
            "--node-config", f"partition-id={k} num-partitions={self.num_nodes}"
            + (f" data-seed={self.data_seed}" if self.node_data_seed else "")])

    def nodes(self) -> list[dict[str, Any]]:
        """The SuperLink's SuperNodes (``flwr supernode list --format json``)."""
        import json

        done = subprocess.run([_flwr(), "supernode", "list", CONNECTION, "--format", "json"],
                              capture_output=True, text=True, env=self.env, cwd=self.workdir,
                              timeout=self.startup_timeout)
        if done.returncode != 0:
            raise RuntimeError(f"flwr supernode list exited {done.returncode}: "
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return list(json.loads(done.stdout)["nodes"])

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every started process group, wait, then SIGKILL all that is left."""
        pids = [p.pid for p in self.procs]
        tracked = set(pids)
        for pid in pids:
            tracked.update(descendants(pid))
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for pid in pids:
            tracked.update(descendants(pid))
        for pid in tracked:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()

    def alive(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    # ---- runs -------------------------------------------------------------------------------
    def run(self, app_dir: Path, overrides: dict[str, Any], timeout: float = 600.0
            ) -> subprocess.CompletedProcess:
        """``flwr run`` of a copy of ``app_dir`` with run-config ``overrides``; waits for the
        end of the run (``--stream``) and returns the completed ``flwr`` process."""
        return subprocess.run(self._run_command(app_dir, overrides), capture_output=True,
                              text=True, env=self.env, cwd=self.workdir, timeout=timeout)

    def start_run(self, app_dir: Path, overrides: dict[str, Any]) -> subprocess.Popen:
        """``run`` without waiting: the ``flwr run --stream`` process, its output in
        ``logs/flwr-run.log``; stopped with the deployment."""
        log = open(self.logs / "flwr-run.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(self._run_command(app_dir, overrides), stdout=log,
                                stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
                                start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def kill_node(self, k: int) -> None:
        """SIGKILL SuperNode ``k`` and every process below it, as a machine that dies."""
        proc = self.named[f"supernode-{k}"]
        for pid in [*descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait(timeout=10)

    def _run_command(self, app_dir: Path, overrides: dict[str, Any]) -> list[str]:
        app = self.workdir / "app"
        if app.exists():
            shutil.rmtree(app)
        # nothing the app does not declare is added (a key of the caller's that it does not
        # declare is left for `flwr run` to refuse, as Flower does)
        if "clients" in app_run_config(app_dir):  # privfedcal's app: a partition per node
            overrides = {"clients": self.num_nodes, **overrides}
        shutil.copytree(app_dir, app, ignore=shutil.ignore_patterns("runs", "__pycache__"))
        override_file = self.workdir / "overrides.toml"
        bad = [k for k in overrides if not _BARE_KEY.fullmatch(k)]
        if bad:
            raise UsageError(f"run-config keys must be bare TOML keys, got {bad}")
        # bare dotted keys nest ("method-params.mu"), as in the app's pyproject
        override_file.write_text("".join(f"{k} = {_toml_value(v)}\n"
                                         for k, v in overrides.items()))
        return [_flwr(), "run", str(app), CONNECTION, "--run-config", str(override_file),
                "--stream", *self.run_args()]

    def run_args(self) -> list[str]:
        return []

    def run_status(self, run_id: int) -> str:
        """The SuperLink's status of run ``run_id`` (``flwr ls``): ``finished:completed``,
        ``finished:failed``, ``running``, ...; "" when it cannot be read."""
        import json

        done = subprocess.run([_flwr(), "ls", CONNECTION, "--run-id", str(run_id),
                               "--format", "json"], capture_output=True, text=True,
                              env=self.env, cwd=self.workdir, timeout=self.startup_timeout)
        try:
            runs = json.loads(done.stdout)["runs"]
        except (ValueError, KeyError, TypeError):
            return ""
        return str(runs[0]["status"]) if runs else ""

    def log_tail(self, chars: int = 3000) -> str:
        parts = []
        for f in sorted(self.logs.glob("*.log")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)


def _exe(name: str) -> str:
    """Flower's command ``name`` of this Python environment (found without PATH), else PATH's;
    a path is kept as it is."""
    if os.sep in name:
        return name
    path = Path(sys.executable).with_name(name)
    return str(path) if path.exists() else name


def _flwr() -> str:
    return _exe("flwr")


class LocalSimulation(LocalDeployment):
    """Flower's simulation engine (``flwr[simulation]``, Ray) behind a SuperLink this object
    starts and stops: ``with LocalSimulation(10, tmp) as sim: sim.run(app_dir, {})``.

    The SuperLink runs in simulation mode with runtime dependency installation off (the app
    runs with the installed privfedcal) on free ports, ``FLWR_HOME`` private; ``clients``
    virtual SuperNodes get partition ids 0..clients-1 from the engine. Every process is
    stopped afterwards, as for ``LocalDeployment``.
    """

    def __enter__(self) -> LocalSimulation:
        self._prepare_home()
        try:
            # the virtual nodes' node configs are Flower's: they read the data seed from
            # the environment the SuperLink passes down (flower/client_app.py)
            self.env[DATA_SEED_ENV] = str(self.data_seed)
            link = self._start("superlink", [
                "flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
                "--host", LOOPBACK, "--port", str(self.port),
                "--control-api-address", f"{LOOPBACK}:{free_port()}",
                "--disable-runtime-dependency-installation"])
            self._wait_port(self.port, link)
        except BaseException:
            self.stop()
            raise
        return self

    def run_args(self) -> list[str]:
        return ["--federation-config", f"num-supernodes={self.num_nodes}"]


#: ``flwr run``'s line naming the run it started
_STARTED = re.compile(r"Successfully started run (\d+)")


def _nodes_for(args: Any, declared: dict[str, Any], flat: dict[str, Any]) -> int:
    """The number of SuperNodes: ``--nodes``, else the app's ``clients`` (privfedcal's
    app: one partition per node), else refused."""
    if args.nodes is not None:
        if args.nodes < 1:
            raise UsageError(f"--nodes must be >= 1, got {args.nodes}")
        if "clients" in flat and flat["clients"] != args.nodes:
            raise UsageError(f"clients={flat['clients']} differs from --nodes {args.nodes}")
        return int(args.nodes)
    if "clients" in declared:
        clients = flat.get("clients", declared["clients"])
        if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
            raise UsageError(f"clients must be an integer >= 1, got {clients!r}")
        return clients
    raise UsageError(f"{args.app} declares no 'clients': say how many nodes with --nodes N")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m privfedcal.flower.deploy.localdeploy",
                                 description=main.__doc__.splitlines()[0] if main.__doc__ else "")
    ap.add_argument("mode", choices=["deploy", "simulate"])
    ap.add_argument("app", type=Path, help="the Flower app folder (examples/flower)")
    ap.add_argument("config", nargs="*", help="run-config overrides KEY=VALUE (TOML values)")
    ap.add_argument("--nodes", type=int, default=None,
                    help="number of SuperNodes (default: the app's `clients`)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", type=Path, default=None,
                    help="the folder the ServerApp runs in and keeps its files in (a "
                    "plugin's run folder, the app's saved model); default: a new "
                    "runs/flower-<mode>-<time> under the current folder")
    ap.add_argument("--secure", action="store_true",
                    help="deploy only: TLS and SuperNode authentication, with a CA, "
                    "certificate and node keys made in the temporary folder")
    ap.add_argument("--warm", action="store_true",
                    help="deploy only: start privfedcal-clientapp-server and put its "
                    "flwr-clientapp shim first on the nodes' PATH (docs/flower.md)")
    return ap


def _app_run_config(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(run config to pass, the keys the app declares, number of nodes) from the command's
    overrides; a ``UsageError`` for an override that is not TOML, not flat or not declared."""
    import tomllib

    try:
        overrides = tomllib.loads("\n".join(args.config)) if args.config else {}
    except tomllib.TOMLDecodeError as ex:
        raise UsageError(f"run-config overrides must be KEY=VALUE in TOML ({ex})") from None
    try:
        flat = flatten_dict(overrides)
    except ValueError as ex:  # a list or another type Flower's run config has not
        raise UsageError(str(ex).replace("`", "")) from None
    declared = app_run_config(args.app)
    app_run_config(args.app, flat)  # a key the app does not declare: refused here
    nodes = _nodes_for(args, declared, flat)
    if "clients" in declared:
        flat["clients"] = nodes
    if "out" in declared and not flat.get("out"):  # privfedcal's app: its run folder
        flat["out"] = str(args.out)
    return flat, declared, nodes


def _out_folder(out: Path | None, mode: str) -> Path:
    """``--out`` (refused if it holds files already), else a new
    ``runs/flower-<mode>-<time>[-k]`` under the current folder."""
    if out is None:
        base = Path("runs").resolve() / f"flower-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
        out = next(d for k in range(1, 1000)
                   if not (d := base if k == 1 else Path(f"{base}-{k}")).exists())
    out = out.resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} is not an empty folder: give a new one")
    return out


def _make_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as ex:
        raise UsageError(f"cannot create --out {out}: {ex.strerror}") from None


def _run_app(args: argparse.Namespace, flat: dict[str, Any], declared: dict[str, Any],
             nodes: int) -> int:
    """Run the app on a throwaway deployment or simulation; 0 when it finished (and, for
    privfedcal's app, wrote its summary), else 1 with the processes' log tails."""
    import tempfile

    kind = LocalDeployment if args.mode == "deploy" else LocalSimulation
    extra: dict[str, Any] = {"node_data_seed": "data-seed" in declared}
    if args.secure:
        extra["secure"] = True
    if args.warm:
        extra["warm"] = True
    with tempfile.TemporaryDirectory() as tmp, kind(nodes, Path(tmp), server_dir=args.out,
                                                    **extra) as dep:
        done = dep.run(args.app.resolve(), flat, timeout=args.timeout)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        # `flwr run --stream` exits 0 when the run started, whatever the ServerApp did: the
        # SuperLink's status of the run says whether it finished, and for privfedcal's app
        # the run folder's summary.json too
        started = _STARTED.search(done.stdout + done.stderr)
        status = dep.run_status(int(started.group(1))) if started else ""
        ok = status == "finished:completed"
        if ok and "out" in flat:
            ok = (Path(flat["out"]) / "summary.json").exists()
        if not ok:
            sys.stderr.write(dep.log_tail())
    if ok:
        print("the run finished")
    else:
        print(f"the run failed (logs above; run status {status or 'unknown'}, flwr run "
              f"exited {done.returncode})")
    print(f"run folder: {args.out}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m privfedcal.flower.deploy.localdeploy {deploy,simulate} APP_DIR [KEY=VALUE ...]``:
    run any Flower app folder on a throwaway local deployment (SuperLink + one SuperNode per
    node) or on the simulation engine, print the run's output, stop every process.

    Only run-config keys the app declares are passed (a key it does not declare is refused
    with one line, exit 2). The ServerApp runs in ``--out`` (default: a fresh folder under
    ``runs/``), which keeps what it writes (the plugin's run folder, the app's saved model)
    and is printed at the end. For privfedcal's own app (it declares ``clients``, ``out``
    and ``data-seed``) the number of nodes defaults to ``clients``, its ``out`` to that
    folder, and the nodes get a shared data seed."""
    ap = _parser()
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after options
    if args.warm and args.mode != "deploy":
        ap.error("--warm applies to deploy (the simulation engine starts no flwr-clientapp)")
    if args.secure and args.mode != "deploy":
        ap.error("--secure applies to deploy (the simulation engine has no SuperNodes)")
    try:
        args.out = _out_folder(args.out, args.mode)
        flat, declared, nodes = _app_run_config(args)
        _make_out(args.out)
    except UsageError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    return _run_app(args, flat, declared, nodes)


if __name__ == "__main__":
    raise SystemExit(main())
