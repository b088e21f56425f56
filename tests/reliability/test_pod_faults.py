"""Pods, Redis and the router failing under a real cluster (1 prefill + 3 decode pods, the Redis registry, tiny
random model), with a background load of greedy requests whose answers are checked against the offline engine:

- a decode pod killed (SIGKILL) mid-stream: its streams migrate, every token arrives once, the answer is the
  undisturbed one; idle, and under load; and when the pod the stream migrates to is killed too, before its first
  token, the stream moves on to the third decode pod (never back to the first);
- a decode pod stopped (SIGTERM): the router stops routing to it at once, its running stream drains (not migrated);
- the prefill pod killed under load: no request is lost (retried; the decode pod prefills);
- clients that disconnect or abort at every stage: every block free on every pod afterwards;
- Redis unreachable, or restarted empty: the router keeps serving with the pods it knew; a restarted router finds
  them in Redis.

Each process killed (or exiting after a SIGTERM) is started again by ``splitserve up``'s supervisor on its port, the
others untouched: the launcher's side of these faults. Each test leaves the cluster as it found it (the supervisor
restarts what was killed, and the test waits for it), so none depends on another. Every block is free on every pod after
each test.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import redis
from live_cluster import (
    START_S,
    TINY,
    BackgroundLoad,
    free_before_the_lease,
    greedy_request,
    leases_expired,
    offline_answers,
    prompts,
    routed_to,
    router_counter,
    router_json,
    running_on,
    stream,
    wait_back,
    wait_every_block_free,
    wait_until,
)

from splitserve.runtime.discovery import pod_key
from splitserve.v1 import common_pb2, generate_pb2_grpc

pytestmark = pytest.mark.e2e

LONG = 300  # output tokens of a stream to disturb: it runs for a second or more
LONGER = 1500  # output tokens of the stream disturbed under load: it runs for seconds
SHORT = 8  # output tokens of the background load's requests
LOAD_PROMPTS = prompts(6, 48, seed=1)  # longer than the conditional-prefill threshold: they go through the P pod
STREAM_PROMPT = prompts(1, 40, seed=2)[0]


# The registry's TTLs (a pod's key, the router's grace after a Redis restart), shorter than their 10 s defaults so
# that the Redis faults below, which must outlast them, take seconds less; a heartbeat still comes every second.
POD_TTL_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster):
    running = start_cluster(tmp_path_factory.mktemp("pod-faults"), **TINY, prefill=1, decode=3, registry="redis",
                            heartbeat_ttl_s=POD_TTL_S, pod_ttl_s=POD_TTL_S)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def answers():
    """The offline engine's greedy answers: the background load's, and the disturbed stream's (``LONG`` and
    ``LONGER`` tokens: greedy, the first is the second's beginning)."""
    longer = offline_answers([STREAM_PROMPT], LONGER)[0]
    return offline_answers(LOAD_PROMPTS, SHORT), longer[:LONG], longer


@pytest.fixture(autouse=True)
def every_block_free_afterwards(cluster):
    before = leases_expired(cluster)
    yield
    wait_every_block_free(cluster, since=before)


def the_decode_pod_running_it(cluster) -> str:
    """On an idle cluster, the decode pod of the one stream (its first token came from P: D's engine may take it a
    moment later)."""
    found: list[str] = []
    wait_until(lambda: found.extend(running_on(cluster)) or found, 30, "the stream on a decode pod")
    [name] = found
    return name


def load(cluster, answers) -> BackgroundLoad:
    return BackgroundLoad(cluster, LOAD_PROMPTS, answers[0], SHORT)


def pids(cluster) -> dict[str, int]:
    return {name: cluster.pid(name) for name in ("prefill-0", "decode-0", "decode-1", "router", "redis")}


