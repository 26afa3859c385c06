"""A real multi-node Ray cluster on one machine with the service deployed on it, for tests/deploy/test_ray_cluster.py
and bench/ray_latency.py: a head and N worker nodes, each its own Ray processes (GCS on the head, a raylet and its
agents per node, the replicas as workers of their node), started by Ray's `cluster_utils.Cluster` as Ray's own
multi-node tests start them, then deploy/ray/serve_config.yaml deployed with `serve run --non-blocking`.

Two halves, one file:
- `main()` is the driver, run by .venv-ray's python (`make ray-venv`): it owns the cluster and answers one JSON line
  per command on stdin (`replicas`, `kill`, `quit`), each reply a line starting with `REPLY_PREFIX` on stdout.
- `LocalRayCluster` runs the driver from any Python (standard library only: the dev venv has no Ray) and is what
  tests and benchmarks use: `with LocalRayCluster(repository, log_path, app_args={...}) as cluster:` then `cluster.url`,
  `cluster.replicas()` (state and node of every replica), `cluster.kill_node("worker-1")` (SIGKILL to every process
  of that node, as a machine that dies).

The nodes talk over this machine's own address (Ray's default; its HTTP proxy listens on 127.0.0.1 only), under a
short private temp dir (Ray's socket paths must fit 107 bytes). The driver leads a session that holds every node's
processes and workers: its memory is the cluster's, and the driver kills the session when its parent dies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAY_PYTHON = ROOT / ".venv-ray" / "bin" / "python"
SERVE_CONFIG = ROOT / "deploy" / "ray" / "serve_config.yaml"
APP = "tserve"  # the application and its deployment, as serve_config.yaml names them
REPLY_PREFIX = "tserve-ray: "
LOOPBACK = "127.0.0.1"
NODE_CPUS = 1  # each node offers Ray one CPU, as issue 58 asks: a replica (1 ONNX Runtime thread) per node
# Ray's shared-memory object store per node: the service passes no objects through it (requests and responses go
# through the proxy's ASGI messages), so the smallest Ray accepts comfortably; Ray's default is 30% of RAM per node.
OBJECT_STORE_BYTES = 80 * 2**20
READY_TIMEOUT_S = 180.0  # cluster up, application deployed and its first replica's models loaded, on 2 busy cores
COMMAND_TIMEOUT_S = 60.0  # a reply to one command (a status read, a node killed and reaped)
POLL_S = 0.5  # how often the driver reads the application's status, and checks its parent
QUIT_TIMEOUT_S = 60.0  # `quit`: Serve and every node shut down before the process group is signalled
PORT_ATTEMPTS = 3  # proxy ports tried when Ray's own processes took the one chosen first
BIND_FAILED = "Failed to bind to address"  # Ray's proxy, when its port was taken
# One proxy, on the head: on one machine every node's proxy would listen on the same port (Ray sets SO_REUSEPORT), so
# the kernel, not a load balancer, would pick the node; serve_config.yaml's EveryNode is for a cluster of machines.
PROXY_LOCATION = "HeadOnly"
KIB = 1024


def session_processes(session: int) -> list[int]:
    """The pids of a session: the driver's (it starts one), which holds the nodes' processes and their workers (Ray
    puts each worker in a process group of its own, in the same session)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()  # fields[0] is stat(5)'s field 3, the state
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[3]) == session:  # field 6, the session
            found.append(int(stat.parent.name))
    return found


def proportional_bytes(pid: int) -> int:
    """The process's proportional set size (PSS): its resident pages, each shared page divided among the processes
    that map it, so that a sum over processes is the memory they use together (the Ray processes share ~100 MB of
    libraries each). 0 for a process that has ended."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * KIB for line in text.splitlines() if line.startswith("Pss:")), 0)


# --- the driver (.venv-ray) -----------------------------------------------------------------------------------------


def effective_config(port: int, app_args: dict, proxy_location: str) -> dict:
    """serve_config.yaml with the cluster's HTTP address and proxy placement, and `app_args` merged into the
    application's args (its `settings` merged key by key)."""
    import yaml

    config = yaml.safe_load(SERVE_CONFIG.read_text())
    config["proxy_location"] = proxy_location
    config["http_options"].update(host=LOOPBACK, port=port)
    (app,) = [a for a in config["applications"] if a["name"] == APP]
    settings = {**app["args"].get("settings", {}), **app_args.get("settings", {})}
    app["args"] = {**app["args"], **app_args, "settings": settings}
    return config


