"""Gemma 2 and Gemma 3's text model (engine/model/architectures/gemma.py), and the sliding-window attention they
need (engine/model/attention.py), from tiny random checkpoints that ``transformers`` builds and saves, through the
offline ``LLM``, against ``transformers`` (eager attention) on the same weights.

Each checkpoint has local (sliding-window) and global layers, the family's real head_dim (256) and GQA ratio (Gemma 2
2B: 8 heads over 4 KV heads; Gemma 3 1B: 4 over 1), a window of 16 tokens, well under the 40-token prompt, and tied
embeddings. Gemma 2: 2 layers, local then global (its alternation), with its score and logit soft-caps; Gemma 3: 3
layers, local, local, global (its 5:1 pattern cut short), q/k norms, the local RoPE base 10000 and the global 1e6
with linear scaling by 8 (the 4B+ models'). Everything computes in float32 over a float32 KV cache.

The harness draws norm weights around 1 (``save_checkpoint``), so Gemma's norms scale by about 2 (1 + w): the
logprobs' spread is asserted at every position, as for the other architectures.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from tiny_checkpoints import (
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
    scored,
)

from splitserve.engine import LLM
from splitserve.engine.model.architectures import registry
from splitserve.engine.model.layers import fused_layers_refusal
from splitserve.engine.weights.hf_checkpoint import load_hf_checkpoint

WINDOW = 16


class LayeredShape(Shape):
    """A ``Shape`` whose config states its own layer count (the harness's is 2), so that Gemma 3 has two local layers
    before its global one."""

    def hf_config(self, **overrides):
        return self.config_cls(**copy.deepcopy({**self.config, **overrides}), vocab_size=VOCAB, rms_norm_eps=1e-6,
                               bos_token_id=0, eos_token_id=1, attn_implementation="eager")


GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
SHAPES = {
    "gemma2": LayeredShape(transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                           dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                intermediate_size=384, num_hidden_layers=2, sliding_window=WINDOW,
                                query_pre_attn_scalar=256, max_position_embeddings=4096)),
    "gemma3_text": LayeredShape(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
                                dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                     intermediate_size=384, num_hidden_layers=3, sliding_window=WINDOW,
                                     query_pre_attn_scalar=256, max_position_embeddings=4096,
                                     layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                     rope_parameters=GEMMA3_ROPE)),
}
WINDOWS = {"gemma2": (WINDOW, None), "gemma3_text": (WINDOW, WINDOW, None)}
GQA = {"gemma2": 2, "gemma3_text": 4}


checkpoint, llm = architecture_fixtures(SHAPES)


def test_the_entry_reads_the_checkpoint(checkpoint):
    config, state = load_hf_checkpoint(checkpoint.directory)
    hf = checkpoint.hf
    assert config.architecture == checkpoint.name and registry.ARCHITECTURES[checkpoint.name].hf_class == \
        type(hf).__name__
    assert (config.head_dim, config.num_heads // config.num_kv_heads) == (256, GQA[checkpoint.name])
    assert config.layer_windows == WINDOWS[checkpoint.name] and config.tie_word_embeddings
    assert config.hidden_act == "gelu_pytorch_tanh" and config.attention_scale == 256**-0.5
    assert config.scale_embeddings and config.sandwich_norms and config.qk_norm is (checkpoint.name == "gemma3_text")
    if checkpoint.name == "gemma2":
        assert (config.attn_logit_softcap, config.final_logit_softcap, config.local_rope_theta) == (50.0, 30.0, None)
    else:
        assert (config.attn_logit_softcap, config.final_logit_softcap) == (None, None)
        assert (config.rope_theta, config.local_rope_theta) == (1e6, 1e4)
        assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    # Gemma's norms scale by 1 + w: folded into the weights, the attention output's and the MLP's norms by name.
    layer = hf.model.layers[1]
    assert torch.equal(state["layers.1.attn_out_norm.weight"], 1.0 + layer.post_attention_layernorm.weight)
    assert torch.equal(state["layers.1.post_attn_norm.weight"], 1.0 + layer.pre_feedforward_layernorm.weight)
    assert torch.equal(state["layers.1.mlp_out_norm.weight"], 1.0 + layer.post_feedforward_layernorm.weight)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["default-path", "torch-path"])
def test_prompt_logprobs_match_transformers(checkpoint, cpu_kernels):
    check_prompt_logprobs(checkpoint, cpu_kernels=cpu_kernels)


def test_the_window_and_the_local_rope_matter(checkpoint):
    """Full attention in every layer (the same weights, a window past the prompt) gives other logprobs once the
    prompt outgrows the window, and only then: the engine's agreement with transformers tests the window. Gemma 3's
    local layers rotated with the global base give others too."""
    windowed = checkpoint.logprobs(PROMPT)
    variants = [dict(sliding_window=4096)]
    if checkpoint.name == "gemma3_text":
        variants.append(dict(rope_parameters={**GEMMA3_ROPE, "sliding_attention": GEMMA3_ROPE["full_attention"]}))
    for overrides in variants:
        other = SHAPES[checkpoint.name].model_cls(SHAPES[checkpoint.name].hf_config(**overrides)).eval()
        other.load_state_dict(checkpoint.hf.state_dict())
        with torch.no_grad():
            changed = torch.log_softmax(other(torch.tensor([PROMPT])).logits[0].double(), -1).float()
        gap = (changed - windowed).abs().amax(dim=-1)
        if "sliding_window" in overrides:
            assert gap[:WINDOW].max() < TOLERANCE  # no query has outgrown the window yet
        assert gap[WINDOW:].min() > 10 * TOLERANCE, overrides


def test_greedy_tokens_match_transformers_over_32_steps(checkpoint, llm):
    check_greedy_tokens(checkpoint, llm)


def test_a_prompt_gets_the_same_bits_alone_beside_others_in_chunks_and_from_the_prefix_cache(checkpoint, llm):
    """As for every architecture (test_model_registry.py), on the default path: the windowed and soft-capped layers
    attend in PyTorch, each query over its own keys padded to a length its position sets, so nothing beside it, no
    chunking and no cached prefix changes its bits."""
    check_same_bits(checkpoint, llm)


def test_the_fused_native_layers_are_refused_with_their_reason(checkpoint, llm, native_kernels):
    """The native kernels run every product, but the layers compose in PyTorch around them: the fused calls have no
    window, soft-cap, GeGLU or output norms. Gemma 3's global layers keep the native paged attention."""
    model = llm.engine.runner.model
    assert model.kernels is native_kernels and model.embed_tokens.kernels is native_kernels
    assert "sliding windows" in fused_layers_refusal(model.config)
    assert all(layer.kernels is None for layer in model.layers)
    assert [layer.attn.window for layer in model.layers] == list(WINDOWS[checkpoint.name])
    assert checkpoint.llm(prefill_compute_dtype="auto").engine.runner.model.prefill_dtype == "float32"


def test_weights_quantized_at_load_give_the_widened_weights_logprobs(checkpoint, native_kernels):
    """int8 weights (quantized at load): the native products over the blocks give the logprobs of the same weights
    widened to float32 on the PyTorch path (measured 1.5e-5; from transformers, int8's rounding: 0.3 to 0.5)."""
    native, widened = (scored(checkpoint.llm(quantization="int8", cpu_kernels=flag), [PROMPT], max_tokens=0)[0]
                       for flag in (True, False))
    for position in range(1, len(PROMPT)):
        assert abs(native.prompt_logprobs[position].logprob - widened.prompt_logprobs[position].logprob) <= TOLERANCE


def test_export_writes_gemma_back(tmp_path, checkpoint):
    check_export(checkpoint, tmp_path)


# ---- the same windows for other architectures ---------------------------------------------------------------------

WINDOWED = {  # Mistral v0.1, Mixtral and Phi-3 window every layer; Qwen2 (as Qwen3) those from max_window_layers
    "mistral": (Shape(transformers.MistralConfig, transformers.MistralForCausalLM,
                      dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                           intermediate_size=384, tie_word_embeddings=False, rope_theta=1000000.0,
                           sliding_window=WINDOW, max_position_embeddings=4096)), (WINDOW, WINDOW)),
    "qwen2": (Shape(transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                    dict(hidden_size=448, num_attention_heads=7, num_key_value_heads=1, intermediate_size=320,
                         tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=4096,
                         use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)), (None, WINDOW)),
    "mixtral": (Shape(transformers.MixtralConfig, transformers.MixtralForCausalLM,
                      dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                           intermediate_size=128, num_local_experts=4, num_experts_per_tok=2,
                           tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=WINDOW,
                           max_position_embeddings=4096)), (WINDOW, WINDOW)),
    "phi3": (Shape(transformers.Phi3Config, transformers.Phi3ForCausalLM,  # Phi-3-mini-4k's 2047 of 4096, shrunk
                   dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
                        tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=4096,
                        sliding_window=WINDOW, pad_token_id=None)), (WINDOW, WINDOW)),
}


