"""The model registry (engine/model/architectures/): every served architecture from a tiny random checkpoint that
``transformers`` builds and saves, through the offline ``LLM``, against ``transformers`` on the same weights; and the
architectures and configs that are refused at load, in one line.

Each checkpoint has 2 layers and its family's real head_dim and GQA ratio (Llama 3.2-1B: 64 and 4, tied, llama3 RoPE
scaling over a 128k context; Qwen2.5-0.5B: 64 and 7, tied; Qwen3-0.6B: 128 and 2, head_dim independent of the hidden
size, tied; Mistral-7B v0.3: 128 and 4, untied, no sliding window; SmolLM2: 64 and 3, the plain Llama path), a
vocabulary of 256 and a byte-level tokenizer. Everything computes in float32 over a float32 KV cache: prompt logprobs
within 1e-4 of transformers', greedy tokens identical over 32 steps, and a prompt's results the same bits alone, beside
other prompts and in chunks.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from tiny_checkpoints import (
    GREEDY_STEPS,
    PROMPT,
    TOLERANCE,
    VOCAB,
    Checkpoint,
    PrefillDecodeCluster,
    Shape,
    architecture_fixtures,
    check_export,
    check_greedy_tokens,
    check_prompt_logprobs,
    check_ranks_agree,
    check_same_bits,
    save_checkpoint,
    scored,
)

from splitserve.engine import LLM
from splitserve.engine.model.architectures import registry
from splitserve.engine.model.rotary import rope_inv_freq
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.weights.hf_checkpoint import load_hf_checkpoint

# Llama 3.2's scaling, over a short original context so that its three bands all fall within head_dim 64 at theta
# 500000 (with 8192, a test's positions would barely turn the scaled frequencies).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
# Phi-3-mini-128k's longrope, 32x over a short original context (the served one) that a test's prompts fill: one
# factor per frequency (short ones from 1 to 3.35, growing as Phi-3's), an attention factor sqrt(1 + ln 32 / ln 128).
PHI3_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(48)],
                 "long_factor": [4.0 + 0.5 * i for i in range(48)]}
SHAPES = {  # model type -> its tiny checkpoint's shape, the family's real head_dim and GQA
    "llama": Shape(transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                        intermediate_size=256, tie_word_embeddings=True, rope_theta=100000.0,
                        max_position_embeddings=2048)),
    "llama3": Shape(transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                         intermediate_size=384, tie_word_embeddings=True, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072)),
    "qwen2": Shape(transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                   dict(hidden_size=448, num_attention_heads=7, num_key_value_heads=1, intermediate_size=320,
                        tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=4096)),
    "qwen3": Shape(transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                   dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                        intermediate_size=256, tie_word_embeddings=True, rope_theta=1000000.0,
                        max_position_embeddings=4096)),
    "mistral": Shape(transformers.MistralConfig, transformers.MistralForCausalLM,
                     dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                          intermediate_size=384, tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=None,
                          max_position_embeddings=4096)),
    # Phi-3-mini's head_dim 96 and GQA 1; its dropouts set, which only training applies.
    "phi3": Shape(transformers.Phi3Config, transformers.Phi3ForCausalLM,
                  dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
                       tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=4096, sliding_window=None,
                       pad_token_id=None, resid_pdrop=0.1, embd_pdrop=0.1, attention_dropout=0.1)),
}
REAL_HEADS = {"llama": (64, 3), "llama3": (64, 4), "qwen2": (64, 7), "qwen3": (128, 2), "mistral": (128, 4),
              "phi3": (96, 1)}  # D, GQA
# Phi-3 with longrope: held to transformers by its own test (its RoPE tables are every entry's code path).
PHI3_LONGROPE_SHAPE = Shape(transformers.Phi3Config, transformers.Phi3ForCausalLM,
                            {**SHAPES["phi3"].config, "rope_scaling": PHI3_LONGROPE,
                             "original_max_position_embeddings": 128})


checkpoint, llm = architecture_fixtures(SHAPES)


def test_the_registry_entry_reads_the_checkpoint(checkpoint):
    config, state = load_hf_checkpoint(checkpoint.directory)
    hf = checkpoint.hf.config
    entry = registry.ARCHITECTURES[hf.model_type]
    assert config.architecture == hf.model_type and entry.hf_class == type(checkpoint.hf).__name__
    assert (config.head_dim, config.num_heads // config.num_kv_heads) == REAL_HEADS[checkpoint.name]
    assert config.qkv_bias is (hf.model_type == "qwen2") and config.qk_norm is (hf.model_type == "qwen3")
    if entry.fused_checkpoint:  # Phi-3's qkv_proj and gate_up_proj are the core's rows: taken whole
        layer = checkpoint.hf.model.layers[1]
        assert torch.equal(state["layers.1.attn.qkv_proj.weight"], layer.self_attn.qkv_proj.weight)
        assert torch.equal(state["layers.1.mlp.gate_up_proj.weight"], layer.mlp.gate_up_proj.weight)
    assert entry.fused_checkpoint is (hf.model_type == "phi3")
    assert config.tie_word_embeddings is hf.tie_word_embeddings
    assert (config.num_layers, config.vocab_size) == (2, VOCAB)
    assert ("layers.1.attn.q_norm.weight" in state) is config.qk_norm


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["default-path", "torch-path"])
def test_prompt_logprobs_match_transformers(checkpoint, cpu_kernels):
    check_prompt_logprobs(checkpoint, cpu_kernels=cpu_kernels)


def test_greedy_tokens_match_transformers_over_32_steps(checkpoint, llm):
    check_greedy_tokens(checkpoint, llm)


def test_a_prompt_gets_the_same_bits_alone_beside_others_in_chunks_and_from_the_prefix_cache(checkpoint, llm):
    """Each run on an engine of its own without prefix caching, but the last: the module's engine, which has run
    PROMPT before, so its blocks come from the prefix cache (asking no prompt logprobs, which are computed anew)."""
    check_same_bits(checkpoint, llm)


def test_weights_quantized_at_load_give_the_widened_weights_logprobs(checkpoint, native_kernels):
    """int8 weights (quantized at load; docs/quantization.md): the native products over the blocks give the logprobs
    of the same weights widened to float32 on the PyTorch path, and stay within int8's rounding of transformers."""
    native, widened = (scored(checkpoint.llm(quantization="int8", cpu_kernels=flag), [PROMPT], max_tokens=0)[0]
                       for flag in (True, False))
    reference = checkpoint.logprobs(PROMPT)
    for position in range(1, len(PROMPT)):
        ours, theirs = native.prompt_logprobs[position].logprob, widened.prompt_logprobs[position].logprob
        assert abs(ours - theirs) <= TOLERANCE
        assert abs(ours - reference[position - 1, PROMPT[position]].item()) <= 0.2  # measured 0.07-0.09


