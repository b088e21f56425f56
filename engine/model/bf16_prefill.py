"""bf16 prefill: a model's prompt rows computed with bf16 products on the native kernels' own tiling, beside the
decode path's weights.

Prefill is compute-bound, and where the CPU multiplies bf16 natively (AMX tiles, avx512_bf16's ``vdpbf16ps``) a bf16
product runs several times float32's (engine/kernels/cpu_features.py has the rule, docs/PERFORMANCE.md the figures).
So a model whose ``prefill_compute_dtype`` resolves to bfloat16 keeps a bf16 copy of its layers' product weights,
packed for the kernels (``Bf16Prefill.from_state_dict``; engine/kernels/bf16_kernels.py), next to the decode path's
(float32 panels or the file's quantized blocks: a pod that runs both phases holds both forms, and logs the memory).
A prefill pod's model holds the bf16 form only: it never runs a decode row, so it never loads the file's layer
products (``COPIED``), and keeps only the embeddings (the first token's lookup and, tied, the head that samples it),
the norms and the biases.

A step's prompt rows run each layer (``Bf16Layer``) in three native calls: RMSNorm rounded to bf16 -> QKV product
(float32 sums, + bias) -> RoPE and the cache write (the float32 path's) -> per sequence, attention over its cached
prefix and new tokens with bf16 products (q K^T, p V) and a float32 softmax, rounded to bf16 -> output product
added to the float32 residual -> RMSNorm in bf16 -> gate/up product with SiLU x up taken from its tiles, in bf16 ->
down product added to the residual. Activations cross memory as bf16 between the products; the residual stream, the
sums and the softmax stay float32. The final norm and the logits are the model's, float32.

**Batch invariance by construction.** Every product goes through one tiling (csrc/bf16_tiles.h): a row's bits are a
function of the row and the weights, whatever its chunk, its batch or the thread count, on every CPU class (AMX,
avx512_bf16, AVX2), and the attention of a query row reads its own keys only. So a prompt's K/V and first token
are the same on a prefill pod, a decode pod it is lent to, a split across both, and the offline engine.

A step that mixes prompt rows with decode rows runs them as two steps (``AttentionMetadata.split_phases``, in
``LlamaForCausalLM.forward``): the prompt rows here first, then the decode rows on the decode path, so every decode
row keeps its float32 bits.
"""

from __future__ import annotations

import logging

import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels.bf16_kernels import Bf16Kernels, pack, pack_gate_up, padded_inputs
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.model.rotary import StepRotary
from splitserve.engine.weights.quantized_weights import BlockQuantized

logger = logging.getLogger(__name__)


# The layer weights the bf16 copy replaces on the prefill path (by their names in a layer, ``layers.{i}.``): a model
# that only prefills in bf16 never loads them (``LlamaForCausalLM.from_state_dict(prefill_only=True)``).
COPIED = ("attn.qkv_proj.weight", "attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def copied_weights(config: ModelConfig) -> list[str]:
    """The full names of every layer's ``COPIED`` weights."""
    return [f"layers.{i}.{name}" for i in range(config.num_layers) for name in COPIED]


class Bf16Layer:
    """One decoder layer's prompt rows in bf16: its products packed for the kernels, its norms and QKV bias float32.
    Called as the model's layers are: ``layer(x, rotary, k_cache, v_cache, meta)`` updates the residual stream x
    [T, H] in place and returns it."""

    def __init__(self, config: ModelConfig, state_dict: dict, index: int, kernels: Bf16Kernels):
        p = f"layers.{index}."

        def weight(name: str) -> torch.Tensor:
            t = state_dict[p + name]
            return t.dequantize() if isinstance(t, BlockQuantized) else t

        def vector(name: str) -> torch.Tensor:
            return state_dict[p + name].to(torch.float32).contiguous()

        self.kernels, self.config = kernels, config
        self.qkv, self.o = pack(weight("attn.qkv_proj.weight")), pack(weight("attn.o_proj.weight"))
        self.gate_up, self.down = pack_gate_up(weight("mlp.gate_up_proj.weight")), pack(weight("mlp.down_proj.weight"))
        self.qkv_bias = vector("attn.qkv_proj.bias") if p + "attn.qkv_proj.bias" in state_dict else None
        self.input_norm, self.post_attn_norm = vector("input_norm.weight"), vector("post_attn_norm.weight")
        self.head_norms = (vector("attn.q_norm.weight"), vector("attn.k_norm.weight")) if config.qk_norm else None
        self.q_size = config.num_heads * config.head_dim

    @property
    def nbytes(self) -> int:
        """The memory the layer's bf16 products take, in bytes."""
        return sum(t.nbytes for t in (self.qkv, self.o, self.gate_up, self.down))

    def __call__(self, x: torch.Tensor, rotary: StepRotary, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        cfg, kernels = self.config, self.kernels
        qkv = kernels.attention_input(x, self.input_norm, cfg.rms_norm_eps, self.qkv, self.qkv_bias, rotary.positions,
                                      rotary.cos_table, rotary.sin_signed_table, cfg.num_heads, cfg.num_kv_heads,
                                      k_cache, v_cache, meta.slot_mapping,
                                      self.head_norms)  # [T, (Hq + 2 Hkv) D], q and k normalized and rotated
        q = qkv[:, : self.q_size].view(len(x), cfg.num_heads, cfg.head_dim)
        attn = torch.empty(len(x), padded_inputs(self.q_size), dtype=torch.bfloat16)  # the output product's rows
        attn[:, self.q_size :] = 0
        plan = meta.own_keys if kv_rows.is_scaled(k_cache.dtype) else None  # a scaled pool's own-block keys
        k_new = qkv[:, self.q_size : self.q_size + cfg.num_kv_heads * cfg.head_dim].view(len(x), cfg.num_kv_heads,
                                                                                          cfg.head_dim)
        source = None if plan is None else plan.source(k_cache, v_cache, k_new)
        for i, seg in enumerate(meta.prefills):
            rows = slice(seg.start, seg.end)
            kernels.prefill_attention(q[rows], k_cache, v_cache, seg.blocks, seg.prefix, cfg.head_dim**-0.5,
                                      attn[rows], None if source is None else source[plan.segment_index[i]])
        if plan is not None:
            plan.write(k_cache, v_cache, k_new)
        kernels.output_and_mlp(x, attn, self.q_size, self.o, self.post_attn_norm, cfg.rms_norm_eps, self.gate_up,
                               self.down, cfg.intermediate_size)
        return x


class Bf16Prefill:
    """The bf16 copy of a model's layers, for its prompt rows (``LlamaForCausalLM.forward`` runs them)."""

    def __init__(self, layers: list[Bf16Layer], kernels: Bf16Kernels):
        self.layers, self.kernels = layers, kernels

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state_dict: dict, kernels: Bf16Kernels) -> Bf16Prefill:
        """The layers of ``state_dict`` (float tensors or ``BlockQuantized``, as loaders give them) packed in bf16
        for ``kernels``."""
        prefill = cls([Bf16Layer(config, state_dict, i, kernels) for i in range(config.num_layers)], kernels)
        logger.info("bf16 prefill on %s: %.1f MiB of bf16 product weights, held beside the decode path's",
                    kernels.isa, prefill.nbytes / 2**20)
        return prefill

    @property
    def nbytes(self) -> int:
        """The memory the bf16 copy takes, in bytes."""
        return sum(layer.nbytes for layer in self.layers)
