"""The KV's way from the prefill pod to the decode pod failing, and the one decode pod dying, with real processes
(1 prefill + 1 decode pod, tiny random model; the prefill pod sends half its KV chunks corrupted,
``--inject-corrupt-chunks 0.5``):

- a corrupted chunk is caught by its checksum (DATA_LOSS), the push fails, the router retries the request (the
  decode pod prefills it) and the answer is exact; every block is free afterwards;
- pods of different models refuse each other at the handshake with a clear FAILED_PRECONDITION;
- with its only decode pod killed mid-stream, the client gets a clear error within a bounded time, never a hang.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import live_cluster as live
import pytest

from splitserve.probes import serving
from splitserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
SHORT = 8
LONG = 300
PROMPTS = live.prompts(4, 48, seed=11)  # past the conditional-prefill threshold: prefilled on the P pod first


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, start_cluster):
    running = start_cluster(tmp_path_factory.mktemp("transfer-faults"), **live.TINY, prefill=1, decode=1,
                            inject_corrupt_chunks=0.5)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def answers():
    return live.offline_answers(PROMPTS, SHORT)


@pytest.fixture(autouse=True)
def every_block_free_afterwards(cluster):
    before = live.leases_expired(cluster)
    yield
    live.wait_every_block_free(cluster, since=before)


def test_corrupted_kv_chunks_are_caught_by_their_checksum_and_the_request_is_retried(cluster, answers):
    retried = live.router_counter(cluster, "splitserve_router_retries_total", code="DATA_LOSS")
    with live.BackgroundLoad(cluster, PROMPTS, answers, SHORT, workers=2) as load:
        load.wait_for(8)
    assert load.failures() == []  # every answer exact, although most pushes arrived corrupted
    assert live.router_counter(cluster, "splitserve_router_retries_total", code="DATA_LOSS") > retried
    log = (Path(cluster.run_dir) / "decode-0.log").read_text()
    assert "checksum" in log.lower(), "the decode pod does not say why it refused the push"


@pytest.mark.model
def test_pods_of_different_models_refuse_each_other_with_a_clear_error(cluster, free_ports, tmp_path):
    """The tiny model's prefill pod pushing to a SmolLM2 decode pod: refused at the handshake, naming the field."""
    port = free_ports(2)
    with open(tmp_path / "smollm2-decode.log", "wb") as log:
        other = subprocess.Popen([sys.executable, "-m", "splitserve.decode_service", "--host", "127.0.0.1",
                                  "--port", str(port), "--metrics-port", str(port + 1), "--model", "smollm2-135m",
                                  "--kv-cache-memory-bytes", str(16 << 20)], cwd=REPO_ROOT, stdout=log,
                                 stderr=subprocess.STDOUT)
    try:
        live.wait_until(lambda: other.poll() is not None or serving(f"127.0.0.1:{port}"), live.START_S,
                        "the SmolLM2 pod")
        assert other.poll() is None, (tmp_path / "smollm2-decode.log").read_text()
        prefill = next(p for p in cluster.pods if p.name == "prefill-0")
        with grpc.insecure_channel(cluster.address(prefill)) as channel, pytest.raises(grpc.RpcError) as refused:
            prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id="other-model", prompt_token_ids=PROMPTS[0],
                sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=4),
                decode_address=f"127.0.0.1:{port}", kv_codec="none"), timeout=60)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model_name" in refused.value.details() and "smollm2" in refused.value.details().lower(), \
            refused.value.details()
    finally:
        other.send_signal(signal.SIGTERM)
        other.wait(timeout=60)


def test_with_its_only_decode_pod_killed_the_stream_waits_for_the_restart_and_finishes_the_exact_answer(cluster):
    """Nowhere else to go: the router holds the stream (decode_pod_wait_s) until the supervisor has the decode pod
    back, then migrates it there, from its last token; the client sees the offline answer, each token once."""
    restarts = cluster.restarts["decode-0"]
    waited = live.router_counter(cluster, "splitserve_router_decode_pod_waits_total", outcome="found")
    killed_at: list[float] = []

    def kill_the_decode_pod() -> None:
        os.kill(cluster.pid("decode-0"), signal.SIGKILL)
        killed_at.append(time.monotonic())

    prompt = live.prompts(1, 16, seed=12)[0]  # short: prefilled on the decode pod, no corrupted push in the way
    answer = live.stream(cluster, prompt, LONG, after_first_chunk=kill_the_decode_pod)
    ended_after = time.monotonic() - killed_at[0]
    assert answer.finish == "FINISH_REASON_LENGTH", answer
    assert answer.token_ids == live.offline_answers([prompt], LONG)[0]
    assert live.router_counter(cluster, "splitserve_router_decode_pod_waits_total", outcome="found") == waited + 1
    assert cluster.restarts["decode-0"] == restarts + 1
    print(f"finished {ended_after:.2f} s after the kill, on the restarted decode pod")
