"""``splitserve up``: the whole system on this machine, one process per pod, as a Kubernetes deployment would run it.

    splitserve up [--prefill 1] [--decode 1] [--mixed 0] [--model smollm2-135m] [--kv-codec none] ...

Starts (each a separate process, logs under ``--run-dir``):
  prefill pods   python -m prefill_service  on base_pod_port, base_pod_port+1, ...
  decode pods    python -m decode_service   next ports (``--role mixed`` for mixed pods)
  router         python -m router.server    gRPC on grpc_port, HTTP (OpenAI API, /metrics) on http_port
  redis-server   with ``--registry redis``: pods heartbeat into it and the router watches it
  prometheus     with ``--prometheus`` (default when installed): scrapes every process's /metrics
then waits until every pod answers SERVING on gRPC health, prints the endpoints, and on Ctrl-C (or SIGTERM)
stops everything: SIGTERM to each process, SIGKILL after a grace period.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import DEFAULT_MODEL
from router.policies import PolicyName
from runtime.config import described, member, parse_config
from runtime.registry import RegistryKind
from runtime.roles import POD_ROLES, Role


@dataclass
class UpConfig:
    """Run a router, prefill pods and decode pods on this machine, each as its own process."""

    model: str = field(default=DEFAULT_MODEL, metadata=described("Model every pod serves."))
    prefill: int = field(default=1, metadata=described("Number of prefill pods."))
    decode: int = field(default=1, metadata=described("Number of decode pods."))
    mixed: int = field(default=0, metadata=described("Number of mixed pods (both phases in one process)."))
    host: str = field(default="127.0.0.1", metadata=described("Address every process listens on."))
    grpc_port: int = field(default=50051, metadata=described("Router gRPC port (Generation API)."))
    http_port: int = field(default=8000, metadata=described("Router HTTP port (OpenAI API, /health, /metrics)."))
    base_pod_port: int = field(default=50060, metadata=described("Pods take consecutive gRPC ports from here."))
    base_metrics_port: int = field(default=9400, metadata=described("Pods take consecutive /metrics ports from here."))
    kv_codec: str = field(default="none", metadata=described("KV codec between prefill and decode pods."))
    policy: PolicyName = field(default=PolicyName.LEAST_LOADED, metadata=described("Routing policy."))
    conditional_prefill_threshold: int = field(default=32, metadata=described(
        "Prompts shorter than this many tokens prefill on the decode pod."))
    registry: RegistryKind = field(default=RegistryKind.STATIC, metadata=described(
        "'static' (the router gets the pod list) or 'redis' (a local redis-server; pods heartbeat into it)."))
    redis_port: int = field(default=6379, metadata=described("Port of the local redis-server (--registry redis)."))
    prometheus: bool = field(default=True, metadata=described("Start Prometheus scraping every process, if installed."))
    prometheus_port: int = field(default=9090, metadata=described("Prometheus web port."))
    kv_cache_memory_bytes: int = field(default=1 << 30, metadata=described("KV block pool of each pod."))
    threads_per_pod: int = field(default=0, metadata=described(
        "Torch threads of each pod (0: the machine's cores divided among the pods, at least 1)."))
    run_dir: str = field(default="", metadata=described("Where logs and generated configs go (empty: a new temp dir)."))
    ready_timeout_s: float = field(default=300.0, metadata=described("How long to wait for the pods to load."))

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.mixed) < 0 or self.decode + self.mixed == 0:
            raise ValueError("need at least one decode or mixed pod, and no negative counts")
        self.policy = member(PolicyName, "policy", self.policy)
        self.registry = member(RegistryKind, "registry", self.registry)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class PodPlan:
    name: str
    role: Role
    port: int
    metrics_port: int


class Cluster:
    """The processes of one ``splitserve up``: started in order, stopped in reverse."""

    def __init__(self, config: UpConfig):
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="splitserve-up-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.processes: list[Process] = []
        self.pods = self._plan_pods()

    def _plan_pods(self) -> list[PodPlan]:
        c = self.config
        roles = [Role.PREFILL] * c.prefill + [Role.DECODE] * c.decode + [Role.MIXED] * c.mixed
        counters: dict[str, int] = {}
        plans = []
        for i, role in enumerate(roles):
            counters[role] = counters.get(role, -1) + 1
            plans.append(PodPlan(f"{role}-{counters[role]}", role, c.base_pod_port + i, c.base_metrics_port + i))
        return plans

    def address(self, pod: PodPlan) -> str:
        return f"{self.config.host}:{pod.port}"

    # ---- starting --------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.config.registry is RegistryKind.REDIS:
            self._spawn("redis", ["redis-server", "--port", str(self.config.redis_port), "--bind", self.config.host,
                                  "--save", "", "--appendonly", "no", "--dir", str(self.run_dir)])
        for pod in self.pods:
            self._spawn(pod.name, [sys.executable, "-m", _POD_MODULES[pod.role], *self._pod_flags(pod)])
        self._spawn("router", [sys.executable, "-m", "router.server", *self._router_flags()])
        if self.config.prometheus and shutil.which("prometheus"):
            self._spawn("prometheus", self._prometheus_command())

    def _spawn(self, name: str, command: list[str]) -> None:
        log = self.run_dir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)  # Ctrl-C reaches us only; we stop them in order
        self.processes.append(Process(name, popen, log))

    def _threads(self) -> int:
        if self.config.threads_per_pod:
            return self.config.threads_per_pod
        return max(1, (os.cpu_count() or 1) // max(1, len(self.pods)))

    def _pod_flags(self, pod: PodPlan) -> list[str]:
        c = self.config
        flags = ["--host", c.host, "--port", str(pod.port), "--metrics-port", str(pod.metrics_port),
                 "--advertise-address", self.address(pod), "--model", c.model,
                 "--kv-cache-memory-bytes", str(c.kv_cache_memory_bytes), "--num-threads", str(self._threads())]
        if pod.role is Role.PREFILL:
            flags += ["--kv-codec", c.kv_codec]
        else:
            flags += ["--role", pod.role]
        if c.registry is RegistryKind.REDIS:
            flags += ["--registry", "redis", "--redis-url", self._redis_url()]
        return flags

    def _router_flags(self) -> list[str]:
        c = self.config
        by_role = {role: ",".join(self.address(p) for p in self.pods if p.role is role) for role in POD_ROLES}
        flags = ["--host", c.host, "--grpc-port", str(c.grpc_port), "--http-port", str(c.http_port),
                 "--model", c.model, "--policy", c.policy, "--kv-codec", c.kv_codec,
                 "--conditional-prefill-threshold", str(c.conditional_prefill_threshold)]
        if c.registry is RegistryKind.REDIS:
            return flags + ["--registry", "redis", "--redis-url", self._redis_url()]
        for role, addresses in by_role.items():
            if addresses:
                flags += [f"--{role}-pods", addresses]
        return flags

    def _redis_url(self) -> str:
        return f"redis://{self.config.host}:{self.config.redis_port}/0"

    def _prometheus_command(self) -> list[str]:
        c = self.config
        targets = [f"{c.host}:{c.http_port}"] + [f"{c.host}:{p.metrics_port}" for p in self.pods]
        config_file = self.run_dir / "prometheus.yml"
        config_file.write_text(prometheus_config(targets))
        return ["prometheus", f"--config.file={config_file}", f"--web.listen-address={c.host}:{c.prometheus_port}",
                f"--storage.tsdb.path={self.run_dir / 'prometheus-data'}"]

    # ---- readiness -------------------------------------------------------------------------------------------
    def wait_ready(self, log=print) -> None:
        """Block until every pod and the router answer SERVING and the router routes to every pod (its
        ``GET /pods``; the router is SERVING as soon as one decode-capable pod is); fail fast if a process exits."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = {p.name: self.address(p) for p in self.pods}
        pending["router"] = f"{self.config.host}:{self.config.grpc_port}"
        log(f"waiting for {len(pending)} processes to load the model and serve (logs: {self.run_dir}) ...")
        unseen = {self.address(p) for p in self.pods} if self.config.http_port else set()
        while pending or unseen:
            self.check_alive()
            for name, address in list(pending.items()):
                if serving(address):
                    log(f"  {name} serving at {address}")
                    del pending[name]
            if not pending and unseen:
                unseen -= _pods_routed_to(f"http://{self.config.host}:{self.config.http_port}/pods")
                if not unseen:
                    log("  the router routes to every pod")
            if time.monotonic() > deadline:
                waiting = sorted(pending) + [f"the router to route to {address}" for address in sorted(unseen)]
                raise TimeoutError(f"still waiting after {self.config.ready_timeout_s:.0f} s for {', '.join(waiting)}")
            if pending or unseen:
                time.sleep(0.25)

    def check_alive(self) -> None:
        for proc in self.processes:
            if proc.popen.poll() is not None:
                tail = proc.log.read_text(errors="replace").splitlines()[-20:]
                raise RuntimeError(f"{proc.name} exited with code {proc.popen.returncode}; last lines of "
                                   f"{proc.log}:\n" + "\n".join(tail))

    # ---- stopping --------------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 15.0) -> None:
        for proc in reversed(self.processes):
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in reversed(self.processes):
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def endpoints(self) -> str:
        c = self.config
        lines = [f"router   gRPC {c.host}:{c.grpc_port}   (splitserve.v1.Generation; health; reflection)",
                 f"router   HTTP http://{c.host}:{c.http_port}/v1   (OpenAI API; /health; /metrics)"]
        for pod in self.pods:
            lines.append(f"{pod.name:<8} gRPC {self.address(pod)}   metrics http://{c.host}:{pod.metrics_port}/metrics")
        if any(p.name == "prometheus" for p in self.processes):
            lines.append(f"prometheus   http://{c.host}:{c.prometheus_port}")
        if c.registry is RegistryKind.REDIS:
            lines.append(f"redis        {self._redis_url()}")
        lines.append(f"logs         {self.run_dir}")
        return "\n".join(lines)