def test_llama3_rope_scaling_is_in_force():
    """The llama3 checkpoint's frequencies differ from unscaled RoPE's in all three bands (kept, interpolated,
    slowed), so its agreement with transformers tests the scaling itself."""
    hf = SHAPES["llama3"].hf_config().to_dict()
    config = registry.for_hf_config(hf, "llama3").model_config(hf, "llama3")
    assert config.rope_scaling == LLAMA3_ROPE and config.max_position_embeddings == 131072
    scaled = rope_inv_freq(config)
    unscaled = 1.0 / (config.rope_theta ** (torch.arange(0, 64, 2).float() / 64))
    ratio = scaled / unscaled
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(1 / 32) and ((ratio < 1) & (ratio > 1 / 32)).any()


def test_phi3_longrope_matches_transformers_within_its_original_context(tmp_path):
    """The longrope checkpoint's frequencies are the short factors' (not unscaled RoPE's) and its cos and sin carry
    the attention factor transformers computes, and its prompt logprobs are transformers' within 1e-4; its context is
    capped at the original 128 tokens, past which transformers recomputes every position with the long factors (its
    logits of the first 128 tokens change once a 129th is there), and a longer prompt is refused in one line. A
    config as the hub writes it (``rope_scaling`` type ``su``, the original context at the top) reads the same."""
    from splitserve.engine.model.rotary import rope_attention_factor

    checkpoint = Checkpoint(tmp_path, PHI3_LONGROPE_SHAPE)
    (out,) = scored(checkpoint.llm(), [PROMPT], max_tokens=0)
    reference = checkpoint.logprobs(PROMPT)
    assert max(abs(out.prompt_logprobs[p].logprob - reference[p - 1, PROMPT[p]].item())
               for p in range(1, len(PROMPT))) <= TOLERANCE
    config, _ = load_hf_checkpoint(checkpoint.directory)
    assert config.max_position_embeddings == 128 and config.rope_scaling["factor"] == 32
    assert rope_attention_factor(config) == pytest.approx(checkpoint.hf.model.rotary_emb.attention_scaling, abs=0)
    assert rope_attention_factor(config) == pytest.approx((1 + math.log(32) / math.log(128)) ** 0.5)
    assert torch.equal(rope_inv_freq(config), checkpoint.hf.model.rotary_emb.inv_freq)  # before a long forward
    unscaled = 1.0 / (config.rope_theta ** (torch.arange(0, 96, 2).float() / 96))
    assert torch.allclose(unscaled / rope_inv_freq(config), torch.tensor(PHI3_LONGROPE["short_factor"]), rtol=1e-6)
    tokens = [(7 * k + 1) % VOCAB for k in range(129)]
    with torch.no_grad():
        within, past = (checkpoint.hf(torch.tensor([t])).logits[0, :128] for t in (tokens[:128], tokens))
    assert (within - past).abs().max() > 0.1
    with pytest.raises(ValueError, match="the model's context is 128"):
        checkpoint.llm().generate([tokens[:128]], SamplingParams(max_tokens=1))
    hub = {**PHI3_LONGROPE_SHAPE.hf_config().to_dict(), "rope_parameters": None, "rope_theta": 10000.0,
           "rope_scaling": {"type": "su", **{k: PHI3_LONGROPE[k] for k in ("short_factor", "long_factor")}}}
    read = registry.for_hf_config(hub, "hub").model_config(hub, "hub")
    assert (read.max_position_embeddings, rope_attention_factor(read)) == (128, rope_attention_factor(config))
    assert torch.equal(rope_inv_freq(read), rope_inv_freq(config))


