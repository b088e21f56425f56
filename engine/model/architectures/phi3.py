"""Phi-3 and Phi-3.5 (mini, medium; dense): the Llama core, stored fused. Its checkpoints hold q|k|v as one
``qkv_proj`` and gate|up as one ``gate_up_proj``, in the core's own row order, which the loaders take whole (and
export writes back whole); llama.cpp's ``phi3`` files likewise (``attn_qkv``, ``ffn_up``). No biases, untied head,
head_dim hidden / heads (96 in mini, 128 in medium). Its dropouts (``resid_pdrop``, ``embd_pdrop``,
``attention_dropout``) act only in training.

RoPE: none (the 4k models) is the core's. ``longrope`` (the 128k models, Phi-3.5-mini) is served exactly as
transformers computes it for every sequence of at most ``original_max_position_embeddings`` tokens (4096): the short
factors, and cos and sin times the attention factor, sqrt(1 + ln(factor) / ln(original context)), 1.19 for 32x. A
longer sequence switches all its positions, those already in the KV cache too, to the long factors; the paged cache
would have to recompute a sequence's KV as it crosses, which it does not, so the served context is capped at the
original one, said at load in one line. A sliding window below the (served) context (Phi-3-mini-4k's 2047 of 4096)
windows every layer (``ModelConfig.layer_windows``, attention.py), as Mistral's. ``partial_rotary_factor``
(Phi-4-mini's) is refused, every entry's rule."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.architectures.architecture import Architecture, HFConfig, configure_sliding_windows

logger = logging.getLogger(__name__)

PHI3_ORIGINAL_CONTEXT = 4096  # Phi3Config's default original_max_position_embeddings, when a config has none


@dataclass(frozen=True)
class Phi3Architecture(Architecture):
    """The entry, reading longrope as transformers' ``Phi3Config`` does before the core reads the config."""

    def model_config(self, hf: HFConfig, name: str) -> ModelConfig:
        return super().model_config(_longrope_within_original_context(hf, name), name)


def _longrope_within_original_context(hf: HFConfig, name: str) -> HFConfig:
    """``hf`` with a longrope scaling spelled out (its type, the original context from the top-level key that
    transformers prefers, the factor from the checkpoint's full context) and the context capped at the original."""
    rope = hf.get("rope_parameters") or {}
    scaling = dict(hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else {}))
    if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su", "yarn"):  # Phi3Config: su, yarn
        return hf
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    original = hf.get("original_max_position_embeddings",
                      scaling.get("original_max_position_embeddings", PHI3_ORIGINAL_CONTEXT))
    context = hf.get("max_position_embeddings", 4096)
    scaling.update(rope_type="longrope", original_max_position_embeddings=original,
                   factor=scaling.get("factor") or context / original)
    if context > original:
        logger.warning("%s: longrope serves contexts of up to original_max_position_embeddings, %d of its %d tokens "
                       "(longer ones switch to the long factors; docs/models.md)", name, original, context)
    return {**hf, "rope_scaling": scaling, "max_position_embeddings": min(context, original)}


PHI3 = Phi3Architecture("phi3", "Phi3ForCausalLM", gguf_name="phi3", fused_checkpoint=True,
                        configure=configure_sliding_windows)