class Driver:
    """The cluster, its nodes by name (head, worker-1, ...) and the replicas' state as Serve's controller reports it."""

    def __init__(self, workers: int, temp_dir: str):
        from ray.cluster_utils import Cluster

        common = {"num_cpus": NODE_CPUS, "object_store_memory": OBJECT_STORE_BYTES}
        # Ray writes the cluster's address to <temp root>/ray/ray_current_cluster whatever temp_dir says, and does
        # not create that folder on a machine where Ray never ran (a fresh CI machine)
        Path(tempfile.gettempdir(), "ray").mkdir(exist_ok=True)
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **common, "temp_dir": temp_dir, "include_dashboard": False, "include_log_monitor": False,
            "no_monitor": True, "dashboard_port": 0})
        self.nodes = {"head": self.cluster.head_node}
        for index in range(1, workers + 1):
            self.nodes[f"worker-{index}"] = self.cluster.add_node(**common)
        self.cluster.wait_for_nodes()
        self.names = {node.node_id: name for name, node in self.nodes.items()}

    def deploy(self, port: int, app_args: dict, proxy_location: str, temp_dir: str) -> int:
        """serve_config.yaml deployed by `serve run --non-blocking`, its proxy on `port` (0: a free one, chosen again
        when another process takes it first: Ray's own processes bind ports of their own as they start); the port."""
        import ray
        import yaml
        from ray import serve

        from service.client.processes import free_port

        ray.init(address=self.cluster.address, log_to_driver=False)
        path = Path(temp_dir) / "serve_config.yaml"
        serve_cli = Path(sys.executable).with_name("serve")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            chosen = port or free_port()
            path.write_text(yaml.safe_dump(effective_config(chosen, app_args, proxy_location)))
            done = subprocess.run([str(serve_cli), "run", "--non-blocking", str(path)], cwd=ROOT, capture_output=True,
                                  text=True, env={**os.environ, "RAY_ADDRESS": self.cluster.address})
            if not done.returncode:
                return chosen
            if port or BIND_FAILED not in done.stderr or attempt == PORT_ATTEMPTS:
                raise RuntimeError(f"serve run failed ({done.returncode}): {done.stderr[-2000:]}")
            serve.shutdown()  # Serve keeps the HTTP options it started with: start it afresh on another port

    def status(self) -> dict:
        """The application's status, and each replica's state and node (Serve's controller's own view)."""
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeInstanceDetails

        details = ServeInstanceDetails(**_get_global_client().get_serve_details())
        app = details.applications.get(APP)
        if app is None:
            return {"status": "NOT_STARTED", "replicas": []}
        replicas = [{"id": r.replica_id, "state": str(r.state.value), "node": self.names.get(r.node_id, r.node_id),
                     "pid": r.pid} for d in app.deployments.values() for r in d.replicas]
        return {"status": str(app.status.value), "message": app.message, "replicas": replicas}

    def wait_running(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status()
            if status["status"] == "RUNNING":
                return status
            if status["status"] == "DEPLOY_FAILED":
                raise RuntimeError(f"the application failed to deploy: {status['message']}")
            time.sleep(POLL_S)
        raise TimeoutError(f"the application is not RUNNING after {timeout:.0f} s: {self.status()}")

    def kill(self, name: str) -> dict:
        """Every process of the node (raylet, agents, its replicas) SIGKILLed at once, as a machine that dies."""
        node = self.nodes.pop(name)
        self.cluster.remove_node(node, allow_graceful=False)
        return {"killed": name}

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


def serve_commands(driver: Driver) -> None:
    """One JSON command a line on stdin, one reply a line on stdout, until `quit` or the end of stdin."""
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "replicas":
                reply = driver.status()
            elif command["op"] == "kill":
                reply = driver.kill(command["node"])
            elif command["op"] == "quit":
                return
            else:
                reply = {"error": f"unknown op {command['op']!r}"}
        except Exception as error:  # noqa: BLE001 - the controller is told, the cluster stays up
            reply = {"error": repr(error)}
        print(REPLY_PREFIX + json.dumps(reply), flush=True)


def kill_session() -> None:
    """SIGKILL to every process of this session (the driver, every node and their workers), this one last."""
    me = os.getpid()
    for pid in session_processes(os.getsid(0)):
        if pid != me:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    os.kill(me, signal.SIGKILL)


def watch_parent() -> None:
    """`kill_session` as soon as the parent that started the driver is gone: a cluster must not outlive the test or
    benchmark that asked for it (and Ray's processes ignore SIGTERM while they are busy)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(POLL_S)
        kill_session()

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="the HTTP proxy's port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--app-args", default="{}", help="JSON merged into the application's args")
    parser.add_argument("--proxy-location", default=PROXY_LOCATION)
    options = parser.parse_args(argv)
    watch_parent()
    temp_dir = tempfile.mkdtemp(prefix="tserve-ray-", dir="/tmp")
    driver = Driver(options.workers, temp_dir)
    try:
        port = driver.deploy(options.port, json.loads(options.app_args), options.proxy_location, temp_dir)
        status = driver.wait_running(READY_TIMEOUT_S)
        print(REPLY_PREFIX + json.dumps({"ready": True, "port": port, "nodes": list(driver.nodes),
                                         "temp_dir": temp_dir, **status}), flush=True)
        serve_commands(driver)
    finally:
        driver.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


# --- the controller (any Python) ------------------------------------------------------------------------------------


class LocalRayCluster:
    """The driver in a subprocess (.venv-ray's python), and its commands. The driver's log (Ray's start-up, `serve
    run`) goes to `log_path`; the replicas' logs stay in Ray's session folder (`temp_dir`) until the cluster stops."""

    def __init__(self, repository: Path, log_path: Path, workers: int = 2, app_args: dict | None = None,
                 port: int = 0, python: Path = RAY_PYTHON):
        self.port, self.log_path = port, log_path
        app_args = {"repository": str(Path(repository).resolve()), **(app_args or {})}
        self.command = [str(python), "-m", "deploy.ray.local_cluster", "--workers", str(workers),
                        "--port", str(port), "--app-args", json.dumps(app_args)]
        self.process: subprocess.Popen | None = None
        self.nodes: list[str] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self, timeout: float = READY_TIMEOUT_S) -> LocalRayCluster:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
                                        start_new_session=True)
        try:
            ready = self._reply(timeout)
        except BaseException:
            self.stop()
            raise
        self.nodes, self.port = ready["nodes"], ready["port"]
        return self

    def _reply(self, timeout: float) -> dict:
        """The driver's next reply (other lines on its stdout go to the log); RuntimeError when it exits first."""
        result: list[dict] = []

        def read():
            for line in self.process.stdout:
                if line.startswith(REPLY_PREFIX):
                    result.append(json.loads(line[len(REPLY_PREFIX):]))
                    return
                self._log.write(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not result:
            raise RuntimeError(f"the Ray cluster's driver gave no answer in {timeout:.0f} s (exit status "
                               f"{self.process.poll()}); its log: {self.log_path}\n{self.log_tail()}")
        if "error" in result[0]:
            raise RuntimeError(f"the Ray cluster's driver: {result[0]['error']}")
        return result[0]

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return Path(self.log_path).read_text()[-chars:]

    def ask(self, op: str, timeout: float = COMMAND_TIMEOUT_S, **fields) -> dict:
        with self._lock:
            self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.process.stdin.flush()
            return self._reply(timeout)

    def replicas(self) -> dict:
        """{"status": the application's, "replicas": [{"id", "state", "node", "pid"}, ...]}"""
        return self.ask("replicas")

    def kill_node(self, name: str) -> dict:
        return self.ask("kill", node=name)

    def memory_bytes(self) -> int:
        """The memory the whole cluster uses now: the driver and every process of every node, by PSS."""
        return sum(proportional_bytes(pid) for pid in session_processes(self.process.pid))

    def stop(self) -> None:
        from service.client.processes import stop_process_group

        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(QUIT_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_process_group(self.process)
        for pid in session_processes(self.process.pid):  # a worker its raylet's end left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    main()
