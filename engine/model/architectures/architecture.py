"""``Architecture``: what one architecture's module states, and the checks of a ``config.json`` the entries share.

An architecture differs from the Llama core (engine/model/llama.py) in a few named ways, each a field here, so that
the model's modules read one resolved ``ModelConfig`` and never test an architecture's name:

- ``qkv_bias``: q, k and v carry biases (Qwen2), whatever the config's ``attention_bias`` says;
- ``qk_norm``: q and k are RMS-normalized per head, over head_dim, between the QKV product and RoPE (Qwen3);
- ``gguf_qk_permuted``: llama.cpp's converter interleaved the rotary halves of Q and K's rows (its ``llama``
  architecture only), which the GGUF loader undoes;
- ``experts``: its MLP is a mixture of experts (Qwen3-MoE, Mixtral), read and named as ``ExpertsFormat`` says;
- ``refuse``: checks of what a config may ask that is not built (a sliding window, an o_proj bias), refused at load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.architectures.experts import ExpertsFormat
from splitserve.engine.model.rotary import rope_inv_freq

HFConfig = dict[str, Any]  # a config.json, as read


@dataclass(frozen=True)
class Architecture:
    """One registry entry: its names in checkpoints, its differences from the core, and what it refuses."""

    model_type: str  # config.json's "model_type", the registry's key
    hf_class: str  # its transformers class, config.json's "architectures"[0] (what export writes)
    gguf_name: str | None = None  # llama.cpp's general.architecture; None: no GGUF files are read for it
    qkv_bias: bool = False
    qk_norm: bool = False
    gguf_qk_permuted: bool = False
    refuse: tuple[Callable[[HFConfig], str | None], ...] = ()  # each: what a config asks that is not built, or None
    experts: ExpertsFormat | None = None  # a mixture of experts' config keys and tensor names (experts.py)

    def model_config(self, hf: HFConfig, name: str) -> ModelConfig:
        """The ``ModelConfig`` of a ``config.json`` of this architecture; ValueError naming what is not built."""
        problem = next((p for p in (check(hf) for check in (*self.refuse, _refuse_outside_the_core)) if p), None)
        if problem:
            raise ValueError(f"{name}: {self.model_type} with {problem} is not supported (docs/models.md)")
        config = self.resolve(ModelConfig.from_hf_config(hf, name=name))
        if self.experts is not None:
            config = replace(config, **self.experts.read(hf))
        try:
            rope_inv_freq(config)  # a RoPE scaling type rotary.py does not compute is refused here, at load
        except (ValueError, KeyError) as e:
            raise ValueError(f"{name}: {self.model_type} with this rope scaling is not supported: {e}") from e
        return config

    def resolve(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this architecture's features set (a GGUF loader reads the shape, the registry the rest)."""
        return replace(config, architecture=self.model_type, qkv_bias=config.qkv_bias or self.qkv_bias,
                       qk_norm=self.qk_norm)


def _refuse_outside_the_core(hf: HFConfig) -> str | None:
    """What every entry refuses: a config asking for a part the Llama core does not have."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} (the MLP is SwiGLU)"
    if hf.get("mlp_bias"):
        return "mlp_bias"
    rotary = hf.get("partial_rotary_factor", 1.0)
    if rotary != 1.0:
        return f"partial_rotary_factor {rotary}"
    return None


def refuse_sliding_window(hf: HFConfig) -> str | None:
    """A sliding window that a sequence can outgrow: its attention would differ from full attention past the window,
    and the paged cache does not free what leaves it yet. Qwen2/Qwen3 write ``layer_types``; Mistral only
    ``sliding_window`` (null in v0.2 and later)."""
    if "sliding_attention" in (hf.get("layer_types") or ()):
        return f"sliding-window layers (layer_types; window {hf.get('sliding_window')})"
    window = hf.get("sliding_window")
    context = hf.get("max_position_embeddings", 2048)
    if window is not None and hf.get("use_sliding_window", True) and window < context:
        return f"sliding_window {window} below its context of {context} tokens"
    return None


def refuse_o_proj_bias(hf: HFConfig) -> str | None:
    """Llama's ``attention_bias`` biases o_proj as well as q, k and v; the core's output product has no bias."""
    return "attention_bias (an o_proj bias)" if hf.get("attention_bias") else None
