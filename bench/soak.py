"""``splitserve bench soak``: a cluster under mixed load while faults are injected on a schedule. Does it lose,
fail or leak anything, or answer differently along another path?

    splitserve bench soak [--duration 180] [--model smollm2-135m] [--request-rate 2] [--kv-codec int8] [--json out]

1. brings up ``splitserve up``'s cluster (splitserve/launcher.py) as a user gets it (hybrid scheduling) with the
   Redis registry: ``--prefill`` prefill and ``--decode`` decode pods, the prefill pods sending ``--corrupt-chunks``
   of their KV chunks corrupted (refused by checksum, the router retries), KV in ``--kv-codec``, and the router
   checking ``--shadow-check-fraction`` of its answers through the other path (router/shadow.py);
2. sends bench serve's workload (measure/workload.py: random lengths, Poisson arrivals) through the
   router's gRPC API with bench serve's client for ``--duration`` seconds; ``--abort-share`` of the requests are
   abandoned by their client at a random moment within ``--abort-within`` seconds (expected failures,
   ``client_abort``);
3. every ``--fault-interval`` seconds injects the next fault of the cycle: SIGKILL redis-server, SIGKILL a decode
   pod (each in turn); the supervisor starts each again, and the next fault waits until the cluster is whole;
4. stops sending, lets the requests in flight finish, and reads every pod's KV blocks (PodStatus.GetLoad) until
   all are free or ``--drain-timeout`` seconds pass;
5. prints requests served, failures by kind (expected or not), p50/p99 TTFT, TPOT and E2E, the routes taken, the
   faults, the blocks still held and KV leases expired on each pod (a lease's expiry is a leak too), and the shadow
   checks, each divergence by output position and kind (from the router's log); ``--json PATH`` writes the same as
   JSON. Exit status 1 when a block or lease leaked, a request failed unexpectedly, or a shadow check diverged with
   a lossless codec (a lossy one's divergences are the codec's: listed).

A progress line goes to stderr every ``--progress-interval`` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random
import re
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc

from splitserve.bench.serve.client import GrpcGenerate
from splitserve.bench.serve.driver import scrape_router
from splitserve.bench.serve.prompts import PromptFactory
from splitserve.engine.config import DEFAULT_MODEL
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.launcher import Cluster
from splitserve.measure.figures import save_results
from splitserve.measure.serve_metrics import SLO, RequestRecord, parse_counter, parse_histograms, summarize
from splitserve.measure.workload import WorkloadConfig, build_workload
from splitserve.probes import serving
from splitserve.runtime.config import described, parse_config
from splitserve.runtime.roles import Role
from splitserve.runtime.transport import PLAINTEXT, TLSConfig, open_blocking_channel
from splitserve.up_config import UpConfig
from splitserve.v1 import common_pb2, pod_status_pb2, pod_status_pb2_grpc

CLIENT_ABORT = "client_abort"  # the failure kind of a request its client abandoned on purpose: expected
LOSSLESS_CODECS = ("none", "none+zstd")  # a shadow check of their KV must match exactly
DIVERGED = re.compile(  # router/shadow.py's warning of a divergence, in the router's log
    r"shadow check of request (\S+) diverged \((\w+)\) at output position (\d+) of (\d+)")
ROUTES = ("disaggregated", "prefill_on_decode", "split")
SHADOW_OUTCOMES = ("match", "diverged", "failed")
LOGPROB_DELTA = "splitserve_router_shadow_logprob_delta"  # each check's largest logprob difference (a histogram)


@dataclass
class SoakConfig:
    """Mixed load with injected faults against a local cluster; reports failures, latencies and leaked blocks."""

    duration: float = field(default=180.0, metadata=described("Seconds of load (faults are injected meanwhile)."))
    model: str = field(default=DEFAULT_MODEL, metadata=described(
        "Model every pod serves (tiny-random for a quick run)."))
    prefill: int = field(default=1, metadata=described("Number of prefill pods."))
    decode: int = field(default=2, metadata=described(
        "Number of decode pods (2 or more: a killed one's streams migrate)."))
    request_rate: float = field(default=2.0, metadata=described("Requests per second (Poisson arrivals)."))
    input_len: int = field(default=128, metadata=described(
        "Mean prompt length in tokens (each within half of it either way)."))
    output_len: int = field(default=32, metadata=described(
        "Mean output length in tokens (each within half of it either way)."))
    fault_interval: float = field(default=20.0, metadata=described(
        "Seconds between injected faults (SIGKILL redis-server, SIGKILL a decode pod, in turn)."))
    abort_share: float = field(default=0.05, metadata=described("Share of requests their client abandons."))
    abort_within: float = field(default=2.0, metadata=described(
        "An abandoning client leaves at a random moment this many seconds after sending, at most (shorter than a "
        "request takes: it leaves while queued, prefilling or decoding)."))
    corrupt_chunks: float = field(default=0.02, metadata=described(
        "Share of KV chunks the prefill pods send corrupted (0: none)."))
    request_timeout: float = field(default=300.0, metadata=described("The client's deadline of one request."))
    drain_timeout: float = field(default=120.0, metadata=described(
        "After the load: how long the requests in flight, then the pods' blocks, get to finish."))
    kv_cache_memory_bytes: int = field(default=256 << 20, metadata=described("KV block pool of each pod."))
    kv_codec: str = field(default="none", metadata=described("KV codec between the pods (none: lossless)."))
    shadow_check_fraction: float = field(default=1.0, metadata=described(
        "Share of answers the router checks through the other path (one at a time; 0: off)."))
    base_port: int = field(default=0, metadata=described(
        "The cluster takes consecutive ports from here (router, Prometheus, redis, pods, their metrics; 0: ports "
        "free now)."))
    run_dir: str = field(default="", metadata=described("Where the cluster's logs go (empty: a new temp dir)."))
    json: str = field(default="", metadata=described("Write the report as JSON to this file."))
    progress_interval: float = field(default=10.0, metadata=described("Seconds between progress lines."))
    seed: int = field(default=0, metadata=described("Seeds the workload, the aborts and the corrupted chunks."))

    def __post_init__(self) -> None:
        for name in ("duration", "request_rate", "fault_interval", "abort_within", "drain_timeout",
                     "request_timeout", "progress_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("corrupt_chunks", "abort_share", "shadow_check_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.decode < 1 or self.prefill < 0:
            raise ValueError("need at least one decode pod, and no negative counts")

    def up_config(self) -> UpConfig:
        return UpConfig.on_ports(self.base_port or None, model=self.model, prefill=self.prefill, decode=self.decode,
                                 registry="redis", inject_corrupt_chunks=self.corrupt_chunks, kv_codec=self.kv_codec,
                                 shadow_check_fraction=self.shadow_check_fraction,
                                 kv_cache_memory_bytes=self.kv_cache_memory_bytes, prometheus=False,
                                 run_dir=self.run_dir)


# ---- faults ---------------------------------------------------------------------------------------------------------

class FaultInjector:
    """A thread that kills the next process of the cycle every ``interval_s`` and waits until it is back."""

    def __init__(self, cluster: Cluster, interval_s: float, log):
        self.cluster, self.interval_s, self.log = cluster, interval_s, log
        decode = [pod.name for pod in cluster.pods if pod.role is Role.DECODE]
        self.cycle = [name for pod in decode for name in ("redis", pod)]
        self.events: list[dict] = []
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        turn = 0
        while not self._stop.wait(self.interval_s):
            name = self.cycle[turn % len(self.cycle)]
            turn += 1
            pid, restarts = self.cluster.pid(name), self.cluster.restarts[name]
            if pid is None:
                continue
            os.kill(pid, signal.SIGKILL)
            event = {"at_s": round(time.monotonic() - self._started, 1), "fault": f"SIGKILL {name}"}
            self.events.append(event)
            self.log(f"[soak] fault at {event['at_s']:.0f} s: SIGKILL {name} (pid {pid})")
            back = self._wait_back(name, restarts)
            event["back_after_s"] = round(back, 1) if back is not None else None

    def _wait_back(self, name: str, restarts: int) -> float | None:
        """Seconds until ``name`` runs again (a pod: and serves); None if the soak ended first."""
        killed_at = time.monotonic()
        pod = next((p for p in self.cluster.pods if p.name == name), None)
        while not self._stop.wait(0.25):
            if self.cluster.restarts[name] > restarts and self.cluster.pid(name) is not None and (
                    pod is None or serving(self.cluster.address(pod), self.cluster.config.tls)):
                return time.monotonic() - killed_at
        return None

    def counts(self) -> dict[str, int]:
        return dict(Counter("redis_restarted" if event["fault"].endswith("redis") else "decode_pod_killed"
                            for event in self.events))


# ---- load -----------------------------------------------------------------------------------------------------------

async def _send(client: GrpcGenerate, record: RequestRecord, payload, clock, abort_after_s: float | None) -> None:
    """One request; with ``abort_after_s``, its client goes away then if it has not finished."""
    task = asyncio.ensure_future(client.send(record, payload, clock))
    done, _ = await asyncio.wait({task}, timeout=abort_after_s)
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        record.status, record.error, record.end_s = "failed", CLIENT_ABORT, clock()


async def _drive(config: SoakConfig, cluster: Cluster, prompts: PromptFactory, faults: FaultInjector,
                 log) -> tuple[list[RequestRecord], float]:
    """Sends the workload for ``config.duration`` seconds, then waits for the requests in flight; returns every
    request's record and the seconds from the first send to the last answer."""
    address = f"{cluster.config.host}:{cluster.config.grpc_port}"
    client = GrpcGenerate(address, timeout_s=config.request_timeout)
    workload = WorkloadConfig(num_prompts=math.ceil(config.request_rate * config.duration * 1.5) + 10,
                              request_rate=config.request_rate, input_len=config.input_len,
                              output_len=config.output_len, range_ratio=0.5, seed=config.seed)
    aborts = random.Random(f"{config.seed}-aborts")
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start
    progress = asyncio.create_task(_progress(config, records, faults, clock, log))
    try:
        for spec in build_workload(workload):
            delay = spec.arrival_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if clock() >= config.duration:
                break
            record = RequestRecord(spec.index, spec.prompt_len, spec.output_len, spec.arrival_s)
            records.append(record)
            abort_after = aborts.uniform(0.0, config.abort_within) if aborts.random() < config.abort_share else None
            payload = client.prepare(spec, prompts.token_ids(spec))
            tasks.append(asyncio.create_task(_send(client, record, payload, clock, abort_after)))
        log(f"[soak] load done after {clock():.0f} s; waiting for {sum(not t.done() for t in tasks)} requests in "
            "flight")
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), config.drain_timeout + config.request_timeout)
        except TimeoutError:  # they are cancelled, "unfinished": unexpected failures in the report
            log(f"[soak] {sum(not t.done() for t in tasks)} requests still unanswered; giving up on them")
    finally:
        progress.cancel()
        await client.close()
    return records, clock()