def test_a_decode_pod_killed_mid_stream_hands_the_stream_over_and_every_token_arrives_once(cluster, answers):
    migrations = router_counter(cluster, "splitserve_router_migrations_total")
    before = pids(cluster)
    killed: list[str] = []

    def kill_its_decode_pod() -> None:
        name = the_decode_pod_running_it(cluster)
        killed.append(name)
        os.kill(cluster.pid(name), signal.SIGKILL)

    restarts = dict(cluster.restarts)
    answer = stream(cluster, STREAM_PROMPT, LONG, after_first_chunk=kill_its_decode_pod)
    assert (answer.finish, answer.error) == ("FINISH_REASON_LENGTH", "")
    assert answer.token_ids == answers[1]  # no token lost or repeated, the same greedy answer
    assert router_counter(cluster, "splitserve_router_migrations_total") == migrations + 1
    wait_back(cluster, killed[0], restarts[killed[0]] + 1)  # started again on its port, and routed to
    after = pids(cluster)
    assert after.pop(killed[0]) != before.pop(killed[0])
    assert after == before  # nothing else was stopped or restarted


def router_holds_it_on(cluster, names: list[str]) -> str | None:
    """Which of the pods ``names`` the router counts a request of its own on now (``GET /pods``)."""
    held = {pod["address"] for pod in router_json(cluster, "/pods")["pods"] if pod["router_requests"]}
    return next((name for name in names if cluster.address(pod_named(cluster, name)) in held), None)


def pod_named(cluster, name: str):
    return next(pod for pod in cluster.pods if pod.name == name)


def test_a_migration_target_killed_before_its_first_token_hands_the_stream_to_the_third_decode_pod(cluster, answers):
    """The stream's decode pod is killed; the two others are frozen (SIGSTOP), so that the migration's Decode call
    waits on the one the router chose, which is killed in turn; the third, thawed, must take the stream over."""
    migrations = router_counter(cluster, "splitserve_router_migrations_total")
    restarts = dict(cluster.restarts)
    decode_pods = [pod.name for pod in cluster.pods if pod.role == "decode"]
    killed: list[str] = []

    def kill_its_decode_pod_then_the_migration_target() -> None:
        first = the_decode_pod_running_it(cluster)
        others = [name for name in decode_pods if name != first]
        for name in others:
            os.kill(cluster.pid(name), signal.SIGSTOP)
        try:
            os.kill(cluster.pid(first), signal.SIGKILL)
            killed.append(first)
            target: list[str] = []
            wait_until(lambda: target.append(router_holds_it_on(cluster, others)) or target[-1], 10,
                       "the router to migrate the stream to a frozen decode pod")
        finally:
            for name in others:
                if not target or name != target[-1]:
                    os.kill(cluster.pid(name), signal.SIGCONT)
        os.kill(cluster.pid(target[-1]), signal.SIGKILL)  # frozen: it never sent its first token
        killed.append(target[-1])

    answer = stream(cluster, STREAM_PROMPT, LONG, after_first_chunk=kill_its_decode_pod_then_the_migration_target)
    assert (answer.finish, answer.error) == ("FINISH_REASON_LENGTH", "")
    assert answer.token_ids == answers[1]  # no token lost or repeated, the same greedy answer
    assert router_counter(cluster, "splitserve_router_migrations_total") == migrations + 2
    for name in killed:
        wait_back(cluster, name, restarts[name] + 1)


def test_under_load_a_killed_decode_pods_streams_all_migrate_with_their_exact_answers(cluster, answers):
    """The stream's decode pod is found while it is alone on the cluster (under load, which pod runs which request
    cannot be told from the pods' counts); then the load starts, and the pod is killed under it. The stream is
    long enough (``LONGER`` tokens, seconds) to be still running there when the load's first answers are in."""
    migrations = router_counter(cluster, "splitserve_router_migrations_total")
    restarts = dict(cluster.restarts)
    killed: list[str] = []
    background = load(cluster, answers)

    def kill_its_decode_pod_under_load() -> None:
        killed.append(the_decode_pod_running_it(cluster))
        background.start()
        background.wait_for(3)
        os.kill(cluster.pid(killed[0]), signal.SIGKILL)

    try:
        answer = stream(cluster, STREAM_PROMPT, LONGER, after_first_chunk=kill_its_decode_pod_under_load)
        background.wait_for(len(background.results) + 6)
    finally:
        background.stop()
    assert answer.token_ids == answers[2] and answer.finish == "FINISH_REASON_LENGTH", answer
    assert background.failures() == []
    assert router_counter(cluster, "splitserve_router_migrations_total") >= migrations + 1
    wait_back(cluster, killed[0], restarts[killed[0]] + 1)


