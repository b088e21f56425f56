"""Tensor parallelism inside one engine (engine/parallel/): the shard plan, and TP N against TP 1 end to end.

The end-to-end tests run the real ranks (rank 0 here, the others as processes) through the offline ``LLM`` and hold
TP N to TP 1: the same greedy tokens, and every logit the sampler saw within 1e-4 (TP sums each row-parallel product
over the ranks, so the float32 sums round in another order: close, not the same bits). tiny-random is a GQA model (4
query heads, 2 KV heads), run with 2 ranks and with 4 (more ranks than KV heads: each KV head on two ranks);
SmolLM2-135M splits unevenly (9 query and 3 KV heads: 6 + 3 query heads, 2 + 1 KV heads).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.llm_engine import EngineStepError
from splitserve.engine.parallel import shm_all_reduce
from splitserve.engine.parallel.layout import plan_shards, shard_state_dict
from splitserve.engine.parallel.workers import TensorParallelError
from splitserve.engine.weights.parameter_layout import random_state_dict
from splitserve.engine.weights.quantized_weights import quantize_state_dict

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TINY_PROMPTS = ["Hello, my name is", "The capital of France", " ".join(str(i) for i in range(40))]


def _smollm2_shape(**overrides) -> ModelConfig:
    shape = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_layers": 1, "num_heads": 9,
             "num_kv_heads": 3}
    return ModelConfig(**shape | overrides)


def test_uneven_heads_split_by_kv_group():
    q, kv = zip(*((s.q_heads, s.kv_heads) for s in plan_shards(_smollm2_shape(), 2)))
    assert q == ((0, 6), (6, 9)) and kv == ((0, 2), (2, 3))


def test_more_ranks_than_kv_heads_replicate_them():
    shards = plan_shards(ModelConfig(64, 64, 128, 1, num_heads=4, num_kv_heads=2), 4)
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [s.q_heads for s in shards] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_intermediate_cut_on_quantized_blocks_and_vocab_evenly():
    shards = plan_shards(_smollm2_shape(intermediate_size=96, vocab_size=7), 2)
    assert [s.intermediate for s in shards] == [(0, 64), (64, 96)]
    assert [s.vocab for s in shards] == [(0, 4), (4, 7)]


def test_impossible_splits_are_refused():
    with pytest.raises(ValueError, match="exceeds the model's 9 attention heads"):
        plan_shards(_smollm2_shape(), 10)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    # head_dim 48: rank 0's o_proj columns (1 head, inputs 0..47) end inside a quantized block of 32
    config = ModelConfig(64, 96, 128, 1, num_heads=2, num_kv_heads=2, head_dim=48)
    state = quantize_state_dict(random_state_dict(config, seed=0), config, "int8")
    with pytest.raises(ValueError, match=r"layers.0.attn.o_proj.weight is kept in blocks .* cut a block"):
        shard_state_dict(config, state, plan_shards(config, 2)[0])


def test_shards_partition_the_weights():
    """Every weight element sits in exactly one rank's shard (norms: in every one), q/k/v rows with their heads."""
    config = ModelConfig(50, 64, 96, 1, num_heads=4, num_kv_heads=2)
    state = random_state_dict(config, seed=1)
    shards = [shard_state_dict(config, state, s) for s in plan_shards(config, 2)]
    qkv = state["layers.0.attn.qkv_proj.weight"]  # rows: q (4 x 16), k (2 x 16), v (2 x 16)
    assert torch.equal(shards[1]["layers.0.attn.qkv_proj.weight"], torch.cat([qkv[32:64], qkv[80:96], qkv[112:128]]))
    for name, weight in state.items():
        parts = [s[name] for s in shards]
        if name.endswith("norm.weight"):
            assert all(torch.equal(p, weight) for p in parts)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), weight)
        else:
            assert sorted(torch.cat(parts).flatten().tolist()) == sorted(weight.flatten().tolist()), name


