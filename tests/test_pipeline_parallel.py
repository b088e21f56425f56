"""Pipeline parallelism inside one engine (engine/parallel/pipeline.py): the micro-batch cut, and PP N against PP 1
end to end through the offline ``LLM`` (ranks as processes): the same greedy tokens in float32, every logit the
sampler saw within 1e-4 (a prompt cut into micro-batches attends to its earlier piece through the float32 cache,
in another order of sums: close, not the same bits)."""

from __future__ import annotations

import gc
from itertools import pairwise

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.parallel.pipeline import micro_batches

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello, my name is", "The capital of France", " ".join(str(i) for i in range(40))]


def test_micro_batches_cut_prompts_into_chunks_and_keep_decode_rows_whole():
    # a 10-row prompt with 3 tokens of context, two decode rows, a 6-row prompt; 4 micro-batches of ~4.5 rows
    meta = AttentionMetadata.build([10, 1, 1, 6], [13, 20, 7, 6], [[0], [1, 2], [3], [4]], 16)
    cut = micro_batches(meta, 4)
    rows = [r for r, _ in cut]
    assert rows[0][0] == 0 and rows[-1][1] == 18 and all(a[1] == b[0] for a, b in pairwise(rows))
    assert rows == [(0, 4), (4, 9), (9, 14), (14, 18)]
    query_lens, seq_lens, tables, block_size, _, open_blocks = cut[0][1]
    # the prompt's first rows over its 3 of context; block tables as the step padded them
    assert (query_lens, seq_lens, tables, block_size, open_blocks) == ([4], [7], [[0, 0]], 16, None)
    assert cut[1][1][:2] == ([5], [12])
    assert cut[2][1][:2] == ([1, 1, 1, 2], [13, 20, 7, 2])  # the prompt's last row (a one-row prefill), decodes
    assert cut[2][1][4] == frozenset({0})
    assert cut[3][1][:2] == ([4], [6])
    # A scaled pool's open blocks go with their rows: a cut prompt's later part reads its earlier keys from them.
    opened = micro_batches(AttentionMetadata.build([10, 1, 1, 6], [13, 20, 7, 6], [[0], [1, 2], [3], [4]], 16,
                                                   open_blocks=[5, 6, 7, 8]), 4)
    assert [plan[5] for _, plan in opened] == [[5], [5], [5, 6, 7, 8], [8]]


def _run(pp: int, model: str, prompts: list[str]) -> tuple[list[list[int]], list[torch.Tensor]]:
    llm = LLM(model=model, pipeline_parallel_size=pp, cache_dtype="float32", num_blocks=64,
              prefill_compute_dtype="float32", quantization="none")
    seen: list[torch.Tensor] = []
    compute_logits = llm.engine.runner.model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(compute_logits(hidden))
        return seen[-1]

    llm.engine.runner.model.compute_logits = record
    tokens = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    del llm.engine.runner.model.compute_logits  # the recorder held the model: it would outlive the collection
    del llm
    gc.collect()  # stops the workers, and gives this process its CPUs back (rank 0 pinned it to its share)
    return tokens, seen


def _assert_same(reference, candidate) -> None:
    (tokens, logits), (pp_tokens, pp_logits) = reference, candidate
    assert pp_tokens == tokens
    assert len(pp_logits) == len(logits)
    for ours, theirs in zip(pp_logits, logits):
        assert ours.shape == theirs.shape and (ours - theirs).abs().max().item() <= 1e-4


@pytest.mark.parametrize("pp", [2, 4], ids=["2-ranks", "one-layer-each"])
@pytest.mark.e2e
def test_tiny_random_pp_matches_pp1(pp):
    _assert_same(_run(1, "tiny-random", PROMPTS), _run(pp, "tiny-random", PROMPTS))


@pytest.mark.model
@pytest.mark.e2e
def test_smollm2_pp2_matches_pp1_in_float32():
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Once upon a time, in a small village by the sea, " * 10]
    _assert_same(_run(1, "smollm2-135m", prompts), _run(2, "smollm2-135m", prompts))


def test_what_pipeline_parallelism_does_not_run_is_refused():
    with pytest.raises(ValueError, match="both above 1 is not built"):
        EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be an integer in \[1, 4\]"):
        LLM(model="tiny-random", pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="prefill_compute_dtype 'bfloat16' is not built for it yet"):
        LLM(model="tiny-random", prefill_compute_dtype="bfloat16", pipeline_parallel_size=2)
