"""``splitserve up``: the whole system on this machine, one process per pod, as a Kubernetes deployment would run it.

    splitserve up [--prefill 1] [--decode 1] [--mixed 0] [--scheduling hybrid] [--model smollm2-135m] ...

``--scheduling`` (docs/architecture.md, "Hybrid scheduling"): ``hybrid`` (the default) runs the prefill and decode
pods with the router placing each prompt from predicted latency (on a prefill pod, lent to its decode pod, or split
across both) and the decode pods prefilling lent prompts in TPOT-bounded chunks (``--tpot-slack-chunking``, their
target the router's ``--slo-tpot-s``); ``disaggregated`` is the pure split (prompts on prefill pods but for the
router's conditional_* rules); ``colocated`` starts every prefill and decode pod as a mixed pod instead (both phases
in one process), for comparison.

Starts, each a separate process with its log under ``--run-dir``, and in this order:
  redis-server   with ``--registry redis``: pods heartbeat into it and the router watches it
  prefill pods   python -m splitserve.prefill_service  on base_pod_port, base_pod_port+1, ...
  decode pods    python -m splitserve.decode_service   next ports (``--role mixed`` for mixed pods)
  router         python -m splitserve.router.server    gRPC on grpc_port, HTTP (OpenAI API, /metrics) on http_port
  prometheus     with ``--prometheus`` (default when installed): scrapes every process's /metrics
each pod pinned to its CPUs with one torch thread per CPU (the plan, ``splitserve/cpu_plan.py``, is printed first);
then waits until every pod and the router answer SERVING and the router routes to every pod, and prints the
endpoints. From then on ``splitserve/supervisor.py`` starts again any child that exits (same ports and flags, with
backoff) while the others keep serving; children die with the launcher.

Ctrl-C or SIGTERM stops everything in an order that loses no request: the router first (health NOT_SERVING, no new
requests, those in flight finish while every pod still serves), then the pods (each drains what is left), then
redis-server (the pods deregister from it on their way out), then Prometheus (it scrapes until the end). Each stage
gets SIGTERM, then SIGKILL after a grace period longer than its own drain.

What to start is ``UpConfig`` (``splitserve/up_config.py``: the flags and their checks); this module plans the
processes and their command lines and runs them; ``splitserve/probes.py`` asks a process whether it serves.

From Python (benchmarks, tests): ``cluster = Cluster(UpConfig(...))``; ``cluster.start()``, ``cluster.wait_ready()``,
``cluster.endpoints()``, ``cluster.cpu_plan``, ``cluster.restarts``, ``cluster.stop()``.
"""

from __future__ import annotations

import dataclasses
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.cpu_plan import CpuAssignment, floating, format_plan, plan_cpus
from splitserve.probes import pods_routed_to, serving
from splitserve.router.config import SHUTDOWN_GRACE_S as ROUTER_SHUTDOWN_GRACE_S
from splitserve.router.config import RouterConfig, Scheduling
from splitserve.runtime.config import parse_config, passed_on
from splitserve.runtime.cpus import allowed_cpus, format_cpu_list, thread_env
from splitserve.runtime.discovery import RegistryKind
from splitserve.runtime.roles import POD_ROLES, Role
from splitserve.runtime.transport import PLAINTEXT, TLSConfig
from splitserve.supervisor import Child, ChildSpec, Supervisor
from splitserve.up_config import POD_CONFIGS, UpConfig

STOP_MARGIN_S = 10.0  # beyond a process's own drain, before SIGKILL: its cleanups and exit

@dataclass
class PodPlan:
    name: str
    role: Role
    port: int
    metrics_port: int


