"""Core lending (runtime/core_lending.py): a prefill pod's steps also run on the decode pod's CPU while that pod
holds no request.

The decision on hand-written activity files; the engine thread's set-up in a process of its own (it changes thread
affinities and priorities); and the whole system: ``splitserve up --lend-decode-cpus`` with the real SmolLM2,
whose prefill steps borrow the decode CPU only while the decode pod is idle, and whose answers stay the offline
engine's, token for token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.decode_service.config import DecodeConfig
from splitserve.engine import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.launcher import Cluster
from splitserve.prefill_service.config import PrefillConfig
from splitserve.runtime.config import parse_config
from splitserve.runtime.core_lending import CoreLender, DecodeActivity, DecodeYield
from splitserve.runtime.cpus import allowed_cpus
from splitserve.up_config import UpConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
needs_two_cpus = pytest.mark.skipif(not {0, 1} <= allowed_cpus(), reason="lending needs CPUs 0 and 1")


# ---- the decision ---------------------------------------------------------------------------------------------


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_activity_is_read_as_written_and_a_missing_file_as_unknown(tmp_path):
    writer, reader = DecodeActivity(tmp_path / "decode-0", writer=True), DecodeActivity(tmp_path / "decode-0")
    assert (reader.held(), reader.lendable_until(), reader.borrowed_until()) == (0, 0.0, 0.0)
    writer.publish(3, 12.5)
    reader.borrow(11.0)
    assert (reader.held(), reader.lendable_until(), writer.borrowed_until()) == (3, 12.5, 11.0)
    writer.publish(0)
    assert (reader.held(), reader.lendable_until()) == (0, 0.0)
    missing = DecodeActivity(tmp_path / "nobody")
    assert (missing.held(), missing.lendable_until()) == (None, 0.0)


def test_steps_borrow_idle_owners_cpus_and_busy_ones_only_while_they_can_spare_them(tmp_path):
    clock = Clock()
    a, b = (DecodeActivity(tmp_path / name, writer=True) for name in ("a", "b"))
    lender = CoreLender(frozenset({0}), frozenset({1, 2}), [DecodeActivity(tmp_path / "a"),
                                                            DecodeActivity(tmp_path / "b")], clock=clock)
    assert lender.wanted_threads() == 3  # both idle
    a.publish(1, clock.now + 0.1)  # busy, its requests spare 100 ms: less than 1.5 x the first step's guess
    assert lender.wanted_threads() == 1
    a.publish(1, clock.now + 0.31)  # now they spare enough
    assert lender.wanted_threads() == 3
    b.publish(2, 0.0)  # the other owner is busy and spares nothing
    assert lender.wanted_threads() == 1
    b.publish(0)
    # A borrowed step tells the busy owner until when, and hands the CPU back as soon as it ends.
    assert lender.before_step() is True
    assert a.borrowed_until() == pytest.approx(clock.now + 0.3) and b.borrowed_until() == pytest.approx(clock.now + 0.3)
    clock.now += 0.05
    lender.after_step()
    assert a.borrowed_until() == 0.0
    # The lent step took 50 ms: from now on a busy owner must spare 75 ms.
    assert lender.step_estimate_s == pytest.approx(0.05)
    a.publish(1, clock.now + 0.074)
    assert lender.wanted_threads() == 1
    a.publish(1, clock.now + 0.076)
    assert lender.wanted_threads() == 3
    # An owner that cannot be heard from is taken as busy: its CPU is never borrowed blind.
    silent = CoreLender(frozenset({0}), frozenset({1}), [DecodeActivity(tmp_path / "missing")], clock=clock)
    assert silent.wanted_threads() == 1


def test_a_prefill_pod_busy_half_the_time_lends_nothing(tmp_path):
    clock = Clock()
    DecodeActivity(tmp_path / "a", writer=True)  # idle
    lender = CoreLender(frozenset({0}), frozenset({1}), [DecodeActivity(tmp_path / "a")], clock=clock)
    for _ in range(10):  # 10 steps of 240 ms, 10 ms apart: busy 96% of the last 2.5 s, 48% of the window
        assert lender.before_step()
        clock.now += 0.24
        lender.after_step()
        clock.now += 0.01
    assert lender.busy_share(clock.now) == pytest.approx(0.48)
    assert lender.wanted_threads() == 2
    assert lender.before_step()
    clock.now += 0.24
    lender.after_step()  # one more: 52.8% of the window
    assert lender.wanted_threads() == 1 and not lender.before_step()
    clock.now += 0.24
    lender.after_step()
    clock.now += 5.0  # an idle window later it lends again
    assert lender.wanted_threads() == 2


def test_lending_refuses_shared_or_ownerless_cpus(tmp_path):
    owner = [DecodeActivity(tmp_path / "a", writer=True)]
    with pytest.raises(ValueError, match="disjoint"):
        CoreLender(frozenset({0, 1}), frozenset({1}), owner)
    with pytest.raises(ValueError, match="disjoint"):
        CoreLender(frozenset({0}), frozenset(), owner)
    with pytest.raises(ValueError, match="activity files"):
        CoreLender(frozenset({0}), frozenset({1}), [])


def seq(request_id: str, output_tokens: int, target: float = 0.0) -> Sequence:
    s = Sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=100))
    s.output_token_ids.extend([7] * output_tokens)
    s.tpot_target_s = target
    return s


def run_when_allowed(pod: DecodeYield) -> int:
    """Ask ``pod`` before a step until it says go, as its engine loop does; how many times it said not yet."""
    refused = 0
    while not pod.before_step():
        refused += 1
    return refused


def test_a_decode_pod_spares_its_cpu_within_every_requests_tpot_target(tmp_path):
    clock = Clock()
    activity = DecodeActivity(tmp_path / "d", writer=True)
    pod = DecodeYield(activity, default_target_s=0.05, share=0.8, clock=clock, sleep=clock.sleep)
    a, b = seq("a", 1), seq("b", 1, target=0.1)
    pod.observe([a, b], 0, stepped=False)  # admitted: a's next token is due within 0.8 x its 50 ms target
    assert (activity.held(), activity.lendable_until()) == (2, pytest.approx(clock.now + 0.04))
    for _ in range(10):  # ten 10 ms steps, a token each
        assert pod.before_step()
        clock.now += 0.01
        a.output_token_ids.append(7)
        b.output_token_ids.append(7)
        pod.observe([a, b], 0, stepped=True)
    # a (the pod's 50 ms target): its 11th token here is due by 0.8 x 50 ms x 11 = 440 ms after it first ran; 100 ms
    # went by and the next step takes 10: it spares 330 ms. b (its own 100 ms target) spares more.
    assert activity.lendable_until() == pytest.approx(clock.now + 0.33)
    # A request waiting for its first step here spares nothing.
    pod.observe([a, b], 1, stepped=False)
    assert (activity.held(), activity.lendable_until()) == (3, 0.0)
    pod.observe([a, b], 0, stepped=False)
    # Borrowed for 200 ms: the pod pauses until the borrow ends, 2 ms at a time (its loop applies commands between)...
    activity.borrow(clock.now + 0.2)
    start = clock.now
    assert run_when_allowed(pod) in (100, 101)  # 2 ms slices (the last may be a rounding error long)
    assert clock.now - start == pytest.approx(0.2) and pod.paused_s == pytest.approx(0.2)
    # ... and never past what its requests spare, however long the borrow.
    pod.observe([a, b], 0, stepped=True)
    activity.borrow(clock.now + 10.0)
    spare_end = activity.lendable_until()
    run_when_allowed(pod)
    assert clock.now == pytest.approx(spare_end, abs=1e-9)
    # Nor with a request waiting for its first step (a and b ran ahead meanwhile: they spare 200 ms again).
    a.output_token_ids.extend([7] * 5)
    b.output_token_ids.extend([7] * 5)
    pod.observe([a, b], 0, stepped=True)
    assert activity.lendable_until() == pytest.approx(clock.now + 0.2)
    activity.borrow(clock.now + 10.0)
    start = clock.now
    assert pod.before_step(num_waiting=1)
    assert clock.now == start


def test_requests_without_a_target_spare_nothing(tmp_path):
    clock = Clock()
    activity = DecodeActivity(tmp_path / "d", writer=True)
    pod = DecodeYield(activity, default_target_s=0.0, clock=clock, sleep=clock.sleep)
    pod.observe([seq("a", 5, target=0.1), seq("b", 5)], 0, stepped=True)
    assert activity.lendable_until() == 0.0
    pod.observe([], 0, stepped=True)
    assert (activity.held(), activity.lendable_until()) == (0, 0.0)


# ---- configuration --------------------------------------------------------------------------------------------


@needs_two_cpus
def test_the_launcher_hands_each_pod_its_part(tmp_path):
    cluster = Cluster(UpConfig(model="tiny-random", run_dir=str(tmp_path), prometheus=False, prefill_cpus="0",
                               decode_cpus="1", lend_decode_cpus=True))
    prefill = parse_config(PrefillConfig, cluster._pod_flags(cluster.pods[0]), env={})
    decode = parse_config(DecodeConfig, cluster._pod_flags(cluster.pods[1]), env={})
    assert (prefill.cpus, prefill.lend_cpus, prefill.activity_file) == ("0", "1", "")
    assert prefill.lender_activity_files == decode.activity_file == str(tmp_path / "activity" / "decode-0")
    assert decode.lend_cpus == ""


@needs_two_cpus
@pytest.mark.parametrize("fields, message", [
    (dict(prefill_cpus="0-1", decode_cpus="1"), "share CPU 1"),
    (dict(scheduling="colocated"), "needs prefill and decode pods"),
    (dict(pin_cpus=False), "pinned CPUs"),
])
def test_the_launcher_refuses_lending_it_cannot_do(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        Cluster(UpConfig(model="tiny-random", run_dir=str(tmp_path), prometheus=False, lend_decode_cpus=True,
                         **fields))


@needs_two_cpus
def test_a_pod_refuses_lent_cpus_it_already_owns_or_cannot_hear_about():
    with pytest.raises(ValueError, match="overlaps"):
        PrefillConfig(model="tiny-random", cpus="0-1", lend_cpus="1", lender_activity_files="/tmp/x")
    with pytest.raises(ValueError, match="lender_activity_files"):
        PrefillConfig(model="tiny-random", cpus="0", lend_cpus="1")


# ---- the engine thread ----------------------------------------------------------------------------------------

ENGINE_THREAD = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    from splitserve.engine.sequence import Sequence
    from splitserve.runtime.core_lending import CoreLender, DecodeActivity
    from splitserve.runtime.torch_threads import apply_cpu_set

    apply_cpu_set("0", 1)  # as a prefill pod on CPU 0 starts
    owner = DecodeActivity(sys.argv[1], writer=True)
    lender = CoreLender(frozenset({0}), frozenset({1}), [DecodeActivity(sys.argv[1])])
    seen = {}

    def engine_thread():
        lender.start_on_engine_thread()
        seen["engine_cpus"] = sorted(os.sched_getaffinity(0))
        steps = []
        for held in (0, 2, 0):
            owner.publish(held)
            steps.append([lender.before_step(), torch.get_num_threads()])
            torch.ones(1 << 20).add_(1)  # a step's parallel work
        seen["steps"] = steps
        # Looked at while this thread lives: its OpenMP team's workers end with it (libgomp frees a thread's pool as
        # the thread exits), so read after the join a worker may be gone (seen once in a full run).
        seen["workers"] = [sorted(os.sched_getaffinity(tid)) for tid in lender.workers]
        seen["others"] = sorted({cpu for tid in os.listdir("/proc/self/task") if int(tid) not in lender.workers
                                 for cpu in os.sched_getaffinity(int(tid))})

    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    seen["main_cpus"] = sorted(os.sched_getaffinity(0))
    print(json.dumps(seen))
""")


