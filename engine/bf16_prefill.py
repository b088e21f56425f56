"""bf16 prefill: a model's prompt tokens computed with bfloat16 products, beside the decode path's weights.

Prefill is compute-bound, and where the CPU multiplies bf16 natively (avx512_bf16's ``vdpbf16ps``, AMX tiles) torch's
oneDNN products in bf16 run 4.6x torch's float32 on prefill's shapes, and a whole prefill 1.3-1.5x the native
kernels' float32 one on an avx512_bf16 CPU (engine/kernels/cpu_features.py has the rule, docs/PERFORMANCE.md the
figures). So a model whose ``prefill_compute_dtype`` resolves to bfloat16 keeps a bf16 copy
of its layers' product weights (``Bf16Prefill.from_state_dict``), next to the decode path's (float32 panels or the
file's quantized blocks: a pod that runs both phases holds both forms, and logs the memory). A prefill pod's model
holds the bf16 form only: it never runs a decode row, so it never loads the file's layer blocks (``COPIED``), and
keeps only the embeddings (the first token's lookup and, tied, the head that samples it), the norms and the biases.

A step's prefill rows then run each layer as: float32 RMSNorm -> bf16 QKV product (oneDNN accumulates in float32;
its output is rounded to bf16 and widened) -> float32 bias and RoPE -> attention over the paged KV, which is written
in the cache's dtype and attended in float32 by the same code as float32 prefill (the native kernels' GEMM tiles:
faster here than PyTorch's bf16 flash attention, docs/PERFORMANCE.md) -> bf16 output product -> float32 residual
and norm -> bf16 gate/up product -> float32 SiLU x up -> bf16 down product -> float32 residual. The final norm and
the logits stay the model's, float32.

A step that mixes prefill rows with decode rows runs them as two steps (``AttentionMetadata.split_phases``): the
prefill rows here first, then the decode rows on the decode path, so a prompt position's K/V never depends on which
decodes shared its step, and every decode row keeps its float32 bits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.config import ModelConfig
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.rotary import StepRotary
from splitserve.engine.weights.quantized_weights import BlockQuantized

if TYPE_CHECKING:
    from splitserve.engine.model import DecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)


# The layer weights the bf16 copy replaces on the prefill path (by their names in a layer, ``layers.{i}.``): a model
# that only prefills in bf16 never loads them (``LlamaForCausalLM.from_state_dict(prefill_only=True)``).
COPIED = ("attn.qkv_proj.weight", "attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def copied_weights(config: ModelConfig) -> list[str]:
    """The full names of every layer's ``COPIED`` weights."""
    return [f"layers.{i}.{name}" for i in range(config.num_layers) for name in COPIED]


class Bf16Layer(NamedTuple):
    """One decoder layer's product weights in bf16, [out, in] each, and the QKV bias (float32, added after)."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class Bf16Prefill:
    """The bf16 copy of a model's layer products and the prefill forward that uses it."""

    def __init__(self, layers: list[Bf16Layer]):
        self.layers = layers

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state_dict: dict, device: torch.device) -> Bf16Prefill:
        """The layers' products of ``state_dict`` (float tensors or ``BlockQuantized``, as loaders give them) in
        bf16 on ``device``."""

        def bf16(name: str) -> torch.Tensor:
            t = state_dict[name]
            t = t.dequantize() if isinstance(t, BlockQuantized) else t
            return t.to(device=device, dtype=torch.bfloat16).contiguous()

        def layer(i: int) -> Bf16Layer:
            p = f"layers.{i}."
            bias = state_dict.get(p + "attn.qkv_proj.bias")
            return Bf16Layer(bf16(p + "attn.qkv_proj.weight"), None if bias is None else bias.to(device, torch.float32),
                             bf16(p + "attn.o_proj.weight"), bf16(p + "mlp.gate_up_proj.weight"),
                             bf16(p + "mlp.down_proj.weight"))

        prefill = cls([layer(i) for i in range(config.num_layers)])
        logger.info("bf16 prefill: %.1f MiB of bf16 product weights, held beside the decode path's",
                    prefill.nbytes / 2**20)
        return prefill

    @property
    def nbytes(self) -> int:
        """The memory the bf16 copy takes, in bytes."""
        return sum(t.nbytes for layer in self.layers for t in layer if t is not None)

    def forward(self, model: LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: PagedKVCache, meta: AttentionMetadata,
                layer_done: Callable[[int], None] | None) -> torch.Tensor:
        """A step with prefill rows -> final hidden states [T, H] float32 (``LlamaForCausalLM.forward``'s contract);
        its decode rows, if any, run on the model's decode path after the prefill rows."""
        if meta.decode is None:
            return self._prefill(model, input_ids, positions, kv_cache, meta, layer_done)
        (prefill_meta, prefill_rows), (decode_meta, decode_rows) = meta.split_phases()
        hidden = torch.empty(len(input_ids), model.config.hidden_size, dtype=torch.float32, device=input_ids.device)
        hidden[prefill_rows] = self._prefill(model, input_ids[prefill_rows], positions[prefill_rows], kv_cache,
                                             prefill_meta, None)
        # layer_done(i) after the decode rows' layer i: then every row's K/V of layer i is in the cache.
        hidden[decode_rows] = model(input_ids[decode_rows], positions[decode_rows], kv_cache, decode_meta, layer_done)
        return hidden

    def _prefill(self, model: LlamaForCausalLM, input_ids, positions, kv_cache: PagedKVCache,
                 meta: AttentionMetadata, layer_done: Callable[[int], None] | None) -> torch.Tensor:
        rotary = model.rotary.for_step(positions)
        x = model.embed(input_ids)  # [T, H] float32, the residual stream
        for i, (layer, weights) in enumerate(zip(model.layers, self.layers)):
            _layer(layer, weights, x, rotary, kv_cache.k_blocks[i], kv_cache.v_blocks[i], meta)
            if layer_done is not None:
                layer_done(i)
        return model.norm(x)


def _layer(layer: DecoderLayer, w: Bf16Layer, x: torch.Tensor, rotary: StepRotary, k_cache: torch.Tensor,
           v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    """One decoder layer over x [T, H] float32, updated in place."""
    attn = layer.attn
    qkv = _product(layer.input_norm(x), w.qkv, w.qkv_bias)  # [T, (Hq + 2 Hkv) D]
    qk = rotary.apply(qkv[:, : attn.qk_size].view(len(qkv), -1, attn.head_dim))  # [T, Hq + Hkv, D]
    x += _product(attn.attend(qk, qkv, k_cache, v_cache, meta, kv_written=False), w.o)
    gate, up = _product(layer.post_attn_norm(x), w.gate_up).split(layer.mlp.intermediate_size, dim=-1)
    x += _product(F.silu(gate).mul_(up), w.down)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] float32 @ weight^T (bf16 [out, in]) -> [rows, out] float32: a bf16 product, accumulated in
    float32 by oneDNN, whose bf16 output is widened; the bias added in float32.

    oneDNN sums a many-row product's every row in one order, whatever its place among the rows, but a one-row
    product (a matrix-vector path) in another: so a single row is computed as two, and a prompt position's bits do
    not depend on its chunking (a prefix-cache hit's last token, a 1-token last chunk)."""
    rows = x.to(torch.bfloat16)
    y = (F.linear(rows, weight) if len(rows) != 1 else F.linear(rows.expand(2, -1), weight)[:1]).float()
    return y if bias is None else y.add_(bias)
