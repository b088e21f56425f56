"""``splitserve up``'s default prefill compute format on real processes (issue 34): ``--prefill-compute-dtype auto``
resolves on this CPU (bfloat16 where it multiplies bf16 natively: avx512_bf16, amx_bf16; float32 elsewhere), every
pod reports what it resolved and the CPU features that chose it (its load reports, the handshake's layout, the
router's ``/pods``), and the cluster's greedy answers are the offline ``LLM``'s in the same resolved format, token
for token.

Exact, not within an agreement: a prompt position's bf16 prefill has the same bits however the prompt is chunked or
batched (tests/test_prefill_compute_format.py), and whatever the thread count: measured on this project's AMD EPYC
(avx512_bf16, no AMX), SmolLM2's 300-token prefill in bf16 gave the same hidden states, bit for bit, on 1 and 2
torch threads, and the same greedy tokens; the pods of ``up`` run one thread each, the offline engine torch's
default. So a pod that prefills a prompt, one that prefills a lent or split part of it, and the offline engine give
one K/V, and the decode rows that follow are float32 everywhere."""

from __future__ import annotations

import grpc
import pytest
import torch

from splitserve.engine import LLM
from splitserve.engine.kernels.cpu_features import matrix_flags, prefill_compute_dtype
from splitserve.engine.sampling.params import SamplingParams
from splitserve.kvtransfer.handshake import KVLayout
from splitserve.v1 import (
    common_pb2,
    generate_pb2,
    generate_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    pod_status_pb2,
    pod_status_pb2_grpc,
)
from tests.reliability.live_cluster import ROUTES, route_counts, router_json, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.model]

MAX_TOKENS = 24
# Token-id prompts: under the router's conditional-prefill threshold (the decode pod prefills it) and well over it
# (the prefill pod, or lent to the decode pod, or split between them, as the hybrid default decides), then chat
# prompts (~170-210 tokens with SmolLM2's system prompt).
LENGTHS = (6, 310)
QUESTIONS = ("Why is the sky blue?", "Explain how a CPU cache works, step by step, for a new engineer.")
# Greedy, with each sampled token's logprob: the first comes from the prefill's last row, so its bits tell the
# prefill's format (and every later one depends on the prompt's K/V).
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def default_up(tmp_path_factory, start_cluster):
    """``splitserve up`` on the real SmolLM2 with every compute-format and scheduling default."""
    cluster = start_cluster(tmp_path_factory.mktemp("prefill-format-up"), model="smollm2-135m",
                            kv_cache_memory_bytes=64 << 20, prometheus=False)
    yield cluster
    cluster.stop()


def _prompts(tokenizer) -> list[list[int]]:
    """SmolLM2 token ids past its special tokens, different ids in each, then the chat prompts."""
    return ([[1000 + (97 * i + 31 * n) % 30000 for i in range(n)] for n in LENGTHS]
            + [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS])


def _offline(llm: LLM, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    """Each answer's (token, logprob) pairs, the logprobs rounded to float32 as the API carries them."""
    return [[(t, float(torch.tensor(lp[t], dtype=torch.float32))) for t, lp in zip(o.token_ids, o.logprobs)]
            for o in llm.generate(prompts, GREEDY)]


def _served(cluster, prompt: list[int]) -> list[tuple[int, float]]:
    request = generate_pb2.GenerateRequest(sampling_params=common_pb2.SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0))
    request.token_ids.ids.extend(prompt)
    pairs = []
    with grpc.insecure_channel(f"{cluster.config.host}:{cluster.config.grpc_port}") as channel:
        for reply in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            assert reply.WhichOneof("response") != "error", reply.error.message
            if reply.WhichOneof("response") == "chunk":
                pairs += [(t, lp.logprob) for t, lp in zip(reply.chunk.token_ids, reply.chunk.logprobs.tokens)]
    return pairs


def test_the_default_answers_as_the_offline_engine_in_the_same_resolved_format(default_up, smollm2):
    resolved = prefill_compute_dtype("auto")
    assert smollm2.engine.prefill_compute == resolved  # LLM(...)'s default is the same auto, resolved alike
    prompts = _prompts(smollm2.tokenizer)
    expected = _offline(smollm2, prompts)
    routes = []
    for prompt, reference in zip(prompts, expected):
        before = route_counts(default_up)
        assert _served(default_up, prompt) == reference, f"{len(prompt)}-token prompt"
        taken = {name: n - before[name] for name, n in route_counts(default_up).items()}
        # One route, not retried; a decode pod took in pushed KV exactly when a prefill pod prefilled (all or part).
        [route] = [name for name in ROUTES if taken[name]]
        assert taken[route] == 1 and taken["retries"] == 0, taken
        assert taken["kv_loaded"] == (route != "prefill_on_decode"), taken
        routes.append(route)
    # Both kinds of route were compared (measured on AMD EPYC Zen 4: the 6-token prompt and one chat prompt lent, the
    # 310-token one and the other chat prompt disaggregated): a prompt whose KV crossed from a prefill pod, and one
    # the decode pod prefilled itself.
    assert "prefill_on_decode" in routes and {"disaggregated", "split"} & set(routes), routes
    if resolved == "bfloat16":  # what was compared is bf16 prefill's: float32's first logprobs differ
        f32 = _offline(LLM(model="smollm2-135m", kv_cache_memory_bytes=64 << 20, prefill_compute_dtype="float32"),
                       prompts)
        assert all(mine[0][1] != theirs[0][1] for mine, theirs in zip(f32, expected))


def _pod_addresses(cluster) -> dict[str, str]:
    return {pod.name: cluster.address(pod) for pod in cluster.pods}


def test_every_pod_reports_its_resolved_format_in_its_load_its_handshake_and_the_routers_pods(default_up, smollm2):
    resolved, features = prefill_compute_dtype("auto"), list(matrix_flags())
    assert features  # this CPU's /proc/cpuinfo lists at least avx2
    addresses = _pod_addresses(default_up)
    assert {name.split("-")[0] for name in addresses} == {"prefill", "decode"}
    for name, address in addresses.items():
        with grpc.insecure_channel(address) as channel:
            load = pod_status_pb2_grpc.PodStatusStub(channel).GetLoad(pod_status_pb2.LoadRequest(), timeout=10)
            assert (load.prefill_compute_dtype, list(load.cpu_features)) == (resolved, features), name
            if name.startswith("decode"):  # the handshake a prefill pod makes: the decode pod's layout answers
                mine = KVLayout.of_engine(smollm2.engine)
                answer = kv_transfer_pb2_grpc.KVTransferStub(channel).Handshake(kv_transfer_pb2.HandshakeRequest(
                    layout=mine.to_proto(), compat_hash=mine.compat_hash, codec="none"), timeout=10)
                theirs = KVLayout.from_proto(answer.layout)
                assert (theirs.prefill_compute_dtype, list(theirs.cpu_features)) == (resolved, features)
                assert theirs.compat_hash == mine.compat_hash  # the format is not in the hash

    def reported() -> list[dict]:
        return [pod for pod in router_json(default_up, "/pods")["pods"] if pod["load"]["prefill_compute_dtype"]]

    wait_until(lambda: len(reported()) == len(addresses), 30, "every pod's first load report at the router")
    for pod in reported():
        assert (pod["load"]["prefill_compute_dtype"], pod["load"]["cpu_features"]) == (resolved, features), pod