_POD_MODULES = {Role.PREFILL: "prefill_service", Role.DECODE: "decode_service", Role.MIXED: "decode_service"}


def prometheus_config(targets: list[str], interval_s: int = 2) -> str:
    listed = ", ".join(f"'{t}'" for t in targets)
    return (f"global:\n  scrape_interval: {interval_s}s\n  evaluation_interval: {interval_s}s\n"
            f"scrape_configs:\n  - job_name: splitserve\n    static_configs:\n      - targets: [{listed}]\n")


def _pods_routed_to(url: str) -> set[str]:
    """Addresses of the pods the router at ``url`` (its ``GET /pods``) would route to now."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as reply:
            return {pod["address"] for pod in json.load(reply)["pods"] if pod["healthy"]}
    except OSError:  # not listening yet, or refused
        return set()


def serving(address: str) -> bool:
    """Whether the gRPC server at ``address`` answers SERVING to a health check now."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def main(argv: list[str]) -> None:
    config = parse_config(UpConfig, argv, prog="splitserve up")
    cluster = Cluster(config)
    stop = lambda *_: (_ for _ in ()).throw(KeyboardInterrupt)  # noqa: E731 - SIGTERM behaves like Ctrl-C
    signal.signal(signal.SIGTERM, stop)
    try:
        cluster.start()
        cluster.wait_ready()
        print("\nsplitserve is up:\n" + cluster.endpoints())
        print(f"\ntry:  splitserve generate --router {config.host}:{config.grpc_port} \"What is the capital of France?\"")
        print("stop: Ctrl-C", flush=True)
        while True:
            cluster.check_alive()
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("\nstopping ...", file=sys.stderr)
    finally:
        cluster.stop()
