"""A real NDIF server (PyPI ``ndif``) on loopback, for the suite: started, models deployed, and stopped again.

Its pieces run from the server venv that ``tests/remote/ndif/setup.sh`` makes (Python 3.12, as NDIF requires): Redis, moto
(an S3-compatible object store), a Ray head with logical GPU resources (NDIF places models only on GPU nodes), NDIF's
controller and its API (gunicorn). Every long-lived service runs in its own session (``setsid``) and is stopped by
ending that session's processes; nothing else on the machine is touched (never ``ray stop``, which ends every Ray
process on the machine). Models are tiny checkpoints saved into an HF cache layout under made-up repo ids, deployed
with ``ndif deploy -f`` in float32, and loaded by ``cpu_actor.CPUModelActor`` (NDIF's actor minus its CUDA calls).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
VENV = Path(os.environ.get("NDIF_VENV", ROOT / ".ndif-venv"))
CUDA_MEMORY = 8 << 30  # the logical GPU's memory, against which the controller sizes models


def unavailable() -> str | None:
    """Why this machine cannot host the server, or None."""
    if not (VENV / ".nnterp-ndif-setup").exists():  # setup.sh's marker: written once everything is installed
        return (f"no NDIF server venv at {VENV}: run tests/remote/ndif/setup.sh (it needs Python 3.12 under "
                "~/.pyenv/versions; it says why when it cannot make the venv)")
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (tests/remote/ndif/setup.sh installs it with apt-get)"
    return None


def save_to_hub_cache(hub: Path, repo_id: str, model, tokenizer) -> Path:
    """The checkpoint as the HF hub cache holds a download: ``models--org--name/snapshots/<rev>`` and ``refs/main``."""
    folder = hub / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    snapshot = folder / "snapshots" / revision
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    return snapshot


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def session_processes(sid: int) -> list[int]:
    """Every process in session ``sid`` (a service started with setsid and all it spawned)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, _, _, session = stat.rpartition(")")[2].split()[:4]  # the fields after the name
            if int(session) == sid and state != "Z":  # a zombie has ended already
                pids.append(int(entry.name))
    return pids


class ServerError(RuntimeError):
    pass