def test_a_decode_pod_stopped_with_sigterm_leaves_the_routing_at_once_and_drains_its_stream(cluster, answers):
    migrations = router_counter(cluster, "splitserve_router_migrations_total")
    restarts = dict(cluster.restarts)
    stopped: dict[str, object] = {}

    def stop_its_decode_pod() -> None:
        name = the_decode_pod_running_it(cluster)
        address = cluster.address(next(p for p in cluster.pods if p.name == name))
        stopped.update(name=name, pid=cluster.pid(name))
        os.kill(stopped["pid"], signal.SIGTERM)
        started_at = time.monotonic()
        wait_until(lambda: address not in routed_to(cluster), 5, f"the router to stop routing to {name}")
        stopped["left_routing_s"] = time.monotonic() - started_at

    answer = stream(cluster, STREAM_PROMPT, LONG, after_first_chunk=stop_its_decode_pod)
    assert answer.token_ids == answers[1] and answer.finish == "FINISH_REASON_LENGTH", answer
    # Drained where it ran, not moved: the stream outlived the SIGTERM on its own pod.
    assert router_counter(cluster, "splitserve_router_migrations_total") == migrations
    with load(cluster, answers) as background:  # new requests meanwhile go to the other decode pod
        background.wait_for(6)
    assert background.failures() == []
    wait_until(lambda: any(e.pid == stopped["pid"] for e in cluster.supervisor.exits), 60, "the pod to exit")
    [ended] = [e for e in cluster.supervisor.exits if e.pid == stopped["pid"]]
    assert ended.returncode == 0, ended.describe()  # a clean exit after the drain, restarted all the same
    assert "decode pod shutting down" in ended.log_tail and "decode pod stopped" in ended.log_tail
    print(f"the router stopped routing to {stopped['name']} {stopped['left_routing_s']:.2f} s after its SIGTERM")
    wait_back(cluster, stopped["name"], restarts[stopped["name"]] + 1)


def test_the_prefill_pod_killed_under_load_loses_no_request(cluster, answers):
    restarts = cluster.restarts["prefill-0"]
    with load(cluster, answers) as background:
        background.wait_for(4)
        os.kill(cluster.pid("prefill-0"), signal.SIGKILL)
        done = len(background.results)
        background.wait_for(done + 9)  # while prefill-0 is gone: the decode pods prefill
    assert background.failures() == []
    wait_back(cluster, "prefill-0", restarts + 1)
    assert stream(cluster, LOAD_PROMPTS[0], SHORT).token_ids == answers[0][0]


async def _disconnect(address: str, prompt: list[int], how: str, delay_s: float, request_id: str) -> bool:
    """Sends a request and goes away ``delay_s`` after sending (or after its first tokens, delay_s < 0): closing
    the stream (``cancel``) or calling Abort. Returns whether tokens had arrived by then."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = greedy_request(prompt, 64)
        request.request_id = request_id
        call = stub.Generate(request, timeout=120)
        got_tokens = False
        if delay_s >= 0:
            await asyncio.sleep(delay_s)
        else:
            async for reply in call:
                if reply.WhichOneof("response") == "chunk" and reply.chunk.token_ids:
                    got_tokens = True
                    break
        if how == "abort":
            await stub.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=30)
            async for reply in call:  # the stream ends with the abort, promptly
                pass
        else:
            call.cancel()
        return got_tokens


@pytest.mark.parametrize("how", ["cancel", "abort"])
def test_clients_going_away_at_every_stage_leave_every_block_free(cluster, answers, how):
    """A burst of long prompts (256 tokens), each client leaving at another moment: while it queues behind the others,
    while it prefills or its KV travels, and while it decodes. Every block on every pod is free before a lease taken in
    the burst could expire (the router dropped the KV a client left behind; a lease is only the last resort), and the
    cluster still answers exactly."""
    address = f"{cluster.config.host}:{cluster.config.grpc_port}"
    burst = prompts(10, 256, seed=3)
    delays = [0.0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.4, -1, -1, -1]  # -1: after the first tokens

    async def all_of_them() -> list[bool]:
        return await asyncio.wait_for(asyncio.gather(*(
            _disconnect(address, prompt, how, delay, f"{how}-{i}") for i, (prompt, delay) in
            enumerate(zip(burst, delays)))), 180)

    burst_started = time.monotonic()
    got_tokens = asyncio.run(all_of_them())
    assert got_tokens[-3:] == [True, True, True]
    free_before_the_lease(cluster, burst_started)
    assert stream(cluster, LOAD_PROMPTS[1], SHORT).token_ids == answers[0][1]


# A Redis fault must outlast what could make the router forget a pod: a pod's key expiring (POD_TTL_S; the router's
# own pod_ttl_s after a restart), a Redis call timing out (the router's 2 s socket timeout), and a scan after each.
REGISTRY_FAULT_S = POD_TTL_S + 3.0
LOOK_EVERY_S = 0.5  # twice per scan of the router's Redis registry (every second)


def registry_changes(cluster) -> list[str]:
    """The router's log lines of pods leaving or joining its Redis registry, in order."""
    log = (Path(cluster.run_dir) / "router.log").read_text()
    return [line for line in log.splitlines() if "left the registry" in line or ") registered" in line]


