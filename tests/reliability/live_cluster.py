"""What the reliability tests share about a real ``splitserve up`` cluster on loopback (tiny random model): its
config, waiting against deadlines, greedy requests through the router's gRPC API, the pods' KV blocks, the router's
view and counters, and a background load of requests whose answers are checked against the offline engine.

Every wait polls against a deadline: a busy 2-core machine makes things slow, not wrong.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import grpc

from splitserve.bench.serve.driver import scrape_router
from splitserve.bench.soak import blocks_in_use, pod_load
from splitserve.launcher import Cluster
from splitserve.measure.serve_metrics import parse_counter
from splitserve.probes import serving
from splitserve.router.config import RouterConfig
from splitserve.up_config import UpConfig
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

START_S = 240  # a pod's start on a busy 2-core machine: tens of seconds; a hang is minutes
KV_LEASE_S = RouterConfig.kv_lease_s  # how long a decode pod keeps KV no Decode call claimed (the router's default)
LEASE_MARGIN_S = 3.0  # a lease starts when its KV is in, a little after the request's start
METRICS_ANSWER_S = 30.0  # how long a pod's /metrics may take to answer a leak check (a restart: seconds)
MODEL = "tiny-random"


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.1)


# What the tests' clusters run: the tiny model, a small KV pool, no Prometheus (conftest's ``start_cluster(run_dir,
# **TINY, ...)`` picks the ports).
# The disaggregated path: the faults these tests inject are on it (a KV push, a stream to migrate).
# float32 prefill, as the offline engine's here (``offline_answers``): the default may pick bf16 where the CPU has it.
TINY = {"model": MODEL, "prometheus": False, "kv_cache_memory_bytes": 16 << 20, "ready_timeout_s": START_S,
        "scheduling": "disaggregated", "prefill_compute_dtype": "float32"}


def up_config(tmp_path: Path, base: int | None, **fields) -> UpConfig:
    """A cluster on consecutive ports from ``base`` (None: free ones), tiny random model, no Prometheus unless
    asked."""
    return UpConfig.on_ports(base, **{"run_dir": str(tmp_path), **TINY, **fields})


# ---- the router's view ----------------------------------------------------------------------------------------------

def openai_client_of(cluster: Cluster):
    """The ``openai`` client of ``cluster``'s router (the ``openai_client`` fixture's)."""
    from openai import OpenAI

    return OpenAI(base_url=f"http://{cluster.config.host}:{cluster.config.http_port}/v1", api_key="unused",
                  max_retries=0, timeout=120)


def router_json(cluster: Cluster, path: str) -> dict:
    with urllib.request.urlopen(f"{cluster.http_url}{path}", timeout=5) as reply:
        return json.load(reply)


def routed_to(cluster: Cluster) -> set[str]:
    """Addresses of the pods the router would route to now."""
    return {pod["address"] for pod in router_json(cluster, "/pods")["pods"] if pod["healthy"]}


def router_counter(cluster: Cluster, name: str, **labels: str) -> float:
    """The sum of a counter's series with ``labels`` on the router's /metrics (0 before its first increment)."""
    return parse_counter(scrape_router(cluster.http_url), name, labels) or 0.0


ROUTES = ("disaggregated", "prefill_on_decode", "split")  # the router's routing decisions


def route_counts(cluster: Cluster) -> dict[str, float]:
    """Counters to take differences of, to tell the routes requests took: the router's routing decisions (by
    ``ROUTES``), its retries (a retried request's failed attempt is a decision too) and the KV pushes the decode
    pods took in (``splitserve_kv_load_total{outcome="loaded"}``: a disaggregated prompt's, or a split's prefix)."""
    decode_pods = [pod for pod in cluster.pods if pod.role == "decode"]
    return {**{d: router_counter(cluster, "splitserve_router_routing_decisions_total", decision=d) for d in ROUTES},
            "retries": router_counter(cluster, "splitserve_router_retries_total"),
            "kv_loaded": sum(pod_counter(cluster, pod, "splitserve_kv_load_total", outcome="loaded")
                             for pod in decode_pods)}


def wait_back(cluster: Cluster, name: str, restarts: int) -> None:
    """``name`` started again (its ``restarts``-th restart), SERVING on its port, and routed to."""
    pod = next(p for p in cluster.pods if p.name == name)
    wait_until(lambda: cluster.restarts[name] >= restarts and serving(cluster.address(pod)), START_S,
               f"{name} to serve again")
    wait_until(lambda: cluster.address(pod) in routed_to(cluster), 60, f"the router to route to {name} again")


# ---- the pods' KV blocks --------------------------------------------------------------------------------------------

def pod_metrics(cluster: Cluster, pod, answer_within_s: float = METRICS_ANSWER_S) -> str:
    """The pod's ``/metrics`` text, asked again until it answers within ``answer_within_s`` (a pod restarting, a busy
    one); a pod that does not answer by then fails the check that reads it (AssertionError naming it): a count that
    cannot be read is not a count of 0."""
    url = f"http://{cluster.config.host}:{pod.metrics_port}/metrics"
    deadline = time.monotonic() + answer_within_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=max(0.5, min(5.0, deadline - time.monotonic()))) as reply:
                return reply.read().decode()
        except OSError as error:
            assert time.monotonic() < deadline, (f"{pod.name}'s /metrics ({url}) did not answer within "
                                                 f"{answer_within_s:g} s: {error}")
            time.sleep(0.2)


def pod_counter(cluster: Cluster, pod, name: str, **labels: str) -> float:
    """The sum of a counter's series with ``labels`` on a pod's /metrics (0 before its first increment)."""
    return parse_counter(pod_metrics(cluster, pod), name, labels) or 0.0


def leases_expired(cluster: Cluster, answer_within_s: float = METRICS_ANSWER_S) -> dict[str, tuple[int, float]]:
    """{pod name: (its restarts, its ``splitserve_kv_leases_expired_total``)}: pushed KV a pod released at its lease's
    expiry, since that pod last started. Every pod must answer (``pod_metrics``)."""
    return {pod.name: (cluster.restarts[pod.name], parse_counter(pod_metrics(cluster, pod, answer_within_s),
                                                                 "splitserve_kv_leases_expired_total", {}) or 0.0)
            for pod in cluster.pods}


def expired_since(cluster: Cluster, since: dict[str, tuple[int, float]] | None) -> dict[str, float]:
    """The pods whose KV leases expired since ``since`` (``leases_expired``; None: since the pods started), and how
    many: a pod restarted since counts every expiry of its new life."""
    increase = {}
    for name, (restarts, count) in leases_expired(cluster).items():
        then_restarts, then = (since or {}).get(name, (restarts, 0.0))
        increase[name] = count - (then if then_restarts == restarts else 0.0)
    return {name: n for name, n in increase.items() if n}


def wait_every_block_free(cluster: Cluster, timeout_s: float = 60,
                          since: dict[str, tuple[int, float]] | None = None) -> None:
    """Every pod of ``cluster`` holds no KV block and runs no request, and no KV lease expired since ``since``
    (``leases_expired``; None: since the pods started). Blocks a lease held come free at its expiry, within the
    default deadline (longer than ``KV_LEASE_S``): the expiry counter is what tells a leaked lease from a dropped
    one. A test of a drop may also pass a deadline that ends before the lease would (``free_before_the_lease``)."""
    addresses = [cluster.address(pod) for pod in cluster.pods]
    wait_until(lambda: all(blocks_in_use(a) == 0 for a in addresses), timeout_s,
               f"every block free on every pod, now {({a: blocks_in_use(a) for a in addresses})}")
    expired = expired_since(cluster, since)
    assert not expired, (f"KV leases expired (pushed KV neither claimed nor dropped, freed only by its lease): "
                         f"{expired}")


def free_before_the_lease(cluster: Cluster, leases_from: float,
                          since: dict[str, tuple[int, float]] | None = None) -> None:
    """Every block free on every pod before a lease opened at ``leases_from`` (``time.monotonic()``) or later
    could expire: so a KV left on a decode pod by a request that ended early must have been dropped, not leased
    out."""
    deadline = leases_from + KV_LEASE_S - LEASE_MARGIN_S
    left = deadline - time.monotonic()
    assert left >= 5, (f"only {left:.1f} s left before a lease from the start could expire: "
                       "the check cannot tell a drop from an expired lease")
    wait_every_block_free(cluster, timeout_s=left, since=since)


def running_on(cluster: Cluster, role: str = "decode") -> dict[str, int]:
    """{name: requests running} of the pods of ``role`` with a request in their engine now."""
    running = {pod.name: pod_load(cluster.address(pod)).num_running for pod in cluster.pods if pod.role == role}
    return {name: count for name, count in running.items() if count}


# ---- requests -------------------------------------------------------------------------------------------------------

def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Token-id prompts of the tiny model (byte tokens; its first ids are ChatML control tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(32, 250) for _ in range(length)] for _ in range(count)]


def offline_answers(prompt_list: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The greedy answers of the offline engine: what every topology must give (docs/RELIABILITY.md)."""
    from splitserve.engine import LLM, SamplingParams

    engine = LLM(model=MODEL, num_blocks=512, prefill_compute_dtype="float32")
    outputs = engine.generate(prompt_list, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [list(output.token_ids) for output in outputs]


def greedy_request(prompt: list[int], max_tokens: int) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(sampling_params=common_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))
    request.token_ids.ids.extend(prompt)
    return request


