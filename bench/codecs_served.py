"""``splitserve bench codecs --through-up``: each codec's greedy agreement over the real path, beside the benchmark's.

For each codec (``none`` first), a cluster of its own (``splitserve.launcher.Cluster``: one prefill pod, one decode
pod, ``--kv-codec`` the codec, ``--conditional-prefill-threshold 0`` so that every prompt's KV crosses the codec,
the pods' default cache dtype) serves the benchmark's agreement prompts as token ids, greedy, ``--tokens`` tokens,
EOS ignored, ``--through-up-concurrency`` requests in flight (one the router refuses as too busy is asked again).
Each codec's answers are compared with the ``none`` cluster's (agreement as in the benchmark: the share of the
lossless answer's tokens before the first divergence; "same" = answers equal in full), and the ``none`` cluster's
answers with the in-process lossless run that ``bench codecs`` takes as its reference (``reference_run``), so that
a difference between the served path and the benchmark shows as one. The benchmark's own agreement for the codec,
from the quality table shipped for the model (kvtransfer/quality/, the served cache dtype's), is printed beside.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from splitserve.engine.config import CacheConfig
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.kvtransfer.link_codec import QualityTable
from splitserve.launcher import Cluster
from splitserve.measure.codec_agreement import AGREEMENT_GROUP, agreement, load_model, reference_run
from splitserve.measure.codec_texts import agreement_prompts
from splitserve.up_config import UpConfig
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

REQUEST_TIMEOUT_S = 900.0
BUSY_RETRY_S = 5.0  # the router refuses a prompt that would queue past its max_queue_time_s: ask again this later


def served_answers(model: str, codec: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                   log=print) -> list[list[int]]:
    """The greedy answers to ``prompts`` of a fresh ``splitserve up`` cluster pushing KV with ``codec``."""
    cluster = Cluster(UpConfig.on_ports(model=model, prefill=1, decode=1, kv_codec=codec, scheduling="disaggregated",
                                        conditional_prefill_threshold=0, prometheus=False))  # every KV on the wire
    try:
        cluster.start()
        cluster.wait_ready(log=lambda *_: None)
        address = f"{cluster.config.host}:{cluster.config.grpc_port}"
        started = time.perf_counter()
        with grpc.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            with ThreadPoolExecutor(concurrency) as pool:
                answers = list(pool.map(lambda prompt: _generate(stub, prompt, max_tokens), prompts))
        log(f"{codec}: {len(prompts)} answers through splitserve up in {time.perf_counter() - started:.0f} s")
        return answers
    finally:
        cluster.stop()


def _generate(stub, prompt: list[int], max_tokens: int) -> list[int]:
    params = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt), sampling_params=params)
    while True:
        try:
            return _stream(stub, request)
        except grpc.RpcError as err:  # refused before its first token: nothing was generated yet
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
        time.sleep(BUSY_RETRY_S)


def _stream(stub, request: generate_pb2.GenerateRequest) -> list[int]:
    tokens: list[int] = []
    for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S):
        kind = response.WhichOneof("response")
        if kind == "error":
            raise RuntimeError(f"the router answered an error: {response.error.message}")
        if kind == "chunk":
            tokens += response.chunk.token_ids
    return tokens


def offline_reference(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The benchmark's lossless reference (``reference_run``) on the served cache dtype, in its groups."""
    groups = [prompts[i:i + AGREEMENT_GROUP] for i in range(0, len(prompts), AGREEMENT_GROUP)]
    engine = load_model(model, CacheConfig.cache_dtype, groups, max_tokens).engine
    return [answer for group in groups for answer in reference_run(engine, group, max_tokens)[0]]


def run(model: str, codecs: list[str], num_prompts: int, max_tokens: int, concurrency: int, log=print) -> dict:
    """Every codec's agreement through ``splitserve up`` against the ``none`` cluster (``codecs[0]``)."""
    prompts = agreement_prompts(load_tokenizer(model), num_prompts)
    table = QualityTable.shipped(model)
    benchmark = table.eligible(CacheConfig.cache_dtype, 0.0) if table is not None else {}
    reference = offline_reference(model, prompts, max_tokens)
    lossless = served_answers(model, "none", prompts, max_tokens, concurrency, log)
    offline_agree, offline_same = agreement(reference, lossless)
    log(f"none through splitserve up vs bench codecs' in-process reference: agreement {offline_agree:.1%}, "
        f"same {offline_same}/{len(prompts)}")
    figures = {"none": {"agreement": offline_agree, "identical": offline_same, "against": "in-process reference"}}
    for codec in codecs:
        if codec == "none":
            continue
        agree, same = agreement(lossless, served_answers(model, codec, prompts, max_tokens, concurrency, log))
        figures[codec] = {"agreement": agree, "identical": same, "against": "none through splitserve up",
                          "benchmark_agreement": benchmark[codec].agreement if codec in benchmark else None}
        log(f"{codec}: agreement {agree:.1%}, same {same}/{len(prompts)}; bench codecs (quality table) "
            f"{_percent(figures[codec]['benchmark_agreement'])}")
    return {"cache_dtype": CacheConfig.cache_dtype, "codecs": figures}


def _percent(share: float | None) -> str:
    return "not in the table" if share is None else f"{share:.1%}"