def test_every_entry_runs_the_fused_native_layers_and_the_bf16_prefill(checkpoint, llm, native_kernels):
    """Every entry's layers run the fused native calls (Qwen3's per-head q/k norms inside ``ss_attention_input``,
    before RoPE), decode steps the one-call native decode, and ``auto`` prefills in bf16 where the CPU has the
    kernels for it."""
    model = llm.engine.runner.model
    assert model.kernels is native_kernels
    assert all(layer.kernels is native_kernels for layer in model.layers)
    assert checkpoint.llm(prefill_compute_dtype="auto").engine.runner.model.prefill_dtype == (
        "bfloat16" if _has_bf16_kernels(native_kernels) else "float32")


def _has_bf16_kernels(kernels) -> bool:
    from splitserve.engine.kernels import bf16_kernels
    from splitserve.engine.kernels.build import KernelsUnavailable
    from splitserve.engine.kernels.cpu_features import prefill_compute_dtype

    try:
        bf16_kernels.choose(kernels)
    except KernelsUnavailable:
        return False
    return prefill_compute_dtype("auto", "cpu") == "bfloat16"


# ---- what is refused ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["phi4_multimodal", "deepseek_v3", "llava", "t5"])
def test_an_unserved_architecture_is_refused_in_one_line_naming_the_served_ones(tmp_path, model_type):
    transformers.AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(registry.UnsupportedArchitecture) as refused:
        LLM(model=str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and f"unsupported architecture {model_type!r}" in message
    assert f"serves model types {', '.join(sorted(registry.ARCHITECTURES))}" in message


def test_splitserve_up_refuses_an_unserved_architecture_before_starting_anything(tmp_path):
    """``splitserve up --model DIR`` checks the checkpoint's config when its config is built: one usage line, where
    otherwise every pod would fail its start with a traceback."""
    from splitserve.up_config import UpConfig

    transformers.AutoConfig.for_model("t5").save_pretrained(tmp_path / "t5")
    served = f"serves model types {', '.join(sorted(registry.ARCHITECTURES))}"
    with pytest.raises(registry.UnsupportedArchitecture, match=served):
        UpConfig(model=str(tmp_path / "t5"), run_dir=str(tmp_path / "up"))
    save_checkpoint(tmp_path / "qwen3", SHAPES["qwen3"])
    assert UpConfig(model=str(tmp_path / "qwen3"), run_dir=str(tmp_path / "up")).model == str(tmp_path / "qwen3")


@pytest.mark.parametrize("model_type, overrides, named", [
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}),
     "unsupported rope scaling type 'yarn'"),
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("phi3", dict(partial_rotary_factor=0.75), "partial_rotary_factor 0.75"),  # Phi-4-mini's
])
def test_a_config_asking_for_what_is_not_built_is_refused_at_load(tmp_path, model_type, overrides, named):
    SHAPES[model_type].hf_config(**overrides).save_pretrained(tmp_path)  # refused before any weight is read
    with pytest.raises(ValueError, match=named) as refused:
        load_hf_checkpoint(tmp_path)
    assert "\n" not in str(refused.value) and "is not supported" in str(refused.value)