@dataclass
class Answer:
    """One request's stream as the client saw it."""

    token_ids: list[int] = field(default_factory=list)
    finish: str = ""  # the Complete's finish reason name, "error" for an Error message, or the gRPC status's name
    error: str = ""


def stream(cluster: Cluster, prompt: list[int], max_tokens: int, timeout_s: float = 120,
           after_first_chunk=None) -> Answer:
    """A greedy request through the router's gRPC API; ``after_first_chunk()`` runs once the first tokens came."""
    answer = Answer()
    with grpc.insecure_channel(f"{cluster.config.host}:{cluster.config.grpc_port}") as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(greedy_request(prompt, max_tokens),
                                                                  timeout=timeout_s)
        try:
            for reply in call:
                kind = reply.WhichOneof("response")
                if kind == "chunk":
                    answer.token_ids += reply.chunk.token_ids
                    if after_first_chunk is not None and answer.token_ids:
                        after_first_chunk, run = None, after_first_chunk
                        run()
                elif kind == "complete":
                    answer.finish = common_pb2.FinishReason.Name(reply.complete.finish_reason)
                elif kind == "error":  # a failure after output started; the stream ends here
                    answer.finish, answer.error = "error", reply.error.message
        except grpc.RpcError as error:
            answer.finish, answer.error = error.code().name, error.details() or ""
    return answer