class NDIFServer:
    """Save models under ``hub``, then :meth:`start` with them; :meth:`stop` ends everything (idempotent)."""

    def __init__(self):
        # short: Ray's unix socket paths live under its temp dir and are limited to 107 characters
        self.root = Path(tempfile.mkdtemp(prefix="nnterp-ndif-"))
        self.hub = self.root / "hf" / "hub"
        self.hub.mkdir(parents=True)
        self.logs = self.root / "logs"
        self.logs.mkdir()
        self.processes: dict[str, subprocess.Popen] = {}  # service -> its session's leader (session id = its PID)
        (self.redis_port, self.s3_port, self.gcs_port, self.client_port, self.api_port, self.dashboard_port,
         *self.ray_ports) = free_ports(12)
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.env = self._environment()

    def _environment(self) -> dict:
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("PYTHON", "RAY_", "NDIF_")) and key != "VIRTUAL_ENV"}
        env.update(
            PATH=f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            PYTHONPATH=str(HERE),  # cpu_actor only: the server has torch, transformers and nnsight, not nnterp
            HF_HOME=str(self.hub.parent), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TQDM_DISABLE="1",
            OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",  # one torch thread, as the local references run
            RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # the second keeps Ray on loopback
            GRPC_ENABLE_FORK_SUPPORT="0",  # NDIF's ray/start.sh: Ray client servers otherwise die at fork
            NDIF_HOME=str(self.root / "home"),
            NDIF_REDIS_URL=f"redis://127.0.0.1:{self.redis_port}",
            NDIF_OBJECT_STORE_URL=f"http://127.0.0.1:{self.s3_port}",
            NDIF_OBJECT_STORE_ACCESS_KEY="test", NDIF_OBJECT_STORE_SECRET_KEY="test",
            NDIF_RAY_ADDRESS=f"ray://127.0.0.1:{self.client_port}",
            NDIF_API_URL=self.url, NDIF_API_PORT=str(self.api_port),
            NDIF_RAY_HEAD_PORT=str(self.gcs_port), NDIF_RAY_TEMP_DIR=str(self.root / "ray"),
            NDIF_DEFAULT_DTYPE="float32", NDIF_MODEL_IMPORT_PATH="cpu_actor.CPUModelActor",
            NDIF_AUTOSCALING_MAX_REPLICAS="1",
            GUNICORN_CMD_ARGS=f"--bind 127.0.0.1:{self.api_port}",  # NDIF's gunicorn config binds 0.0.0.0
        )
        return env

    # -- processes ---------------------------------------------------------------------------
    def _spawn(self, name: str, command: list[str], **env: str) -> subprocess.Popen:
        """A service in its own session (run from the server's own folder: no nnterp on its path either)."""
        with (self.logs / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(command, env=self.env | env, cwd=self.root, stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = process
        with (self.root / "pids").open("a") as pids:
            pids.write(f"{name} {process.pid}\n")
        return process

    def _run(self, name: str, command: list[str], timeout: float, **env: str) -> None:
        """A command that ends by itself, in its own session too (a leftover child is ended at stop)."""
        process = self._spawn(name, command, **env)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ServerError(f"{name} did not finish in {timeout:.0f} s\n{self.log_tail(name)}") from None
        if code:
            raise ServerError(f"{name} failed ({code})\n{self.log_tail(name)}")

    def log_tail(self, name: str, chars: int = 4000) -> str:
        path = self.logs / f"{name}.log"
        return f"--- {path} ---\n" + (path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)")

    def _wait(self, what: str, ready, timeout: float, service: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.processes[service].poll() is not None:
                raise ServerError(f"{service} exited before {what}\n{self.log_tail(service)}")
            if time.monotonic() > deadline:
                raise ServerError(f"{what}: not within {timeout:.0f} s\n{self.log_tail(service)}")
            time.sleep(0.5)

    @staticmethod
    def _listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _connected(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/connected", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, models: dict[str, tuple[str, int]]) -> None:
        """Start the services and deploy ``{repo_id: (model_key, size_bytes)}`` (each saved under ``self.hub``),
        pinned, in float32; return once every model is ready and the API serves."""
        python = str(VENV / "bin" / "python")
        # the server must not see nnterp: only what a request ships may run there
        if subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('nnterp') "
                                         "is not None)"], env=self.env, cwd=self.root).returncode:
            raise ServerError(f"nnterp is importable in the server venv {VENV}: the test would not be faithful")
        self._spawn("redis", ["redis-server", "--bind", "127.0.0.1", "--port", str(self.redis_port), "--save", "",
                              "--appendonly", "no"])
        self._spawn("moto", [str(VENV / "bin" / "moto_server"), "-H", "127.0.0.1", "-p", str(self.s3_port)])
        resources = {"head": 10, "cuda_memory_bytes": CUDA_MEMORY,
                     "cpu_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
        node, objects, agent_grpc, agent_http, metrics, runtime_env = self.ray_ports
        self._spawn("ray", [
            str(VENV / "bin" / "ray"), "start", "--head", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1", f"--port={self.gcs_port}", f"--ray-client-server-port={self.client_port}",
            f"--node-manager-port={node}", f"--object-manager-port={objects}", f"--metrics-export-port={metrics}",
            f"--dashboard-agent-grpc-port={agent_grpc}", f"--dashboard-agent-listen-port={agent_http}",
            f"--runtime-env-agent-port={runtime_env}",
            # the controller lists nodes through the dashboard's state API
            "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
            # logical resources: one "GPU" (nothing runs on a GPU) and CPUs for the controller and one actor a model
            "--num-cpus=8", "--num-gpus=1", f"--resources={json.dumps(resources)}",
            "--object-store-memory=200000000", f"--temp-dir={self.root / 'ray'}"])
        self._wait("Redis listening", lambda: self._listening(self.redis_port), 30, "redis")
        self._wait("moto listening", lambda: self._listening(self.s3_port), 60, "moto")
        self._wait("the Ray client server listening", lambda: self._listening(self.client_port), 300, "ray")
        # the API meanwhile: its dispatcher retries Ray every second until the controller exists
        self._spawn("api", [str(VENV / "bin" / "gunicorn"), "--config", "python:ndif.services.api.gunicorn_conf",
                            "ndif.services.api.app:app"])
        # a driver that launches NDIF's detached controller actor, then exits
        self._run("controller", [python, "-m", "ndif.services.ray.deployments.controller.controller"], 300,
                  RAY_ADDRESS=f"127.0.0.1:{self.gcs_port}")
        # explicitly: NDIF 0.1.2's deploy on a first request fails with nnsight 0.8.1
        config = {"models": [{"checkpoint": repo, "task": "text-generation", "model_key": key, "pinned": True,
                              "dtype": "float32", "size_bytes": size} for repo, (key, size) in models.items()]}
        path = self.root / "models.yaml"
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        self._run("deploy", [str(VENV / "bin" / "ndif"), "deploy", "-f", str(path)], 600)  # returns once ready
        self._wait("the API connected to Ray", self._connected, 300, "api")

    def max_inline_bytes(self) -> int:
        """NDIF's cap on a result sent back inline, as NDIF derives it from this Redis (larger ones go to the store)."""
        code = "from ndif.common.providers.redis import RedisProvider as R; print(R.max_publish_bytes())"
        answer = subprocess.run([str(VENV / "bin" / "python"), "-c", code], env=self.env, cwd=self.root,
                                capture_output=True, text=True, timeout=60)
        if answer.returncode:
            raise ServerError(f"could not read NDIF's inline cap: {answer.stderr[-2000:]}")
        return int(answer.stdout.split()[-1])

    def stop(self) -> list[int]:
        """End every process of every session this server started; returns the PIDs that outlived a SIGKILL (none).

        A short grace after SIGTERM, then SIGKILL: nothing here keeps state (Ray alone takes over 10 s to end
        gracefully), and the folder with the logs goes too (set NNTERP_NDIF_KEEP to keep it)."""
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            for process in self.processes.values():
                for pid in session_processes(process.pid):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            while self.leftovers() and time.monotonic() < deadline:
                time.sleep(0.2)
        left = self.leftovers()
        self.processes.clear()
        if not left and not os.environ.get("NNTERP_NDIF_KEEP"):
            shutil.rmtree(self.root, ignore_errors=True)
        return left

    def leftovers(self) -> list[int]:
        for process in self.processes.values():
            process.poll()  # reaps a leader, our child
        return [pid for process in self.processes.values() for pid in session_processes(process.pid)]


@contextlib.contextmanager
def deployed(models: dict, tokenizer) -> Iterator[NDIFServer]:
    """A server with ``models`` ({made-up repo id: a model}) deployed, and this process's client pointed at it (the
    HF cache it reads, the ids it would canonicalise online, nnsight's host, no API key or remote logging), all put
    back at the end; the server stopped at the end, with nothing it started left running."""
    import nnsight
    import pytest
    from huggingface_hub import constants
    from nnsight.modeling import huggingface

    from nnterp import StandardizedTransformer

    server = NDIFServer()
    with pytest.MonkeyPatch.context() as patch:
        try:
            patch.setattr(constants, "HF_HUB_CACHE", str(server.hub))  # the client reads the server's cache
            deployments = {}
            for repo, model in models.items():
                save_to_hub_cache(server.hub, repo, model, tokenizer)
                patch.setitem(huggingface._ID_CACHE, repo, repo)  # offline: the hub would canonicalise the id
                key = StandardizedTransformer(repo, dispatch=False).to_model_key()  # the key requests carry
                deployments[repo] = key, sum(p.numel() * p.element_size() for p in model.parameters())
            server.start(deployments)
        except BaseException:
            server.stop()
            raise
        patch.setattr(nnsight.CONFIG.API, "HOST", server.url)
        patch.setattr(nnsight.CONFIG.API, "APIKEY", None)
        patch.setattr(nnsight.CONFIG.APP, "REMOTE_LOGGING", False)
        yield server
        assert server.stop() == []  # nothing it started outlives it
