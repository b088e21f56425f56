"""bf16 prefill on the real SmolLM2-135M against float32 (issue 34's answer contract): teacher-forced top-1
agreement over three prompts and the 128 tokens float32 generates greedily from each (target >= 99%), and the perplexity
of GPL-3's text (the codec benchmark's, Debian ships it) within +0.5% of float32's. Both formats compute every
position of a sequence as one prefill, logits float32; the K/V are stored in the pods' default cache dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.kv_cache import PagedKVCache

pytestmark = pytest.mark.model

BLOCK = 16
GENERATED = 128
REFERENCE_TEXT = Path("/usr/share/common-licenses/GPL-3")
WINDOW = 1024  # tokens per perplexity window
WINDOWS = 2
# Three chat prompts: one prompt's ~170 positions is too few to tell 99% from 98% (a few near-ties decide it).
QUESTIONS = ("Explain how a CPU cache works, step by step, for a new engineer.",
             "Write a short story about a lighthouse keeper.", "What are the main causes of inflation?")


@pytest.fixture(scope="module")
def engines():
    """float32 and bf16 prefill on the same weights (the GGUF's blocks for decode)."""
    return (LLM(model="smollm2-135m", kv_cache_memory_bytes=64 << 20, prefill_compute_dtype="float32"),
            LLM(model="smollm2-135m", kv_cache_memory_bytes=64 << 20, prefill_compute_dtype="bfloat16"))


@torch.inference_mode()
def _logits(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """Every position's next-token logits [n, V] float32, the sequence run as one prefill on a cache of its own."""
    model = llm.engine.runner.model
    n = len(tokens)
    blocks = -(-n // BLOCK)
    cache = PagedKVCache(model.config, blocks, BLOCK, "float16")
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], BLOCK)
    hidden = model(torch.tensor(tokens), torch.arange(n), cache, meta)
    return model.compute_logits(hidden)


def test_bf16_prefill_agrees_with_float32_teacher_forced(engines):
    f32, bf16 = engines
    assert (f32.engine.runner.model.prefill_dtype, bf16.engine.runner.model.prefill_dtype) == ("float32", "bfloat16")
    prompts = [f32.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    greedy = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True)
    references = f32.generate(prompts, greedy)
    served = bf16.generate(prompts, greedy)  # bf16 prefill, then decode on the file's blocks
    agree, positions, same = 0, 0, []
    for reference, mine in zip(references, served):
        assert len(reference.token_ids) == GENERATED
        sequence = reference.prompt_token_ids + reference.token_ids
        agree += int((_logits(f32, sequence).argmax(-1) == _logits(bf16, sequence).argmax(-1)).sum())
        positions += len(sequence)
        same.append(next((i for i, (a, b) in enumerate(zip(mine.token_ids, reference.token_ids)) if a != b),
                         GENERATED))
    print(f"teacher-forced top-1 agreement {agree / positions:.2%} over {positions} positions of {len(prompts)} "
          f"prompts; greedy tokens identical for the first {same} of {GENERATED}")
    assert agree / positions >= 0.99


def test_bf16_prefill_perplexity_within_half_a_percent(engines):
    f32, bf16 = engines
    if not REFERENCE_TEXT.is_file():
        pytest.skip(f"{REFERENCE_TEXT} is missing (Debian's base-files ships it)")
    tokens = f32.tokenizer.encode(REFERENCE_TEXT.read_text())[: WINDOW * WINDOWS]

    def perplexity(llm: LLM) -> float:
        nll = [torch.nn.functional.cross_entropy(_logits(llm, w)[:-1], torch.tensor(w[1:]))
               for w in (tokens[i: i + WINDOW] for i in range(0, len(tokens), WINDOW))]
        return torch.stack(nll).mean().exp().item()

    reference, got = perplexity(f32), perplexity(bf16)
    change = got / reference - 1
    print(f"perplexity float32 {reference:.4f}, bf16 prefill {got:.4f}: {change:+.3%}")
    assert change <= 0.005