def routes_to_everyone_for(cluster, seconds: float) -> None:
    """The router routes to every pod at every look for ``seconds``."""
    everyone = {cluster.address(pod) for pod in cluster.pods}
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        assert routed_to(cluster) == everyone
        time.sleep(LOOK_EVERY_S)


def test_with_redis_unreachable_the_router_keeps_serving_with_the_pods_it_knew(cluster, answers):
    """Redis hangs for longer than a pod's key lives: every key has expired when it answers again, until the pods'
    next heartbeats. No pod leaves the routing meanwhile, or after."""
    changes = registry_changes(cluster)
    redis_pid = cluster.pid("redis")
    os.kill(redis_pid, signal.SIGSTOP)  # unreachable, not refused: every Redis call hangs, the harder case
    try:
        with load(cluster, answers) as background:
            routes_to_everyone_for(cluster, REGISTRY_FAULT_S)
    finally:
        os.kill(redis_pid, signal.SIGCONT)
    routes_to_everyone_for(cluster, POD_TTL_S / 3 + 2.0)  # the pods' next heartbeats, and a scan after them
    assert background.failures() == [] and len(background.results) >= 8
    assert registry_changes(cluster) == changes, "a pod was dropped from the registry and added again"


def test_a_redis_server_restarted_empty_loses_no_request(cluster, answers):
    """Its keys are gone until the pods' next heartbeats: meanwhile, and after the router's grace (pod_ttl_s), the
    router keeps routing to every pod, none dropped and added again."""
    changes = registry_changes(cluster)
    restarts = cluster.restarts["redis"]
    with load(cluster, answers) as background:
        background.wait_for(3)
        os.kill(cluster.pid("redis"), signal.SIGKILL)
        # >: a restart attempt may fail (a fork from this process, busy with gRPC threads, can abort before exec)
        wait_until(lambda: cluster.restarts["redis"] > restarts and cluster.pid("redis"), 60, "redis to restart")
        routes_to_everyone_for(cluster, REGISTRY_FAULT_S)
    assert background.failures() == []
    assert registry_changes(cluster) == changes, "a pod was dropped from the registry and added again"
    client = redis.Redis(host=cluster.config.host, port=cluster.config.redis_port)
    try:  # the new redis-server holds every pod's key again, written by its heartbeat, with the cluster's TTL
        keys = {pod_key(p.role, cluster.address(p)).encode() for p in cluster.pods}
        assert set(client.keys("splitserve:pods:*")) == keys
        assert all(0 < client.pttl(key) <= POD_TTL_S * 1000 for key in keys)
    finally:
        client.close()


def test_a_restarted_router_finds_the_pods_in_redis(cluster, answers):
    restarts = cluster.restarts["router"]
    os.kill(cluster.pid("router"), signal.SIGKILL)
    everyone = {cluster.address(pod) for pod in cluster.pods}

    def routes_to_everyone() -> bool:
        try:
            return cluster.restarts["router"] > restarts and routed_to(cluster) == everyone
        except OSError:  # not listening yet
            return False

    wait_until(routes_to_everyone, START_S, "the restarted router to route to every pod")
    with load(cluster, answers) as background:
        background.wait_for(4)
    assert background.failures() == []
