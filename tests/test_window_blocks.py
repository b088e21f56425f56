"""A model whose every layer attends over a sliding window (Mistral v0.1, Mixtral, Phi-3-4k) keeps only the window's
KV blocks (engine/block_manager.py): a long generation holds a bounded number of blocks and answers as transformers;
a prefix-cache hit needs only the window before its end; and the prefill pod pushes only the window's tokens, which
the decode pod keeps in the blocks it reserved for them and nothing before (asserted from its pool), with the offline
engine's answer, also for a split prefill's pushed prefix."""

from __future__ import annotations

import grpc
import pytest

from splitserve.engine.block_manager import window_start
from splitserve.engine.sampling.params import SamplingParams
from splitserve.v1 import common_pb2, decode_pb2
from tests.test_model_gemma import WINDOWED
from tests.test_pods import GREEDY, Pods, handshaken_header, layer_chunks, rpc_error, tokens_and_complete, trailer
from tests.tiny_checkpoints import PROMPT as TINY_PROMPT
from tests.tiny_checkpoints import VOCAB, Checkpoint, PrefillDecodeCluster, check_ranks_agree

WINDOW = 40  # not a multiple of the blocks' 16 tokens
BLOCK = 16
PROMPT = [(41 * k + 3) % VOCAB for k in range(150)]
KV_BYTES_PER_TOKEN = 2 * 2 * 1 * 128 * 2  # layers x K/V x KV heads x head_dim x float16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Checkpoint:
    return Checkpoint(tmp_path_factory.mktemp("mistral-window"), WINDOWED["mistral"][0], "mistral",
                      sliding_window=WINDOW)