async def _progress(config: SoakConfig, records: list[RequestRecord], faults: FaultInjector, clock, log) -> None:
    while True:
        await asyncio.sleep(config.progress_interval)
        failed = _failures(records)
        log(f"[soak {clock():5.0f}/{config.duration:.0f} s] sent {len(records)}, served "
            f"{sum(r.status == 'ok' for r in records)}, failed {sum(failed.values())} "
            f"({_kinds(failed)}), in flight "
            f"{sum(r.status == 'sent' for r in records)}, faults {len(faults.events)}")


def _failures(records: list[RequestRecord]) -> dict[str, int]:
    return dict(Counter(record.error for record in records if record.status == "failed"))


# ---- blocks ---------------------------------------------------------------------------------------------------------

def pod_load(address: str, tls: TLSConfig = PLAINTEXT) -> common_pb2.PodLoad:
    """The pod's load report now (``PodStatus.GetLoad``)."""
    with open_blocking_channel(address, tls) as channel:
        return pod_status_pb2_grpc.PodStatusStub(channel).GetLoad(pod_status_pb2.LoadRequest(), timeout=10)


def blocks_in_use(address: str, tls: TLSConfig = PLAINTEXT) -> int | None:
    """KV blocks in use on the pod at ``address``, plus the requests still in its engine (None: it does not
    answer). 0 is a pod with nothing left of any request."""
    try:
        load = pod_load(address, tls)
    except grpc.RpcError:
        return None
    return load.total_kv_blocks - load.free_kv_blocks + load.num_running + load.num_waiting