@needs_two_cpus
def test_the_engine_thread_keeps_its_own_cpu_and_only_the_lent_workers_reach_the_decode_cpu(tmp_path):
    out = subprocess.run([sys.executable, "-c", ENGINE_THREAD, str(tmp_path / "decode-0")], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["engine_cpus"] == seen["main_cpus"] == [0]  # the process stays on its own CPU
    assert seen["workers"] == [[1]]  # one OpenMP worker, on the lent CPU
    assert seen["others"] == [0]  # every other thread on the pod's own
    assert seen["steps"] == [[True, 2], [False, 1], [True, 2]]  # idle owner: 2 threads; busy: its own CPU only


# ---- the whole system -----------------------------------------------------------------------------------------

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years")
LONG_DECODE_TOKENS = 400


@pytest.fixture(scope="module")
def lending_up(tmp_path_factory, start_cluster):
    if not {0, 1} <= allowed_cpus():
        pytest.skip("lending needs CPUs 0 and 1")
    cluster = start_cluster(tmp_path_factory.mktemp("lending-up"), model="smollm2-135m", prefill=1, decode=1,
                            prefill_cpus="0", decode_cpus="1", lend_decode_cpus=True, kv_codec="none",
                            scheduling="disaggregated", conditional_prefill_threshold=0,
                            kv_cache_memory_bytes=128 << 20, prometheus=False)
    yield cluster
    cluster.stop()


def _complete(cluster: Cluster, prompt: str, max_tokens: int, **extra) -> dict:
    body = json.dumps({"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       **extra})
    request = urllib.request.Request(f"http://{cluster.config.host}:{cluster.config.http_port}/v1/completions",
                                     body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)


def _pod_counter(cluster: Cluster, role: str, name: str) -> float:
    pod = next(p for p in cluster.pods if p.role == role)
    with urllib.request.urlopen(f"http://{cluster.config.host}:{pod.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def _lent_steps(cluster: Cluster) -> float:
    return _pod_counter(cluster, "prefill", "splitserve_engine_lent_cpu_steps_total")


def _paused_seconds(cluster: Cluster) -> float:
    return _pod_counter(cluster, "decode", "splitserve_engine_lent_cpu_seconds_total")


@pytest.mark.e2e
@pytest.mark.model
def test_prefills_borrow_the_idle_decode_cpu_and_answer_as_the_offline_engine(lending_up, smollm2):
    expected = smollm2.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16))[0].text
    before = _lent_steps(lending_up)
    assert _complete(lending_up, PROMPT, 16)["choices"][0]["text"] == expected
    assert _lent_steps(lending_up) > before  # the decode pod was idle: the prompt ran on both CPUs


def _while_a_long_request_decodes(cluster: Cluster, tpot_target_s: float) -> tuple[float, float, dict]:
    """Prefill PROMPT while a long request with TPOT target ``tpot_target_s`` decodes: (prefill steps on the lent
    CPU, seconds the decode pod paused for them, the long request's reply)."""
    long_reply: dict = {}
    decoding = threading.Thread(target=lambda: long_reply.update(_complete(
        cluster, "Tell me a very long story about the sea.", LONG_DECODE_TOKENS, ignore_eos=True,
        slo_tpot_s=tpot_target_s)))
    decoding.start()
    try:
        waited = 0
        while not _decode_holds_a_request(cluster):  # its prompt was the last step that had the CPU to itself
            assert waited < 600, "the long request never reached the decode pod"
            waited += 1
            time.sleep(0.05)
        time.sleep(0.3)  # some tokens, so that its requests have time to spare
        steps, paused = _lent_steps(cluster), _paused_seconds(cluster)
        # ~500 tokens: lent steps long enough that the decode pod, between its own steps, sees the CPU borrowed
        # (a shorter prompt prefilled in bf16 can borrow and give back the CPU within one decode step)
        _complete(cluster, PROMPT * 10, 1)
        assert decoding.is_alive(), "the long decode ended before the second prompt: nothing was checked"
        steps, paused = _lent_steps(cluster) - steps, _paused_seconds(cluster) - paused
    finally:
        decoding.join(timeout=120)
    assert long_reply["usage"]["completion_tokens"] == LONG_DECODE_TOKENS
    return steps, paused, long_reply


@pytest.mark.e2e
@pytest.mark.model
def test_a_decode_whose_target_leaves_no_time_to_spare_keeps_its_cpu(lending_up):
    steps, paused, _ = _while_a_long_request_decodes(lending_up, tpot_target_s=0.001)
    assert (steps, paused) == (0, 0.0)


@pytest.mark.e2e
@pytest.mark.model
def test_a_decode_with_time_to_spare_pauses_for_the_prefill_steps(lending_up):
    steps, paused, _ = _while_a_long_request_decodes(lending_up, tpot_target_s=0.1)
    assert steps >= 1 and paused > 0  # the same prompt as above, now on both CPUs


def _decode_holds_a_request(cluster: Cluster) -> bool:
    return (DecodeActivity(cluster.run_dir / "activity" / "decode-0").held() or 0) > 0