class Cluster:
    """The processes of one ``splitserve up`` (see the module docstring)."""

    def __init__(self, config: UpConfig):
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="splitserve-up-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.pods = self._plan_pods()
        self.cpu_plan = self._plan_cpus()
        self.lent_cpus = self._lent_cpus()
        self.supervisor: Supervisor | None = None

    def _plan_pods(self) -> list[PodPlan]:
        c = self.config
        roles = [Role.PREFILL] * c.prefill + [Role.DECODE] * c.decode + [Role.MIXED] * c.mixed
        if c.scheduling is Scheduling.COLOCATED:
            roles = [Role.MIXED] * len(roles)
        counters: dict[str, int] = {}
        plans = []
        for i, role in enumerate(roles):
            counters[role] = counters.get(role, -1) + 1
            plans.append(PodPlan(f"{role}-{counters[role]}", role, c.base_pod_port + i, c.base_metrics_port + i))
        return plans

    def _plan_cpus(self) -> dict[str, CpuAssignment]:
        """The CPUs of every process this cluster starts, in start order."""
        allowed = allowed_cpus()
        ranks = {pod.name: self.config.ranks(pod.role) for pod in self.pods}
        plan = plan_cpus([(pod.name, pod.role) for pod in self.pods], allowed, self.config.cpu_sets(), ranks)
        if not self.config.pin_cpus:
            plan = {name: dataclasses.replace(p, cpus=allowed, pinned=False) for name, p in plan.items()}
        helpers = [floating("redis", allowed)] if self.config.registry is RegistryKind.REDIS else []
        ordered = helpers + [plan[pod.name] for pod in self.pods] + [plan["router"]]
        if self._runs_prometheus():
            ordered.append(floating("prometheus", allowed))
        return {p.process: p for p in ordered}

    def _lent_cpus(self) -> frozenset[int]:
        """The decode pods' CPUs the prefill pods borrow (empty without --lend-decode-cpus)."""
        if not self.config.lend_decode_cpus:
            return frozenset()
        prefill = [p for p in self.pods if p.role is Role.PREFILL]
        decode = [p for p in self.pods if p.role is Role.DECODE]
        if not prefill or not decode or not self.config.pin_cpus:
            raise ValueError("lend_decode_cpus needs prefill and decode pods (not --scheduling colocated) and "
                             "pinned CPUs")
        for name in ("prefill_tensor_parallel_size", "prefill_pipeline_parallel_size"):
            if getattr(self.config, name) > 1:
                raise ValueError(f"lend_decode_cpus with {name} > 1 is not built: only rank 0 of each prefill pod "
                                 "would borrow them")
        lent = frozenset().union(*(self.cpu_plan[p.name].cpus for p in decode))
        shared = lent & frozenset().union(*(self.cpu_plan[p.name].cpus for p in prefill))
        if shared:
            raise ValueError(f"lend_decode_cpus: the prefill and decode pods share CPU {format_cpu_list(shared)}; "
                             "lending needs disjoint sets")
        return lent

    def _activity_file(self, pod: PodPlan) -> Path:
        return self.run_dir / "activity" / pod.name

    def _runs_prometheus(self) -> bool:
        return self.config.prometheus and shutil.which("prometheus") is not None

    def address(self, pod: PodPlan) -> str:
        return f"{self.config.host}:{pod.port}"

    # ---- starting and stopping -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every process (in ``cpu_plan`` order) under a supervisor; returns once they are started."""
        self.supervisor = Supervisor([self._child_spec(name) for name in self.cpu_plan])
        self.supervisor.start()

    def _child_spec(self, name: str) -> ChildSpec:
        c, log = self.config, self.run_dir / f"{name}.log"
        if name == "redis":
            return ChildSpec(name, ["redis-server", "--port", str(c.redis_port), "--bind", c.host, "--save", "",
                                    "--appendonly", "no", "--dir", str(self.run_dir)], log)
        if name == "prometheus":
            return ChildSpec(name, self._prometheus_command(), log)
        if name == "router":
            # API keys go in its environment, not on its command line (ps shows command lines).
            env = {"SPLITSERVE_API_KEYS": ",".join(c.api_keys)} if c.api_keys else {}
            return ChildSpec(name, [sys.executable, "-m", "splitserve.router.server", *self._router_flags()], log,
                             env=env, stop_grace_s=ROUTER_SHUTDOWN_GRACE_S + STOP_MARGIN_S)
        pod = next(pod for pod in self.pods if pod.name == name)
        return ChildSpec(name, [sys.executable, "-m", _POD_MODULES[pod.role], *self._pod_flags(pod)], log,
                         env=thread_env(self.cpu_plan[name].threads), stop_grace_s=c.shutdown_grace_s + STOP_MARGIN_S)

    def stop(self) -> None:
        """Stop every process: the router, then the pods, then redis-server, then Prometheus (module docstring)."""
        if self.supervisor is not None:
            self.supervisor.stop([["router"], [pod.name for pod in self.pods], ["redis"], ["prometheus"]])

    @property
    def processes(self) -> list[Child]:
        """The supervised processes (``name``, ``popen``, ``restarts``), in start order; none before start()."""
        return list(self.supervisor.children.values()) if self.supervisor is not None else []

    @property
    def restarts(self) -> dict[str, int]:
        """How many times each process was started again after it exited."""
        return self.supervisor.restarts if self.supervisor is not None else {}

    def pid(self, name: str) -> int | None:
        """The running process of ``name`` (None while it waits to restart)."""
        return self.supervisor.children[name].pid if self.supervisor is not None else None

    # ---- command lines ---------------------------------------------------------------------------------------
    def _pod_flags(self, pod: PodPlan) -> list[str]:
        c = self.config
        flags = ["--host", c.host, "--port", str(pod.port), "--metrics-port", str(pod.metrics_port),
                 "--advertise-address", self.address(pod),
                 *passed_on(c, POD_CONFIGS[pod.role], scope=pod.role), *self._cpu_flags(pod.name)]
        if pod.role is not Role.PREFILL:
            flags += ["--role", str(pod.role)]
        hybrid = c.scheduling is Scheduling.HYBRID
        if pod.role is Role.DECODE and (hybrid or self.lent_cpus):  # the TPOT its requests keep while it lends
            flags += ["--tpot-target-s", str(c.slo_tpot_s)]
        if pod.role is Role.DECODE and hybrid:
            flags += ["--tpot-slack-chunking"]
        if pod.role is Role.DECODE and self.lent_cpus:
            flags += ["--activity-file", str(self._activity_file(pod))]
        if self.lent_cpus and pod.role is Role.PREFILL:
            activity = ",".join(str(self._activity_file(p)) for p in self.pods if p.role is Role.DECODE)
            flags += ["--lend-cpus", format_cpu_list(self.lent_cpus), "--lender-activity-files", activity]
        if c.registry is RegistryKind.REDIS:
            flags += ["--registry", "redis", "--redis-url", self._redis_url()]
        return flags

    def _router_flags(self) -> list[str]:
        c = self.config
        flags = ["--host", c.host, "--grpc-port", str(c.grpc_port), "--http-port", str(c.http_port),
                 "--scheduling", str(c.scheduling), *passed_on(c, RouterConfig), *self._cpu_flags("router")]
        if c.registry is RegistryKind.REDIS:
            return flags + ["--registry", "redis", "--redis-url", self._redis_url()]
        for role in POD_ROLES:
            addresses = ",".join(self.address(p) for p in self.pods if p.role is role)
            if addresses:
                flags += [f"--{role}-pods", addresses]
        return flags

    def _cpu_flags(self, name: str) -> list[str]:
        placement = self.cpu_plan[name]
        flags = ["--cpus", format_cpu_list(placement.cpus)] if placement.pinned else []
        return flags + (["--num-threads", str(placement.threads)] if placement.threads else [])

    def _https_targets(self) -> list[str]:
        """The router's /metrics, when it is served over HTTPS (the pods' /metrics stay plain HTTP)."""
        return [f"{self.config.host}:{self.config.http_port}"] if self.config.tls.cert_file else []

    def _redis_url(self) -> str:
        return f"redis://{self.config.host}:{self.config.redis_port}/0"

    def _prometheus_command(self) -> list[str]:
        c = self.config
        router = [] if self._https_targets() else [f"{c.host}:{c.http_port}"]
        targets = router + [f"{c.host}:{p.metrics_port}" for p in self.pods]
        config_file = self.run_dir / "prometheus.yml"
        config_file.write_text(prometheus_config(targets, https_targets=self._https_targets(), tls=c.tls))
        return ["prometheus", f"--config.file={config_file}", f"--web.listen-address={c.host}:{c.prometheus_port}",
                f"--storage.tsdb.path={self.run_dir / 'prometheus-data'}"]

    # ---- readiness -------------------------------------------------------------------------------------------
    def wait_ready(self, log=print) -> None:
        """Block until every pod and the router answer SERVING and the router routes to every pod (its
        ``GET /pods``; the router is SERVING as soon as one decode-capable pod is). Fails at once, with the tail of
        its log, if a process exits meanwhile: a misconfiguration shows at start, not as a restart loop."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = {p.name: self.address(p) for p in self.pods}
        pending["router"] = f"{self.config.host}:{self.config.grpc_port}"
        log(f"waiting for {len(pending)} processes to load the model and serve (logs: {self.run_dir}) ...")
        unseen = {self.address(p) for p in self.pods} if self.config.http_port else set()
        while pending or unseen:
            self._fail_if_any_exited()
            for name, address in list(pending.items()):
                if serving(address, self.config.tls):
                    log(f"  {name} serving at {address}")
                    del pending[name]
            if not pending and unseen:
                unseen -= pods_routed_to(f"{self.http_url}/pods", self.config)
                if not unseen:
                    log("  the router routes to every pod")
            if time.monotonic() > deadline:
                waiting = sorted(pending) + [f"the router to route to {address}" for address in sorted(unseen)]
                raise TimeoutError(f"still waiting after {self.config.ready_timeout_s:.0f} s for {', '.join(waiting)}")
            if pending or unseen:
                time.sleep(0.25)

    def _fail_if_any_exited(self) -> None:
        if self.supervisor is not None and self.supervisor.exits:
            first = self.supervisor.exits[0]
            log_file = self.supervisor.children[first.name].spec.log
            raise RuntimeError(f"{first.describe()} while starting; last lines of {log_file}:\n{first.log_tail}")

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.tls.cert_file else "http"
        return f"{scheme}://{self.config.host}:{self.config.http_port}"

    def endpoints(self) -> str:
        c = self.config
        lines = [f"router   gRPC {c.host}:{c.grpc_port}   (splitserve.v1.Generation; health; reflection)",
                 f"router   HTTP {self.http_url}/v1   (OpenAI API; /health; /metrics)"]
        for pod in self.pods:
            lines.append(f"{pod.name:<8} gRPC {self.address(pod)}   metrics http://{c.host}:{pod.metrics_port}/metrics")
        if "prometheus" in self.cpu_plan:
            lines.append(f"prometheus   http://{c.host}:{c.prometheus_port}")
        if c.registry is RegistryKind.REDIS:
            lines.append(f"redis        {self._redis_url()}")
        lines.append(f"logs         {self.run_dir}")
        return "\n".join(lines)

_POD_MODULES = {Role.PREFILL: "splitserve.prefill_service", Role.DECODE: "splitserve.decode_service",
                Role.MIXED: "splitserve.decode_service"}

def prometheus_config(targets: list[str], interval_s: int = 2, https_targets: list[str] = (),
                      tls: TLSConfig = PLAINTEXT) -> str:
    """One job over plain HTTP; ``https_targets`` (the router on TLS) in a second job of the same name, scraped
    over HTTPS with ``tls``'s CA and client certificate."""
    listed = ", ".join(f"'{t}'" for t in targets)
    config = (f"global:\n  scrape_interval: {interval_s}s\n  evaluation_interval: {interval_s}s\n"
              f"scrape_configs:\n  - job_name: splitserve\n    static_configs:\n      - targets: [{listed}]\n")
    if https_targets:
        listed = ", ".join(f"'{t}'" for t in https_targets)
        files = "".join(f"      {key}: '{path}'\n" for key, path in (
            ("ca_file", tls.ca_file), ("cert_file", tls.cert_file), ("key_file", tls.key_file)) if path)
        config += (f"  - job_name: splitserve-https\n    scheme: https\n    tls_config:\n{files}"
                   f"    static_configs:\n      - targets: [{listed}]\n        labels: {{job: splitserve}}\n")
    return config

def _interrupt(*_) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the cluster as Ctrl-C does


def main(argv: list[str]) -> None:
    config = parse_config(UpConfig, argv, prog="splitserve up")
    cluster = Cluster(config)
    signal.signal(signal.SIGTERM, _interrupt)
    print("CPU plan (splitserve/cpu_plan.py; --prefill-cpus, --decode-cpus, --mixed-cpus, --router-cpus):\n"
          + format_plan(list(cluster.cpu_plan.values())) + "\n", flush=True)
    failed = False
    try:
        cluster.start()
        cluster.wait_ready()
        print("\nsplitserve is up:\n" + cluster.endpoints())
        print(f"\ntry:  splitserve generate --router {config.host}:{config.grpc_port} "
              "\"What is the capital of France?\"")
        print("stop: Ctrl-C (a process that exits is started again; events are logged here)", flush=True)
        while True:  # the supervisor thread does the work
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstopping ...", file=sys.stderr, flush=True)
    except (OSError, RuntimeError, TimeoutError) as err:  # a process did not start: say why, stop the rest
        print(f"\nsplitserve up failed: {err}", file=sys.stderr, flush=True)
        failed = True
    finally:
        cluster.stop()
    if failed:
        sys.exit(1)