def _wait_whole(cluster: Cluster, timeout_s: float) -> None:
    """Until every pod serves (one killed last may still be loading), or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(serving(cluster.address(pod), cluster.config.tls)
                                                  for pod in cluster.pods):
        time.sleep(0.5)


def leaked_blocks(cluster: Cluster, timeout_s: float) -> dict[str, int | None]:
    """Each pod's ``blocks_in_use`` once all are 0, or when ``timeout_s`` passed (an unclaimed KV lease frees
    itself after the router's kv_lease_s: the timeout should be longer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {pod.name: blocks_in_use(cluster.address(pod), cluster.config.tls) for pod in cluster.pods}
        if all(n == 0 for n in held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def leases_expired(cluster: Cluster) -> dict[str, int | None]:
    """Each pod's ``splitserve_kv_leases_expired_total`` since it last started (None: no answer)."""

    def count(pod) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{cluster.config.host}:{pod.metrics_port}/metrics", timeout=5) as reply:
                return int(parse_counter(reply.read().decode(), "splitserve_kv_leases_expired_total", {}) or 0)
        except OSError:
            return None
    return {pod.name: count(pod) for pod in cluster.pods}


def shadow_divergences(router_log: str) -> list[dict]:
    """The router's shadow checks that diverged, from its log: request, kind (token or logprob), output position."""
    return [{"request_id": m[1], "kind": m[2], "position": int(m[3]), "of": int(m[4])}
            for m in DIVERGED.finditer(router_log)]


# ---- the run --------------------------------------------------------------------------------------------------------

def run_soak(config: SoakConfig, log=print) -> dict:
    """Brings up the cluster, runs the soak (module docstring), stops the cluster; returns the report."""
    cluster = Cluster(config.up_config())
    log(f"[soak] starting {config.prefill} prefill + {config.decode} decode pods of {config.model} with redis "
        f"(logs: {cluster.run_dir})")
    try:
        cluster.start()
        cluster.wait_ready(log=log)
        router_before = scrape_router(cluster.http_url)
        faults = FaultInjector(cluster, config.fault_interval, log)
        faults.start()
        try:
            prompts = PromptFactory(load_tokenizer(config.model), config.seed)
            records, duration = asyncio.run(_drive(config, cluster, prompts, faults, log))
        finally:
            faults.stop()
        log("[soak] waiting for every pod to serve and hold no block ...")
        _wait_whole(cluster, config.drain_timeout)
        leaked = {"blocks": leaked_blocks(cluster, config.drain_timeout), "leases": leases_expired(cluster)}
        router_after = scrape_router(cluster.http_url)
        restarts = dict(cluster.restarts)
    finally:
        cluster.stop()
    divergences = shadow_divergences((cluster.run_dir / "router.log").read_text(errors="replace"))
    return _report(config, records, duration, faults, leaked, restarts, (router_before, router_after), divergences)


def _report(config: SoakConfig, records: list[RequestRecord], duration: float, faults: FaultInjector,
            leaked: dict[str, dict[str, int | None]], restarts: dict[str, int], router: tuple[str, str],
            divergences: list[dict]) -> dict:
    before, after = router  # the router's /metrics before and after the load
    summary = summarize(records, duration, SLO())
    failures = _failures(records)
    expected = {kind: n for kind, n in failures.items() if kind == CLIENT_ABORT}
    unexpected = {kind: n for kind, n in failures.items() if kind != CLIENT_ABORT}
    unfinished = sum(r.status not in ("ok", "failed") for r in records)
    if unfinished:
        unexpected["unfinished"] = unfinished

    def router_count(name: str, labels: dict[str, str]) -> int:
        return int((parse_counter(after, name, labels) or 0) - (parse_counter(before, name, labels) or 0))

    labels = {"role": "router", "model_name": config.model}
    latency = {name: {q: summary[name][q] for q in ("p50", "p99")} if summary[name] else None
               for name in ("ttft", "tpot", "e2e")}
    shadow = {outcome: router_count("splitserve_router_shadow_checks_total", {"outcome": outcome})
              for outcome in SHADOW_OUTCOMES}
    lossless = config.kv_codec in LOSSLESS_CODECS
    delta = parse_histograms(after, [LOGPROB_DELTA], {}).get(LOGPROB_DELTA)  # the cluster's own: none before
    shadow["max_logprob_delta_at_most"] = (next(le for le, n in delta.buckets if n == delta.count)
                                           if delta and delta.count else None)
    passed = (not unexpected and all(n == 0 for kind in leaked.values() for n in kind.values())
              and not (lossless and shadow["diverged"]))
    return {
        "config": dataclasses.asdict(config),
        "duration_s": duration,
        "requests": {"sent": len(records), "served": summary["successful"], "failed": sum(failures.values()),
                     "failed_expected": expected, "failed_unexpected": unexpected},
        "latency_s": latency,
        "faults": {**faults.counts(), "client_aborts": expected.get(CLIENT_ABORT, 0),
                   "corrupt_chunk_retries": router_count("splitserve_router_retries_total",
                                                         {**labels, "code": "DATA_LOSS"}),
                   "migrations": router_count("splitserve_router_migrations_total", labels),
                   "events": faults.events},
        "routes": {r: router_count("splitserve_router_routing_decisions_total", {"decision": r}) for r in ROUTES},
        "restarts": restarts,
        "leaked_blocks": leaked["blocks"],
        "leases_expired": leaked["leases"],
        "shadow_checks": {**shadow, "lossless": lossless, "divergences": divergences},
        "passed": passed,
    }


def print_report(report: dict, log=print) -> None:
    requests, faults = report["requests"], report["faults"]
    log(f"\nsoak: {report['duration_s']:.0f} s of {report['config']['model']}, {report['config']['request_rate']:g} "
        f"req/s")
    log(f"  requests   sent {requests['sent']}, served {requests['served']}, failed {requests['failed']}")
    log(f"  expected   {_kinds(requests['failed_expected'])}")
    log(f"  unexpected {_kinds(requests['failed_unexpected'])}")
    for name, figures in report["latency_s"].items():
        if figures:
            log(f"  {name:<10} p50 {figures['p50'] * 1e3:8.1f} ms   p99 {figures['p99'] * 1e3:8.1f} ms")
    log(f"  faults     decode pods killed {faults.get('decode_pod_killed', 0)}, redis restarted "
        f"{faults.get('redis_restarted', 0)}, client aborts {faults['client_aborts']}, corrupt-chunk retries "
        f"{faults['corrupt_chunk_retries']}, migrations {faults['migrations']}")
    log(f"  routes     {_kinds(report['routes'])}; restarts {_kinds(report['restarts'])}")
    log(f"  leaked     {_kinds(report['leaked_blocks'])} blocks; leases expired {_kinds(report['leases_expired'])}")
    shadow = report["shadow_checks"]
    log(f"  shadow     {_kinds({o: shadow[o] for o in SHADOW_OUTCOMES})} ({report['config']['kv_codec']}: "
        f"{'lossless' if shadow['lossless'] else 'lossy'}), largest logprob difference <= "
        f"{shadow['max_logprob_delta_at_most']}")
    for d in shadow["divergences"]:
        log(f"    diverged at output position {d['position']:>4} of {d['of']} ({d['kind']}): {d['request_id']}")
    log("  PASSED" if report["passed"] else "  FAILED: unexpected failures, leaks, or lossless shadow divergences")


def _kinds(counts: dict) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items())) or "none"


def main(argv: list[str] | None = None) -> None:
    config = parse_config(SoakConfig, argv, prog="splitserve bench soak")
    log = lambda line: print(line, file=sys.stderr, flush=True)
    report = run_soak(config, log)
    print_report(report)
    save_results(report, config.json)
    sys.exit(0 if report["passed"] else 1)