def _run(tp: int, prompts: list[str], **settings) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens for ``prompts`` and every logits tensor the sampler got, from a fresh engine of ``tp`` ranks."""
    llm = LLM(tensor_parallel_size=tp, cache_dtype="float32", num_blocks=64, prefill_compute_dtype="float32",
              **settings)  # TP N prefills in float32, so TP 1 does (auto would give it bf16 on an avx512_bf16 CPU)
    seen: list[torch.Tensor] = []
    llm.engine.runner.model.compute_logits = _recording(llm.engine.runner.model.compute_logits, seen)
    tokens = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    del llm
    gc.collect()  # stops the workers (weakref.finalize on rank 0's model)
    return tokens, seen


def _recording(compute_logits, seen: list[torch.Tensor]):
    def record(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(compute_logits(hidden))
        return seen[-1]

    return record


def _assert_same(reference, candidate):
    (tokens, logits), (tp_tokens, tp_logits) = reference, candidate
    assert tp_tokens == tokens
    assert len(tp_logits) == len(logits)
    for ours, theirs in zip(tp_logits, logits):
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def tiny_tp1():
    return _run(1, TINY_PROMPTS, model="tiny-random")


@pytest.mark.parametrize("tp", [2, 4], ids=["gqa-2-ranks", "4-ranks-2-kv-heads"])
@pytest.mark.e2e
def test_tiny_random_tp_matches_tp1(tiny_tp1, tp):
    _assert_same(tiny_tp1, _run(tp, TINY_PROMPTS, model="tiny-random"))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.e2e
def test_quantized_weights_split_on_block_boundaries(quantization):
    """Weights kept in quantized blocks (int8: one scale per output channel; int4: scale and minimum per block of
    32) split on block boundaries and give TP 1's products: the same tokens, logits within 1e-4."""
    reference = _run(1, TINY_PROMPTS, model="tiny-random", quantization=quantization)
    _assert_same(reference, _run(2, TINY_PROMPTS, model="tiny-random", quantization=quantization))


@pytest.mark.model
@pytest.mark.e2e
def test_smollm2_tp2_matches_tp1_in_float32():
    # The long prompt's prefill rows ([~130, 576] float32) go through the shared-memory all-reduce in two pieces.
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village by the sea, " * 10]
    _assert_same(_run(1, prompts, quantization="none"), _run(2, prompts, quantization="none"))


@pytest.mark.e2e
def test_killed_rank_fails_the_step_clearly_and_frees_its_blocks():
    llm = LLM(model="tiny-random", tensor_parallel_size=2, num_blocks=64)
    engine = llm.engine
    assert llm.generate("warm", GREEDY)[0].token_ids
    os.kill(engine.runner.model.plan_to.procs[0].pid, signal.SIGKILL)
    with pytest.raises(EngineStepError) as failed:
        llm.generate(TINY_PROMPTS, GREEDY)
    assert isinstance(failed.value.__cause__, TensorParallelError)
    assert "rank 1 exited with code -9" in str(failed.value.__cause__)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    del llm, engine
    gc.collect()


def test_what_tensor_parallelism_does_not_run_yet_is_refused():
    with pytest.raises(ValueError, match="would need NCCL, which is not built yet"):
        LLM(model="tiny-random", device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prefill_compute_dtype 'bfloat16' is not built for it yet"):
        LLM(model="tiny-random", prefill_compute_dtype="bfloat16", tensor_parallel_size=2)


@pytest.mark.e2e
def test_prompt_logprobs_and_speculative_verification_across_ranks():
    """The calls other than one decode row per sequence: prompt logprobs (logits of many prompt rows) and n-gram
    drafts verified as several rows per sequence."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    outputs = {}
    for tp in (1, 2):
        llm = LLM(model="tiny-random", tensor_parallel_size=tp, cache_dtype="float32", num_blocks=64,
                  prefill_compute_dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        outputs[tp] = llm.generate(TINY_PROMPTS, params)
        assert llm.engine.spec_decode.num_draft_tokens > 0
        del llm
        gc.collect()
    for one, two in zip(outputs[1], outputs[2]):
        assert two.token_ids == one.token_ids
        for theirs, ours in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def test_shared_memory_all_reduce_in_pieces_gives_every_rank_the_same_sum(tmp_path):
    """Two ranks as threads over one mapping: tensors of several slots (pieces) and calls alternating regions."""
    if not shm_all_reduce.available():
        pytest.skip("the shared-memory all-reduce is x86-64 only")
    path = shm_all_reduce.create_mapping(2)
    ranks = [shm_all_reduce.ShmAllReduce(path, r, 2, timeout_s=30) for r in range(2)]
    os.unlink(path)
    numel = 2 * shm_all_reduce.SLOT_BYTES // 4 + 5  # three pieces
    inputs = [[torch.randn(numel, generator=torch.Generator().manual_seed(10 * call + r)) for call in range(3)]
              for r in range(2)]
    outputs = [[x.clone() for x in xs] for xs in inputs]
    threads = [threading.Thread(target=lambda r=r: [ranks[r].all_reduce(x) for x in outputs[r]]) for r in range(2)]
    # Both ranks are threads of one interpreter here (processes in a pod): a rank spinning on the flags holds the
    # GIL a whole switch interval each time its peer needs it, which took 30-80 s on 2 cores and at times ran past
    # the ranks' timeout; a short interval makes it 2 s. One torch thread, as each rank process runs.
    threads_before, switch_before = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)
    sys.setswitchinterval(1e-5)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        torch.set_num_threads(threads_before)
        sys.setswitchinterval(switch_before)
    assert not any(t.is_alive() for t in threads), "a rank is still reducing after 60 s"
    for call in range(3):
        assert torch.equal(outputs[0][call], inputs[0][call] + inputs[1][call])
        assert torch.equal(outputs[1][call], outputs[0][call])


def _prefilled(engine, request_id: str, prompt: list[int]):
    seq = engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while seq.num_output_tokens == 0:
        engine.step()
    return seq


def _prompt_kv(engine, seq) -> torch.Tensor:
    """[layers, k/v, prompt tokens, Hkv, D] through the cache's interface for code outside the engine."""
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, seq.num_prompt_tokens)
    return torch.stack([torch.stack([cache.read(layer, kind, slots) for kind in ("k", "v")])
                        for layer in range(cache.num_layers)])