@pytest.mark.parametrize("model_type", list(WINDOWED))
def test_other_architectures_sliding_windows_are_served_as_transformers_computes_them(tmp_path, model_type):
    """What the registry refused before Gemma's windows: Mistral v0.1's, Mixtral's and Phi-3-4k's windows and Qwen2's
    sliding layers, within 1e-4 of transformers past the window, where full attention differs by far more; the same
    bits in chunks."""
    shape, windows = WINDOWED[model_type]
    checkpoint = Checkpoint(tmp_path, shape, model_type)
    assert load_hf_checkpoint(tmp_path)[0].layer_windows == windows
    (out,) = scored(checkpoint.llm(enable_prefix_caching=False), [PROMPT], max_tokens=4)
    (chunked,) = scored(checkpoint.llm(long_prefill_token_threshold=8), [PROMPT], max_tokens=4)
    assert (chunked.prompt_logprobs, chunked.logprobs) == (out.prompt_logprobs, out.logprobs)
    reference = checkpoint.logprobs(PROMPT)
    full = shape.model_cls(shape.hf_config(sliding_window=None)).eval()
    full.load_state_dict(checkpoint.hf.state_dict())
    with torch.no_grad():
        full_attention = torch.log_softmax(full(torch.tensor([PROMPT])).logits[0].double(), -1).float()
    for position in range(1, len(PROMPT)):
        token, ours = PROMPT[position], out.prompt_logprobs[position].logprob
        assert abs(ours - reference[position - 1, token].item()) <= TOLERANCE, position
        if position > WINDOW:
            assert abs(ours - full_attention[position - 1, token].item()) > 10 * TOLERANCE, position


