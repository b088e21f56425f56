"""Gemma 2 (``gemma2``) and Gemma 3's text model (``gemma3_text``: the 1B model, and the language model of the larger
ones' checkpoints converted to text-only): the Llama core with, as transformers 5.24 computes them,

- embeddings times sqrt(hidden_size) (rounded to the hidden dtype), the head tied to the unscaled embeddings;
- RMSNorms scaling by 1 + w, in float32: folded into the weights at load (``norm_offset``), taken out at export;
- four norms a layer: the input's, the attention output's (``post_attention_layernorm``, before the residual add),
  the MLP input's (``pre_feedforward_layernorm``, the core's ``post_attn_norm``) and the MLP output's;
- GeGLU (``hidden_activation`` gelu_pytorch_tanh) with the core's fused gate|up;
- attention scaled by ``query_pre_attn_scalar ** -0.5``, head_dim 256 (the config's);
- local layers attending over a sliding window (``layer_types``; by default Gemma 2 alternates local and global from
  the first layer, Gemma 3 has 5 local layers to 1 global: ``sliding_window_pattern`` 6);
- Gemma 2: tanh soft-caps of the attention scores (``attn_logit_softcapping``, 50) and of the logits
  (``final_logit_softcapping``, 30);
- Gemma 3: per-head q/k RMSNorms (1 + w, as the other norms) before RoPE; local layers rotate with
  ``rope_local_base_freq`` (10000) unscaled, global ones with ``rope_theta`` (1e6) and the config's scaling (linear,
  factor 8, from 4B up). Its ``attn_logit_softcapping`` is not applied by transformers, nor here.

Not served: ``use_bidirectional_attention`` (EmbeddingGemma), a bias (``attention_bias`` biases o_proj too), a scaled
RoPE on local layers; Gemma 3's vision tower (``gemma3``, Gemma3ForConditionalGeneration) is not an entry.
"""

from __future__ import annotations

from dataclasses import replace

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.architectures.architecture import (
    FULL,
    SLIDING,
    Architecture,
    HFConfig,
    refuse_o_proj_bias,
    window_keys,
)

# Gemma's names of the parts whose Llama names differ: the MLP's input norm is pre_feedforward_layernorm, and
# post_attention_layernorm normalizes the attention's output.
GEMMA_NAMES = (
    ("post_attn_norm", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    ("attn_out_norm", "model.layers.{i}.post_attention_layernorm.weight"),
    ("mlp_out_norm", "model.layers.{i}.post_feedforward_layernorm.weight"),
)


def _layer_types(hf: HFConfig, pattern: int) -> list[str]:
    """The config's ``layer_types``, or transformers' default: every ``pattern``-th layer global."""
    layers = hf["num_hidden_layers"]
    return list(hf.get("layer_types") or (SLIDING if (i + 1) % pattern else FULL for i in range(layers)))


def _windows(hf: HFConfig, types: list[str]) -> tuple[int | None, ...]:
    """Each layer's window, kept even where it is at least the context (no real Gemma's is): the layers' windows also
    say which layers rotate with Gemma 3's local base."""
    window = hf.get("sliding_window", 4096)
    if window is None or SLIDING not in types:
        return ()
    return tuple(window if t == SLIDING else None for t in types)


def _refuse_gemma(hf: HFConfig) -> str | None:
    if hf.get("use_bidirectional_attention"):
        return "use_bidirectional_attention"
    unknown = set(hf.get("layer_types") or ()) - {SLIDING, FULL}
    if unknown:
        return f"layer types {sorted(unknown)}"
    return None


def _configure_gemma2(hf: HFConfig, config: ModelConfig) -> ModelConfig:
    return replace(_common(hf, config, 8192), layer_windows=_windows(hf, _layer_types(hf, 2)),
                   attn_logit_softcap=hf.get("attn_logit_softcapping", 50.0),
                   final_logit_softcap=hf.get("final_logit_softcapping", 30.0))


def _gemma3_rope(hf: HFConfig) -> tuple[float, dict | None, float, dict]:
    """(global theta, global scaling, local theta, local parameters) from transformers 5's ``rope_parameters`` by
    layer type, or from the older flat keys (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``)."""
    by_type = hf.get("rope_parameters") or {}
    full, local = by_type.get(FULL) or {}, by_type.get(SLIDING) or {}
    theta = full.get("rope_theta", hf.get("rope_theta", 1_000_000.0))
    scaling = hf.get("rope_scaling")
    if full.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    return theta, scaling, local.get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)), local


def _refuse_gemma3(hf: HFConfig) -> str | None:
    local = _gemma3_rope(hf)[3]
    if local.get("rope_type", "default") != "default":
        return f"rope scaling {local.get('rope_type')!r} on the local layers"
    if "sliding_window" in hf and hf["sliding_window"] is None:  # its local layers would still rotate locally
        return "sliding_window null"
    return _refuse_gemma(hf)


def _configure_gemma3(hf: HFConfig, config: ModelConfig) -> ModelConfig:
    theta, scaling, local_theta, _ = _gemma3_rope(hf)
    return replace(_common(hf, config, 131072), layer_windows=_windows(hf, _layer_types(
        hf, hf.get("sliding_window_pattern", 6))), rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
        final_logit_softcap=hf.get("final_logit_softcapping"))


def _common(hf: HFConfig, config: ModelConfig, context: int) -> ModelConfig:
    """What both read alike, with the transformers config classes' defaults where a key is absent."""
    return replace(config, head_dim=hf.get("head_dim") or 256, tie_word_embeddings=hf.get("tie_word_embeddings", True),
                   max_position_embeddings=hf.get("max_position_embeddings", context),
                   attention_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5, scale_embeddings=True,
                   sandwich_norms=True)


def _export(config: ModelConfig) -> dict:
    """The keys transformers' Gemma configs read that the core's export does not write."""
    scalar = round(config.attention_scale**-2, 6)
    return {"hidden_activation": config.hidden_act, "query_pre_attn_scalar": int(scalar) if scalar.is_integer()
            else scalar, **window_keys(config, always=True), "final_logit_softcapping": config.final_logit_softcap}


def _export_gemma2(config: ModelConfig) -> dict:
    return {**_export(config), "attn_logit_softcapping": config.attn_logit_softcap}


def _export_gemma3(config: ModelConfig) -> dict:
    return {**_export(config), "rope_local_base_freq": config.local_rope_theta}


GEMMA2 = Architecture("gemma2", "Gemma2ForCausalLM", activation=("hidden_activation", "gelu_pytorch_tanh"),
                      norm_offset=1.0, hf_names=GEMMA_NAMES, refuse=(_refuse_gemma, refuse_o_proj_bias),
                      configure=_configure_gemma2, hf_config=_export_gemma2)
GEMMA3_TEXT = Architecture("gemma3_text", "Gemma3ForCausalLM", qk_norm=True,
                           activation=("hidden_activation", "gelu_pytorch_tanh"), norm_offset=1.0,
                           hf_names=GEMMA_NAMES, refuse=(_refuse_gemma3, refuse_o_proj_bias),
                           configure=_configure_gemma3, hf_config=_export_gemma3)