class BackgroundLoad:
    """``workers`` threads sending greedy requests from a fixed set of prompts until stopped; each answer is
    compared with the offline engine's. The load the issue asks faults to be injected under."""

    def __init__(self, cluster: Cluster, prompt_list: list[list[int]], answers: list[list[int]], max_tokens: int,
                 workers: int = 3):
        self.cluster, self.prompts, self.answers, self.max_tokens = cluster, prompt_list, answers, max_tokens
        self.results: list[tuple[int, Answer]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(workers)]

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stops the workers after their current requests (none, if never started)."""
        self._stop.set()
        for thread in self._threads:
            if thread.ident is not None:
                thread.join(timeout=180)
        assert not any(thread.is_alive() for thread in self._threads), "a background request hung"

    def _loop(self, worker: int) -> None:
        i = worker
        while not self._stop.is_set():
            index = i % len(self.prompts)
            self.results.append((index, stream(self.cluster, self.prompts[index], self.max_tokens)))
            i += len(self._threads)

    def wait_for(self, count: int, timeout_s: float = 120) -> None:
        wait_until(lambda: len(self.results) >= count, timeout_s, f"{count} background requests")

    def failures(self) -> list[str]:
        """Every request that did not end with exactly the offline engine's tokens."""
        return [f"prompt {index}: {answer.finish} {answer.error} ({len(answer.token_ids)} tokens)"
                for index, answer in self.results
                if answer.finish != "FINISH_REASON_LENGTH" or answer.token_ids != self.answers[index]]