def test_a_long_generation_holds_only_the_window_and_answers_as_transformers(checkpoint):
    """150 prompt tokens and 32 greedy steps through a pool of 8 blocks (128 tokens): at most the window's blocks
    and the step's are held, and the tokens are transformers'."""
    llm = checkpoint.llm(num_blocks=8, long_prefill_token_threshold=64)
    engine = llm.engine
    assert engine.block_manager.window == WINDOW
    seq = engine.add_request("long", PROMPT, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    held, table = [], 0  # blocks held after each step that leaves the sequence running; its table's length
    while engine.has_unfinished_requests():
        engine.step()
        if not seq.is_finished:
            held.append(engine.block_manager.num_held_blocks(seq))
            table = len(seq.block_table)
    assert seq.output_token_ids == checkpoint.greedy(PROMPT, 32)
    # Prefill in chunks of 64, 64 and 22 (the last samples the first token), then 31 decode steps, the last of which
    # finishes the sequence.
    assert len(held) == 3 + 30 and max(held[:3]) <= -(-(64 + WINDOW) // BLOCK) + 1
    assert max(held[3:]) == (WINDOW - 1) // BLOCK + 2 and table == -(-(150 + 31) // BLOCK)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_prefix_hit_reads_the_window_before_it_and_gives_the_same_tokens(checkpoint):
    llm = checkpoint.llm(num_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (first,) = llm.generate([PROMPT], params)
    hits = llm.engine.block_manager.prefix_hits
    (second,) = llm.generate([PROMPT + [7, 8, 9]], params)
    assert llm.engine.block_manager.prefix_hits - hits == 144  # 9 whole blocks, of which it holds the window's
    (alone,) = checkpoint.llm(num_blocks=32, enable_prefix_caching=False).generate([PROMPT + [7, 8, 9]], params)
    assert second.token_ids == alone.token_ids and first.token_ids == llm.generate([PROMPT], params)[0].token_ids


def greedy(llm, prompts: list[list[int]], max_tokens: int = 32) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_over_a_windowed_model_gives_the_plain_greedy_tokens(checkpoint, method):
    """Verified drafts and rejected ones rolled back while the window frees blocks: the plain engine's tokens. With a
    draft model (the checkpoint as its own), every block stays: the draft catches up over a whole prompt after the
    target prefilled it, into the same blocks."""
    settings = {"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}
    if method == "draft":
        settings["model"] = str(checkpoint.directory)
    llm = checkpoint.llm(speculative_config=settings)
    assert llm.engine.block_manager.window == (WINDOW if method == "ngram" else None)
    assert greedy(llm, [PROMPT]) == greedy(checkpoint.llm(), [PROMPT])
    assert llm.engine.spec_decode.num_draft_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_preempted_windowed_sequences_answer_as_each_alone(checkpoint):
    """Four 150-token prompts decoding at once through 14 blocks: preemptions (recompute) free and retake their
    window's blocks, and every answer is the one it gets alone."""
    prompts = [[(k * (31 + 2 * i) + i) % VOCAB for k in range(150)] for i in range(4)]
    engine = checkpoint.llm(num_blocks=14, long_prefill_token_threshold=64).engine
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    seqs = [engine.add_request(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
    preempted = 0
    while engine.has_unfinished_requests():
        engine.step()
        preempted += engine.last_step.num_preempted
    assert preempted > 0
    assert [seq.output_token_ids for seq in seqs] == [greedy(checkpoint.llm(), [prompt])[0] for prompt in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_tensor_parallel_ranks_serve_a_windowed_model_as_one_process(checkpoint):
    check_ranks_agree(checkpoint, {"tensor_parallel_size": 2})


@pytest.fixture(scope="module")
def pods(checkpoint):
    pods = Pods(str(checkpoint.directory))
    yield pods
    pods.close()


def test_the_decode_pod_keeps_only_the_windows_blocks_of_a_pushed_prompt(pods):
    """The push carries tokens [96, 150) (the blocks that the queries from 144 on read), the decode pod holds their
    4 blocks while the KV waits for its Decode call, and the answer is the offline engine's."""
    assert window_start(len(PROMPT), WINDOW, BLOCK) == 96
    first = pods.run_prefill("windowed", PROMPT, GREEDY)
    stats = first.kv_transfer
    assert stats.bytes_sent == stats.raw_bytes == (150 - 96) * KV_BYTES_PER_TOKEN
    load = pods.load("decode")
    assert load.total_kv_blocks - load.free_kv_blocks == 4  # blocks 6..9, none before
    tokens, _, complete = pods.run_decode("windowed", PROMPT, GREEDY, first)
    assert tokens == pods.offline_tokens(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
    assert complete.finish_reason == common_pb2.FINISH_REASON_LENGTH
    pods.wait_all_free("decode")
    pods.wait_all_free("prefill")


def test_a_prompt_the_prefill_pod_has_cached_ships_its_window_from_the_cache(pods):
    """The second push of a prompt: the prefill pod's prefix-cache hit (144 tokens) holds every block it covers (its
    KV leaves the pod: ``Sequence.exported``), the window's tokens before the hit's end go from the cache, and the
    decode pod answers as the offline engine."""
    prompt = [(29 * k + 11) % VOCAB for k in range(150)]
    expected = pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    for attempt in ("cold", "cached"):
        first = pods.run_prefill(f"again-{attempt}", prompt, GREEDY)
        assert first.num_cached_tokens == (144 if attempt == "cached" else 0)
        assert first.kv_transfer.raw_bytes == (150 - 96) * KV_BYTES_PER_TOKEN
        tokens, _, _ = pods.run_decode(f"again-{attempt}", prompt, GREEDY, first)
        assert tokens == expected
    pods.wait_all_free("decode")


@pytest.mark.parametrize("length, prefix", [(150, 96), (150, 100)])
def test_a_split_prefills_pushed_window_serves_the_rest_of_the_prompt(pods, length, prefix):
    prompt = [(37 * k + prefix) % VOCAB for k in range(length)]  # (its own tokens: no prefix shared)
    hits = pods.engine_hits("decode")
    first = pods.run_prefill(f"split-{prefix}", prompt[:prefix], common_pb2.SamplingParams(max_tokens=1))
    assert first.kv_transfer.raw_bytes == (prefix - window_start(prefix, WINDOW, BLOCK)) * KV_BYTES_PER_TOKEN
    request = decode_pb2.DecodeRequest(request_id=f"split-{prefix}", prompt_token_ids=prompt,
                                       sampling_params=GREEDY, kv_prefix_tokens=prefix)
    tokens, complete = tokens_and_complete(pods.decode.Decode(request, timeout=60))
    assert tokens == pods.offline_tokens(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert complete.usage.cached_tokens == pods.engine_hits("decode") - hits == 96
    pods.wait_all_free("decode")


def test_a_push_that_does_not_start_at_the_decode_pods_window_is_refused(pods):
    """A header that says the push starts at token 0 (a sender that ignored the handshake's window): INVALID_ARGUMENT
    naming where this pod keeps the prompt's KV from, and nothing held."""
    header = handshaken_header(pods, "from-zero", PROMPT)
    stream = [header, *layer_chunks("from-zero", len(PROMPT), head_dim=128, num_kv_heads=1, layers=range(2)),
              trailer(4, len(PROMPT))]
    error = rpc_error(pods.kv.PushKV, iter(stream))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the push starts at prompt token 0; this pod keeps the prompt's KV from token 96 on" in error.details()
    pods.wait_all_free("decode")


@pytest.mark.e2e
@pytest.mark.parametrize("pool", ["float16", "int8"])
def test_through_splitserve_up_a_windowed_model_answers_as_the_offline_engine(start_cluster, tmp_path, pool):
    """The tests' window of 16 under the 40-token prompt: the prefill pod pushes tokens [16, 40) to a decode pod that
    keeps only those, over real processes, with float16 pools and with int8 ones (their rows, as they lie), and the
    router's answers (gRPC and the ``openai`` client) are the offline engine's."""
    checkpoint = Checkpoint(tmp_path / "mistral", WINDOWED["mistral"][0], "mistral")
    assert window_start(len(TINY_PROMPT), 16, BLOCK) == 16
    with PrefillDecodeCluster(start_cluster, tmp_path / "up", checkpoint, cache_dtype=pool):
        pass