def _continue_from(engine, prompt: list[int], kv: torch.Tensor, first_token: int) -> list[int]:
    """What the decode pod does with a pushed prompt: reserve, write every layer's K and V, admit, decode."""
    seq = engine.reserve_for_transfer("pushed", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, len(prompt))
    for layer in range(cache.num_layers):
        for i, kind in enumerate(("k", "v")):
            cache.write(layer, kind, slots, kv[layer, i])
    engine.admit_prefilled(seq, first_token)
    while engine.has_unfinished_requests():
        engine.step()
    return seq.output_token_ids


@pytest.mark.e2e
def test_kv_moves_between_engines_of_different_tensor_parallel_sizes():
    """Outside the engine a TP 2 cache reads and writes every KV head, as TP 1's does: a prompt's KV read from one
    degree and written into the other continues as TP 1 does (P TP 1 -> D TP 2, P TP 2 -> D TP 1)."""
    settings = {"model": "tiny-random", "cache_dtype": "float32", "num_blocks": 64, "enable_prefix_caching": False,
                "prefill_compute_dtype": "float32"}
    one, two = LLM(tensor_parallel_size=1, **settings).engine, LLM(tensor_parallel_size=2, **settings).engine
    prompt = list(range(3, 40))
    seq_one, seq_two = _prefilled(one, "a", prompt), _prefilled(two, "a", prompt)
    kv_one, kv_two = _prompt_kv(one, seq_one), _prompt_kv(two, seq_two)
    assert kv_two.shape == kv_one.shape  # every KV head, not rank 0's
    assert (kv_two - kv_one).abs().max().item() <= 1e-5
    while one.has_unfinished_requests():
        one.step()
    reference = seq_one.output_token_ids
    assert _continue_from(two, prompt, kv_one, reference[0]) == reference
    assert _continue_from(one, prompt, kv_two, reference[0]) == reference
    assert two.block_manager.num_free_blocks == two.block_manager.num_blocks
    del one, two
    gc.collect()


class _LayerReader:
    """A prefill pod's KV export, reduced to its reads: each layer's K of the step's first sequence, once written."""

    def __init__(self, engine):
        self.engine, self.keys = engine, []

    def wants(self, batch) -> bool:
        return True

    def on_layer(self, layer: int, batch) -> None:
        seq = batch.scheduled[0].seq
        cache = self.engine.runner.kv_cache
        self.keys.append(cache.read(layer, "k", cache.slots(seq.block_table, 0, seq.num_prompt_tokens)))


@pytest.mark.e2e
def test_per_layer_export_reads_every_head_after_a_tensor_parallel_step():
    keys = {}
    for tp in (1, 2):
        llm = LLM(model="tiny-random", tensor_parallel_size=tp, cache_dtype="float32", num_blocks=64,
                  prefill_compute_dtype="float32")
        llm.engine.kv_export = reader = _LayerReader(llm.engine)
        llm.generate(list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=1))
        keys[tp] = reader.keys
        del llm, reader
        gc.collect()
    assert len(keys[2]) == len(keys[1]) == 4  # tiny-random's layers, each once
    for ours, theirs in zip(keys[2], keys[1]):
        assert ours.shape == theirs.shape and (ours - theirs).abs().max().item() <= 1e-5
