"""The offline LLM on the real SmolLM2-135M-Instruct weights against transformers on the same weights.

Both run from one set of weights: ours are dequantized from the GGUF file, exported as a HF checkpoint, and loaded by
transformers, whose greedy choice is the reference, token for token: with the engine's default float16 KV cache and with
a float32 one, prefill in float32. transformers reads each prompt with our whole continuation in one forward pass and
picks its greedy token at every position of it: those picks are our continuation exactly when its greedy ``generate``
(the same picks over the same prefixes, one forward per token, up to the rounding of a cached forward against an
uncached one) would write our continuation, and 32 forwards per prompt are one.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.weights.hf_checkpoint import export_hf_checkpoint
from splitserve.engine.weights.model_files import load_model_files

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Translate to French: 'Good morning, how are you?'",
    "1, 2, 3, 5, 8, 13,",
    "Photosynthesis is the process by which",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\nx = np.",
    "In 1969, Neil Armstrong",
    "The quick brown fox",
    "Les montagnes les plus hautes d'Europe sont",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_reference(smollm2, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("smollm2-hf")
    # The same file's weights widened to float32 (the session's engine keeps the file's blocks: the same model).
    export_hf_checkpoint(smollm2.engine.model_config, load_model_files("smollm2-135m", quantization="none").state_dict,
                         directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def transformers_greedy(hf_reference, prompt_ids: list[int], continuation: list[int]) -> list[int]:
    """transformers' greedy token after the prompt and after each prefix of ``continuation`` (one forward pass)."""
    ids = torch.tensor([prompt_ids + continuation[:-1]])
    with torch.inference_mode():
        logits = hf_reference(ids).logits[0, len(prompt_ids) - 1:]
    return logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("cache_dtype", ["float16", "float32"])
def test_greedy_matches_transformers_token_for_token(cache_dtype, smollm2, hf_reference):
    assert smollm2.engine.config.cache.cache_dtype == "float16"  # the default engine's cache
    # Prefill in float32, the bit-exact reference (auto's bf16 prefill is held to its agreement with float32 in
    # tests/test_bf16_prefill_smollm2.py).
    llm = LLM(model="smollm2-135m", kv_cache_memory_bytes=256 << 20, cache_dtype=cache_dtype,
              prefill_compute_dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ours = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, ours):
        assert out.prompt_token_ids == smollm2.tokenizer.encode(prompt)
        assert len(out.token_ids) == NEW_TOKENS
        assert out.token_ids == transformers_greedy(hf_reference, out.prompt_token_ids, out.token_ids), prompt


def test_chat_names_paris(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.text.strip().endswith(".")