def test_a_mistral_window_as_long_as_the_context_is_full_attention(tmp_path):
    SHAPES["mistral"].hf_config(sliding_window=4096).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):  # accepted: it goes on to read the weights
        load_hf_checkpoint(tmp_path)


def test_gguf_architectures_go_through_the_registry():
    assert registry.for_gguf("qwen3", "f.gguf").qk_norm and registry.for_gguf("llama", "f.gguf").gguf_qk_permuted
    assert not registry.for_gguf("qwen2", "f.gguf").gguf_qk_permuted
    assert registry.for_gguf("llama", "f.gguf", experts=True).model_type == "mixtral"
    with pytest.raises(registry.UnsupportedArchitecture, match="unsupported GGUF architecture 'gemma2'.*llama, "
                                                               "llama with experts, phi3, qwen2, qwen3, qwen3moe "
                                                               "with experts"):
        registry.for_gguf("gemma2", "f.gguf")


def test_export_writes_the_architecture_it_was_loaded_as(tmp_path, checkpoint):
    check_export(checkpoint, tmp_path)


# ---- parallelism -----------------------------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("model_type", ["qwen3", "mistral", "qwen2", "phi3"])
def test_tensor_and_pipeline_parallel_ranks_give_one_process_answer(tmp_path, model_type):
    """2 ranks (the second a process of its own) against 1, tensor- or pipeline-parallel. Tensor: Qwen3's q/k norm
    weights are replicated and each rank normalizes its own heads (2 query heads, 1 KV head each); Mistral's one KV
    head is on both ranks, its 4 query heads split 2 + 2; Qwen2's one KV head too, its 7 query heads split unevenly,
    4 + 3, with their QKV bias rows; Phi-3's fused checkpoint tensors cut per rank, a KV head each (head_dim 96).
    llama (3 query heads over 1 KV head: 2 + 1) and llama3 (4 over 1) have layouts these already carry. Pipeline: a
    layer per rank. The same greedy tokens, prompt logprobs within 1e-4 (the row-parallel sums round in another
    order)."""
    check_ranks_agree(Checkpoint(tmp_path, SHAPES[model_type]), {"tensor_parallel_size": 2},
                      {"pipeline_parallel_size": 2})


# ---- disaggregated ---------------------------------------------------------------------------------------------------

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
CHAT = [{"role": "user", "content": "Name the three primary colours."}]


@pytest.mark.e2e
@pytest.mark.parametrize("model_type, pool", [(m, pool) for m in SHAPES for pool in ("float16", "int8")])
def test_a_prefill_and_a_decode_pod_answer_as_the_offline_engine(tmp_path, start_cluster, model_type, pool):
    """``splitserve up --model DIR`` of each checkpoint with one prefill and one decode pod: every prompt prefills on
    the prefill pod, its KV crosses to the decode pod, and the greedy tokens are the offline engine's with the same
    pool; so are the texts the ``openai`` client gets from the router's HTTP API, a completion and a chat completion
    (the tiny tokenizer has no chat template: the test writes one); every block is free after. Pools of float16 (the
    pods' default; the push lossless) and of int8, lossy (its rows cross as they lie: the answers are the offline int8
    engine's, token for token, where a lossy codec between float16 pools would have no offline engine to equal)."""
    checkpoint = Checkpoint(tmp_path / model_type, SHAPES[model_type])
    (checkpoint.directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    with PrefillDecodeCluster(start_cluster, tmp_path / "up", checkpoint, cache_dtype=pool) as up:
        (offline_chat,) = up.engine.chat(CHAT, up.params)
        chat = up.client.chat.completions.create(model=up.model, messages=CHAT, max_tokens=GREEDY_STEPS, **up.greedy)
        assert chat.choices[0].message.content == offline_chat.text and offline_chat.text
