"""``Architecture``: what one architecture's module states, and the checks of a ``config.json`` the entries share.

An architecture differs from the Llama core (engine/model/llama.py) in a few named ways, each a field here, so that
the model's modules read one resolved ``ModelConfig`` and never test an architecture's name:

- ``qkv_bias``: q, k and v carry biases (Qwen2), whatever the config's ``attention_bias`` says;
- ``qk_norm``: q and k are RMS-normalized per head, over head_dim, between the QKV product and RoPE (Qwen3);
- ``gguf_qk_permuted``: llama.cpp's converter interleaved the rotary halves of Q and K's rows (its ``llama``
  architecture only), which the GGUF loader undoes;
- ``fused_checkpoint``: the checkpoint stores q|k|v and gate|up fused, as the core does (Phi-3), not one tensor each;
- ``refuse``: checks of what a config may ask that is not built (an o_proj bias), refused at load;
- ``activation``: the config key naming the MLP's activation and its default (Gemma's ``hidden_activation``);
- ``norm_offset``: the checkpoint's norms scale by ``offset + w`` (Gemma's 1 + w), folded into the weights at load
  (float32, as transformers adds them) and taken out at export;
- ``hf_names``: the checkpoint's names of parts that differ from the Llama names (engine/weights/hf_checkpoint.py);
- ``configure`` / ``hf_config``: what the entry reads from a ``config.json`` beyond the core's keys into the
  ``ModelConfig``, and writes back at export.
- ``experts``: its MLP is a mixture of experts (Qwen3-MoE, Mixtral), read and named as ``ExpertsFormat`` says;
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
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
    fused_checkpoint: bool = False
    refuse: tuple[Callable[[HFConfig], str | None], ...] = ()  # each: what a config asks that is not built, or None
    activation: tuple[str, str] = ("hidden_act", "silu")  # the config's key and its default
    norm_offset: float = 0.0
    hf_names: tuple[tuple[str, str], ...] = ()  # (part, name in the checkpoint) overriding the Llama names
    configure: Callable[[HFConfig, ModelConfig], ModelConfig] | None = None
    hf_config: Callable[[ModelConfig], dict[str, Any]] | None = None
    experts: ExpertsFormat | None = None  # a mixture of experts' config keys and tensor names (experts.py)

    def model_config(self, hf: HFConfig, name: str) -> ModelConfig:
        """The ``ModelConfig`` of a ``config.json`` of this architecture; ValueError naming what is not built."""
        key, default = self.activation
        outside = partial(_refuse_outside_the_core, activation=hf.get(key, default))
        problem = next((p for p in (check(hf) for check in (*self.refuse, outside)) if p), None)
        if problem:
            raise ValueError(f"{name}: {self.model_type} with {problem} is not supported (docs/models.md)")
        config = replace(ModelConfig.from_hf_config(hf, name=name), hidden_act=hf.get(key, default))
        config = self.resolve(self.configure(hf, config) if self.configure else config)
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


# The MLP's gate activations built (layers.py's MLP): SwiGLU's and GeGLU's (transformers' gelu_pytorch_tanh).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _refuse_outside_the_core(hf: HFConfig, activation: str) -> str | None:
    """What every entry refuses: a config asking for a part the Llama core does not have."""
    if activation not in ACTIVATIONS:
        key = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
        return f"{key} {activation!r} (the MLP is SwiGLU or GeGLU with gelu_pytorch_tanh)"
    if hf.get("mlp_bias"):
        return "mlp_bias"
    # Phi-4-mini writes it at the top; transformers 5 saves it in rope_parameters.
    rotary = hf.get("partial_rotary_factor") or (hf.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
    if rotary != 1.0:
        return f"partial_rotary_factor {rotary}"
    return None


SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer types


def configure_sliding_windows(hf: HFConfig, config: ModelConfig) -> ModelConfig:
    """The ``configure`` of Mistral, Mixtral, Phi-3 and the Qwen2/Qwen3 families (MoE too): each layer's sliding window
    as transformers reads the config. Mistral, Mixtral and Phi-3 window every layer (``sliding_window``; Mistral's 4096
    where the key is absent); Qwen2/Qwen3 window the layers ``layer_types`` marks sliding (by default those from
    ``max_window_layers`` on), only with ``use_sliding_window``. A window a sequence cannot outgrow (at least the
    context) is full attention: none then, the native kernels' path."""
    model_type = hf.get("model_type")
    every_layer = model_type in ("mistral", "mixtral", "phi3")
    window = hf.get("sliding_window", 4096 if model_type == "mistral" else None)
    if window is None or window >= config.max_position_embeddings or not (
            every_layer or hf.get("use_sliding_window")):
        return config
    start = hf.get("max_window_layers", 28)
    types = [SLIDING] * config.num_layers if every_layer else (
        hf.get("layer_types") or [SLIDING if i >= start else FULL for i in range(config.num_layers)])
    windows = tuple(window if t == SLIDING else None for t in types)
    return replace(config, layer_windows=windows if SLIDING in types else ())


def window_keys(config: ModelConfig, always: bool = False) -> dict[str, Any]:
    """The config keys transformers reads the layers' windows from (export), where some layer has one (or
    ``always``: Gemma's configs default to windowed layers)."""
    windows = config.layer_windows or (None,) * config.num_layers
    window = next((w for w in windows if w is not None), None)
    if window is None and not always:
        return {"sliding_window": None}  # full attention (Mistral's config class would default to a window of 4096)
    types = [FULL if w is None else SLIDING for w in windows]
    return {"sliding_window": window, "use_sliding_window": window is not None, "layer_types": types}


def refuse_o_proj_bias(hf: HFConfig) -> str | None:
    """Llama's ``attention_bias`` biases o_proj as well as q, k and v; the core's output product has no bias."""
    return "attention_bias (an o_proj bias)" if hf.get("attention_bias") else None
