"""Every served architecture through the engine's other paths (issue 47), on test_model_registry's tiny random
checkpoints (``SHAPES``: llama, llama3, qwen2, qwen3, mistral, phi3): speculative decoding (prompt lookup, and the
checkpoint as its own draft model), a JSON-schema-constrained generation, int4 weights quantized at load, and a GGUF
file of Q8_0 blocks written as llama.cpp's converter writes each family.

The paths are architecture-agnostic in their code (they run on the model's logits, or on its linear layers' weights),
so each check is the cheapest that would fail if an entry's shape broke them: exact greedy tokens with proposals
accepted, a schema-valid answer where the unconstrained one is not JSON, the quantized products against the same
weights widened.
"""

from __future__ import annotations

import json

import pytest
from test_model_registry import SHAPES
from tiny_checkpoints import GREEDY_STEPS, PROMPT, TOLERANCE, Checkpoint, scored

from splitserve.engine.sampling.params import SamplingParams, StructuredOutput

# Every step proposes 4 tokens (never fewer), looked up from a single matching token on: many drafts verified, some
# rejected on a random model.
FIXED_K = {"num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return Checkpoint(tmp_path_factory.mktemp(request.param), SHAPES[request.param], request.param)


@pytest.fixture(scope="module")
def plain(checkpoint):
    """The checkpoint's greedy tokens for PROMPT without speculation (the native path)."""
    return scored(checkpoint.llm(), [PROMPT], prompt_logprobs=None, logprobs=None)[0].token_ids


# ---- speculative decoding -------------------------------------------------------------------------------------------

def test_prompt_lookup_speculation_gives_the_plain_greedy_tokens(checkpoint, plain):
    llm = checkpoint.llm(speculative_config={"method": "ngram", **FIXED_K})
    (out,) = scored(llm, [PROMPT], prompt_logprobs=None, logprobs=None)
    assert out.token_ids == plain
    counts = llm.engine.spec_decode
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens  # verified: some accepted, some rejected
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_the_checkpoint_as_its_own_draft_model_has_every_draft_accepted(checkpoint, plain):
    """The draft is the target (the same directory, so the same weights): it proposes the target's own tokens, so
    every draft is accepted as long as the draft's paged KV and its catch-up are right for this architecture."""
    llm = checkpoint.llm(speculative_config={"method": "draft", "model": str(checkpoint.directory), **FIXED_K})
    (out,) = scored(llm, [PROMPT], prompt_logprobs=None, logprobs=None)
    assert out.token_ids == plain
    counts = llm.engine.spec_decode
    assert counts.num_draft_tokens >= GREEDY_STEPS // 2 and counts.num_accepted_tokens == counts.num_draft_tokens


# ---- structured output ----------------------------------------------------------------------------------------------

# Every value bounded (a boolean, an enum, an integer of at most two digits), so a random model's greedy answer ends
# within max_tokens: its only freedom is the whitespace (at most 20 in a row, grammar.py, in some 14 places: 280
# tokens) and which value it picks (41 characters at most). Measured: 93-228 tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "colour", "count"],
          "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_a_json_schema_constrained_answer_parses_and_validates(checkpoint):
    """The byte-level tokenizer has every character JSON needs (printable ASCII, space and newline: only bytes 0xa0
    and 0xad are past its 254 byte tokens) and EOS, so the schema is reachable token by token."""
    import jsonschema

    llm = checkpoint.llm()
    params = SamplingParams(temperature=0.0, max_tokens=384,
                            structured_output=StructuredOutput(json=json.dumps(SCHEMA)))
    free, constrained = (llm.generate([PROMPT], p)[0] for p in (
        SamplingParams(temperature=0.0, max_tokens=64), params))
    with pytest.raises(ValueError):  # the random model alone writes no JSON: the constraint made the answer
        json.loads(free.text)
    assert constrained.finish_reason == "stop"
    jsonschema.validate(json.loads(constrained.text), SCHEMA)


# ---- quantized weights ----------------------------------------------------------------------------------------------

def test_int4_weights_quantized_at_load_give_the_widened_weights_logprobs(checkpoint, native_kernels):
    """int4 (Q4_1 blocks of 32, the head at Q8_0; docs/quantization.md): the native products over the blocks give the
    logprobs of the same weights widened to float32 on the PyTorch path, and stay within int4's rounding of
    transformers."""
    native, widened = (scored(checkpoint.llm(quantization="int4", cpu_kernels=flag), [PROMPT], max_tokens=0)[0]
                       for flag in (True, False))
    reference = checkpoint.logprobs(PROMPT)
    distance = 0.0
    for position in range(1, len(PROMPT)):
        ours, theirs = native.prompt_logprobs[position].logprob, widened.prompt_logprobs[position].logprob
        assert abs(ours - theirs) <= TOLERANCE
        distance = max(distance, abs(ours - reference[position - 1, PROMPT[position]].item()))
    assert 0 < distance <= 1.0, distance


# ---- a GGUF file's quantized blocks ---------------------------------------------------------------------------------

GGUF_ARCH = {"llama": "llama", "llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "phi3": "phi3"}  # llama.cpp's convert_hf_to_gguf writes Mistral as llama


def write_gguf_q8_0(path, checkpoint: Checkpoint, rope_freqs=None) -> None:
    """The checkpoint as llama.cpp's converter writes it: its hyperparameters under the family's GGUF name (the
    head_dim as ``key_length``), Q/K rows permuted for ``llama``, every matrix in Q8_0 blocks (norms and biases in
    F32), ``output.weight`` only when untied, and the byte-level vocabulary as a ``gpt2`` token list."""
    import gguf
    import numpy as np
    from test_weights import _gguf_fused_names, _gguf_tensor_names, llama_cpp_permute
    from tokenizers import Tokenizer

    from splitserve.engine.text.byte_tokenizer import SPECIAL_TOKENS

    hf, arch = checkpoint.hf.config, GGUF_ARCH[checkpoint.name]
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_context_length(hf.max_position_embeddings)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_vocab_size(hf.vocab_size)
    vocab = json.loads(Tokenizer.from_file(str(checkpoint.directory / "tokenizer.json")).to_str())["model"]["vocab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(sorted(vocab, key=vocab.get))
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in sorted(vocab, key=vocab.get)])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    state = checkpoint.hf.state_dict()
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not hf.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(hf.num_hidden_layers):
        for gguf_names in (_gguf_tensor_names(i), _gguf_fused_names(i)):
            names.update({g: h for g, h in gguf_names.items() if h in state})
    for gguf_name, hf_name in names.items():
        w = state[hf_name].numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in gguf_name:
            w = llama_cpp_permute(w, hf.num_attention_heads)
        if arch == "llama" and ".attn_k." in gguf_name:
            w = llama_cpp_permute(w, hf.num_key_value_heads)
        if w.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, w)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_of_q8_0_blocks_gives_the_widened_weights_logprobs(checkpoint, tmp_path, native_kernels):
    """The engine keeps the file's Q8_0 blocks (``quantization="gguf"``) and its native products over them give the
    same weights widened to float32 (``none``) the same logprobs, bit for bit (docs/quantization.md); those stay
    within Q8_0's rounding of transformers on the checkpoint the file was written from, so the file was read as this
    architecture (the llama permutation undone, the fused phi3 tensors, the qwen2 biases and qwen3 norms in place).
    Llama 3's scaling is written by llama.cpp as per-dimension factors (``rope_freqs``), which are refused in one
    line."""
    import torch

    path = tmp_path / f"{checkpoint.name}.gguf"
    if checkpoint.name == "llama3":
        from splitserve.engine.model.rotary import rope_inv_freq
        from splitserve.engine.weights.hf_checkpoint import load_hf_checkpoint

        config, _ = load_hf_checkpoint(checkpoint.directory)
        unscaled = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        write_gguf_q8_0(path, checkpoint, rope_freqs=(unscaled / rope_inv_freq(config)).numpy())
        with pytest.raises(ValueError, match="per-dimension RoPE factors .* are not supported") as refused:
            checkpoint_llm(path)
        assert "\n" not in str(refused.value)
        return
    write_gguf_q8_0(path, checkpoint)
    blocks, widened = (checkpoint_llm(path, quantization=q) for q in ("gguf", "none"))
    runner = blocks.engine.runner.model
    assert runner.layers[0].mlp.down_proj.weight_format == "q8_0"
    assert widened.engine.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    ours, theirs = (scored(llm, [PROMPT], max_tokens=0)[0] for llm in (blocks, widened))
    assert ours.prompt_logprobs == theirs.prompt_logprobs
    reference = checkpoint.logprobs(PROMPT)
    distance = max(abs(ours.prompt_logprobs[p].logprob - reference[p - 1, PROMPT[p]].item())
                   for p in range(1, len(PROMPT)))
    assert 0 < distance <= 0.2, distance


def checkpoint_llm(path, **settings):
    from splitserve.engine import LLM

    return LLM(model=str(path), num_blocks=64, block_size=16, cache_dtype="float32", prefill_compute_dtype="float32",
               **settings)