# ---- what is refused ------------------------------------------------------------------------------------------------

def test_gemma3_with_its_vision_tower_is_refused_in_one_line(tmp_path):
    transformers.AutoConfig.for_model("gemma3").save_pretrained(tmp_path)
    with pytest.raises(registry.UnsupportedArchitecture, match="unsupported architecture 'gemma3'") as refused:
        LLM(model=str(tmp_path))
    assert "\n" not in str(refused.value) and "gemma3_text" in str(refused.value)


@pytest.mark.parametrize("model_type, overrides, named", [
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3_text", dict(sliding_window=None), "sliding_window null"),
    ("gemma2", dict(attention_bias=True), "attention_bias"),
    ("gemma2", dict(hidden_activation="relu"), "hidden_activation 'relu'"),
])
def test_a_gemma_config_asking_for_what_is_not_built_is_refused_at_load(tmp_path, model_type, overrides, named):
    SHAPES[model_type].hf_config(**overrides).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=named) as refused:
        load_hf_checkpoint(tmp_path)
    assert "\n" not in str(refused.value) and "is not supported" in str(refused.value)


# ---- parallel and disaggregated -------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_tensor_and_pipeline_parallel_ranks_give_one_process_answer(tmp_path):
    """Gemma 3 over 2 ranks against 1: tensor-parallel (its 4 query heads 2 + 2, the one KV head on both; the output
    norms after the row-parallel all-reduce) and pipeline-parallel (the second rank's layers keep their windows:
    local, then global). The same greedy tokens, prompt logprobs within 1e-4 (measured 1.2e-5 and 0)."""
    check_ranks_agree(Checkpoint(tmp_path, SHAPES["gemma3_text"], "gemma3_text"), {"tensor_parallel_size": 2},
                      {"pipeline_parallel_size": 2})


@pytest.mark.e2e
@pytest.mark.parametrize("model_type, pool", [(m, pool) for m in SHAPES for pool in ("float16", "int8")])
def test_a_prefill_and_a_decode_pod_answer_as_the_offline_engine(tmp_path, start_cluster, model_type, pool):
    """``splitserve up --model DIR`` with one prefill and one decode pod: every prompt (the longest well past the
    window) prefills on the prefill pod, its KV of every layer, local and global alike (one layout: the pool keeps
    every block), crosses to the decode pod, and the greedy tokens are the offline engine's with the same pool
    (float16, the pods' default, and int8 rows, which the windowed layers' PyTorch attention reads too); every block is
    free after."""
    checkpoint = Checkpoint(tmp_path / model_type, SHAPES[model_type], model_type)
    with PrefillDecodeCluster(start_cluster, tmp_path / "up", checkpoint, cache_dtype=pool):
        pass
