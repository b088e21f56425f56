"""The model's parameter layout, written once: every state-dict name, its shape, and the checkpoint tensors it is
fused from. ``LlamaForCausalLM`` (model.py) has exactly these parameters, the loaders (hf_checkpoint.py,
gguf_file.py) produce exactly these names, and ``random_state_dict`` builds them for tiny models.

Q, K and V are fused into one ``qkv_proj`` (rows: q, then k, then v) and gate and up into one ``gate_up_proj``
(rows: gate, then up), so that a layer does two products where a checkpoint has five. ``H`` hidden size, ``D``
head dim, ``Hq`` / ``Hkv`` query / KV heads, ``I`` intermediate size, ``V`` vocabulary:

    embed_tokens.weight                 [V, H]
    layers.{i}.input_norm.weight        [H]
    layers.{i}.attn.qkv_proj.weight     [(Hq + 2 Hkv) D, H]   q, k, v rows   (+ .bias [(Hq + 2 Hkv) D] with qkv_bias)
    layers.{i}.attn.q_norm.weight       [D]                   with qk_norm (Qwen3): one per head dim, all heads
    layers.{i}.attn.k_norm.weight       [D]                   with qk_norm
    layers.{i}.attn.o_proj.weight       [H, Hq D]
    layers.{i}.attn_out_norm.weight     [H]                   with sandwich_norms (Gemma): the attention's output
    layers.{i}.post_attn_norm.weight    [H]                   the MLP's input norm
    layers.{i}.mlp.gate_up_proj.weight  [2 I, H]              gate, up rows
    layers.{i}.mlp.down_proj.weight     [H, I]
    layers.{i}.mlp_out_norm.weight      [H]                   with sandwich_norms: the MLP's output
    norm.weight                         [H]
    lm_head.weight                      [V, H]                absent when tie_word_embeddings

A mixture-of-experts layer (``moe_layers``; engine/model/moe.py) has, instead of the two ``mlp`` products, a router
and each expert's two (``E`` experts, ``Ie`` an expert's width; ``{e}`` the expert's index in the whole model, so a
tensor-parallel rank holding experts [4, 8) names them 4 to 7):

    layers.{i}.mlp.router.weight                      [E, H]
    layers.{i}.mlp.experts.{e}.gate_up_proj.weight    [2 Ie, H]    gate, up rows
    layers.{i}.mlp.experts.{e}.down_proj.weight       [H, Ie]
    layers.{i}.mlp.shared_expert.gate_up_proj.weight  [2 Is, H]    with a shared expert (Qwen2-MoE) of width Is
    layers.{i}.mlp.shared_expert.down_proj.weight     [H, Is]
    layers.{i}.mlp.shared_expert_gate.weight          [1, H]       its sigmoid gate

A checkpoint format names its tensors by *part* (``"q.weight"``, ``"gate"``, ``"embed"``...): a dict from part to
its name in the file, ``{i}`` standing for the layer and ``{e}`` for the expert. ``fuse`` builds our state dict from
such tensors, ``unfuse`` splits it back. A format that stores a fused parameter whole, in our row order (Phi-3's
``qkv_proj`` and ``gate_up_proj``, llama.cpp's ``attn_qkv`` and ``ffn_up``), names it by the parameter's ``whole``
part instead (``"qkv.weight"``, ``"gate_up"``): it is taken, and written back, as one tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from splitserve.engine.config import ModelConfig

StateDict = dict[str, torch.Tensor]


class Parameter(NamedTuple):
    """One entry of the layout: ``name`` ("{i}" for the layer) concatenates the rows of ``parts``, in order."""

    name: str
    parts: tuple[str, ...]
    part_rows: Callable[[ModelConfig], tuple[int, ...]]  # rows each part contributes
    columns: Callable[[ModelConfig], int] | None = None  # None: a vector
    present: Callable[[ModelConfig], bool] = lambda config: True
    whole: str | None = None  # the part naming the fused rows as one tensor, where a format stores them so


def _hidden(c: ModelConfig) -> int:
    return c.hidden_size


def _qkv_rows(c: ModelConfig) -> tuple[int, int, int]:
    kv_rows = c.num_kv_heads * c.head_dim
    return c.num_heads * c.head_dim, kv_rows, kv_rows


# In the order the model uses them (which is also the order random_state_dict draws them in).
EMBEDDING = Parameter("embed_tokens.weight", ("embed",), lambda c: (c.vocab_size,), _hidden)
LAYER_PARAMETERS = (
    Parameter("layers.{i}.input_norm.weight", ("input_norm",), lambda c: (c.hidden_size,)),
    Parameter("layers.{i}.attn.qkv_proj.weight", ("q.weight", "k.weight", "v.weight"), _qkv_rows, _hidden,
              whole="qkv.weight"),
    Parameter("layers.{i}.attn.qkv_proj.bias", ("q.bias", "k.bias", "v.bias"), _qkv_rows,
              present=lambda c: c.qkv_bias),
    Parameter("layers.{i}.attn.q_norm.weight", ("q_norm",), lambda c: (c.head_dim,), present=lambda c: c.qk_norm),
    Parameter("layers.{i}.attn.k_norm.weight", ("k_norm",), lambda c: (c.head_dim,), present=lambda c: c.qk_norm),
    Parameter("layers.{i}.attn.o_proj.weight", ("o",), lambda c: (c.hidden_size,),
              lambda c: c.num_heads * c.head_dim),
    Parameter("layers.{i}.attn_out_norm.weight", ("attn_out_norm",), lambda c: (c.hidden_size,),
              present=lambda c: c.sandwich_norms),
    Parameter("layers.{i}.post_attn_norm.weight", ("post_attn_norm",), lambda c: (c.hidden_size,)),
    Parameter("layers.{i}.mlp.gate_up_proj.weight", ("gate", "up"),
              lambda c: (c.intermediate_size, c.intermediate_size), _hidden, whole="gate_up"),
    Parameter("layers.{i}.mlp.down_proj.weight", ("down",), lambda c: (c.hidden_size,),
              lambda c: c.intermediate_size),
    Parameter("layers.{i}.mlp_out_norm.weight", ("mlp_out_norm",), lambda c: (c.hidden_size,),
              present=lambda c: c.sandwich_norms),
)
DENSE_MLP = ("layers.{i}.mlp.gate_up_proj.weight", "layers.{i}.mlp.down_proj.weight")  # not in an experts layer
ROUTER = Parameter("layers.{i}.mlp.router.weight", ("router",), lambda c: (c.num_experts,), _hidden)
EXPERT_PARAMETERS = (
    Parameter("layers.{i}.mlp.experts.{e}.gate_up_proj.weight", ("expert_gate", "expert_up"),
              lambda c: (c.moe_intermediate_size, c.moe_intermediate_size), _hidden),
    Parameter("layers.{i}.mlp.experts.{e}.down_proj.weight", ("expert_down",), lambda c: (c.hidden_size,),
              lambda c: c.moe_intermediate_size),
)
SHARED_EXPERT_GATE = Parameter("layers.{i}.mlp.shared_expert_gate.weight", ("shared_expert_gate",), lambda c: (1,),
                               _hidden, lambda c: c.shared_expert_intermediate_size > 0)
SHARED_EXPERT_PARAMETERS = (
    Parameter("layers.{i}.mlp.shared_expert.gate_up_proj.weight", ("shared_gate", "shared_up"),
              lambda c: (c.shared_expert_intermediate_size,) * 2, _hidden, SHARED_EXPERT_GATE.present),
    Parameter("layers.{i}.mlp.shared_expert.down_proj.weight", ("shared_down",), lambda c: (c.hidden_size,),
              lambda c: c.shared_expert_intermediate_size, SHARED_EXPERT_GATE.present),
    SHARED_EXPERT_GATE,
)
HEAD_PARAMETERS = (
    Parameter("norm.weight", ("norm",), lambda c: (c.hidden_size,)),
    Parameter("lm_head.weight", ("lm_head",), lambda c: (c.vocab_size,), _hidden,
              present=lambda c: not c.tie_word_embeddings),
)


def _entries(config: ModelConfig):
    """(our name, the parameter, its "{i}" and "{e}" substitutions) for every parameter of ``config``'s model."""
    yield EMBEDDING.name, EMBEDDING, {}
    for i in range(config.num_layers):
        experts = i in config.moe_layers
        for p in LAYER_PARAMETERS:
            if p.present(config) and not (experts and p.name in DENSE_MLP):
                yield p.name.format(i=i), p, {"i": i}
        if experts:
            yield ROUTER.name.format(i=i), ROUTER, {"i": i}
            for e in range(*config.expert_range):
                for p in EXPERT_PARAMETERS:
                    yield p.name.format(i=i, e=e), p, {"i": i, "e": e}
            for p in SHARED_EXPERT_PARAMETERS:
                if p.present(config):
                    yield p.name.format(i=i), p, {"i": i}
    for p in HEAD_PARAMETERS:
        if p.present(config):
            yield p.name, p, {}


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of ``config``'s model."""
    shapes = {}
    for name, p, _ in _entries(config):
        rows = sum(p.part_rows(config))
        shapes[name] = (rows,) if p.columns is None else (rows, p.columns(config))
    return shapes


def fuse(tensors: dict[str, torch.Tensor], source_names: dict[str, str], config: ModelConfig, source: str,
         dtype: str | torch.dtype = torch.float32) -> StateDict:
    """Our state dict, as ``dtype``, from a checkpoint's ``tensors`` (by their names in the file), ``source_names``
    mapping each part to its name there. Every tensor must be used: a missing one raises KeyError and a leftover
    ValueError, both naming ``source``."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    unused = dict(tensors)

    def take(name: str) -> torch.Tensor:
        if name not in unused:
            raise KeyError(f"{source} lacks tensor {name!r}")
        tensor = unused.pop(name)
        return tensor.to(dtype) if isinstance(tensor, torch.Tensor) else tensor  # a weight kept in its blocks

    state = {}
    for name, p, layer in _entries(config):
        parts = [take(source_names[part].format(**layer)) for part in _stored_parts(p, source_names)]
        state[name] = parts[0] if len(parts) == 1 else _cat(parts)
    if unused:
        raise ValueError(f"{source} has tensors this loader does not map: {sorted(unused)[:8]}")
    return state


def _stored_parts(p: Parameter, source_names: dict[str, str]) -> tuple[str, ...]:
    """The parts a format stores ``p`` as: whole, where it names the whole, else its parts."""
    return (p.whole,) if p.whole in source_names else p.parts


def _cat(parts: list):
    """A fused parameter's rows from its parts': tensors, or weights kept in quantized blocks (a loader's
    ``BlockQuantized``, engine/weights/quantized_weights.py, which fuses its own)."""
    kept = [p for p in parts if not isinstance(p, torch.Tensor)]
    return type(kept[0]).cat(parts) if kept else torch.cat(parts)


def product_weights(config: ModelConfig) -> list[str]:
    """The weights that products read (every layer's matrices, the head's, and the embedding when the head is tied
    to it: one weight, read by the head's product), the ones a quantized model keeps in blocks. An untied embedding
    is looked up, not streamed, so it is not one. The router (and a shared expert's gate) stays float: a rounded
    routing logit would choose other experts, not just round a product."""
    names = [name for name, p, _ in _entries(config)
             if p.columns is not None and p not in (EMBEDDING, ROUTER, SHARED_EXPERT_GATE)]
    return names + ([EMBEDDING.name] if config.tie_word_embeddings else [])


def unfuse(state: StateDict, source_names: dict[str, str], config: ModelConfig) -> StateDict:
    """The checkpoint's tensors (by their names in ``source_names``) from our state dict: views into it."""
    tensors = {}
    for name, p, layer in _entries(config):
        parts = _stored_parts(p, source_names)
        rows = p.part_rows(config) if len(parts) > 1 else (state[name].shape[0],)
        for part, tensor in zip(parts, state[name].split(rows)):
            tensors[source_names[part].format(**layer)] = tensor
    return tensors


def random_state_dict(config: ModelConfig, seed: int) -> StateDict:
    """Seeded random float32 CPU weights: norms 1, everything else N(0, 0.02) (GPT-2/Llama init scale)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in parameter_shapes(config).items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones(shape)
        else:
            state[name] = torch.randn(shape, generator=generator) * 0.02
    return state


def check_state_dict(config: ModelConfig, state: StateDict) -> None:
    """Raise ValueError naming what is missing, unexpected or misshapen in ``state`` for ``config``'s model."""
    expected = parameter_shapes(config)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = [f"{n} {tuple(state[n].shape)} (expected {expected[n]})" for n in expected
                 if n in state and tuple(state[n].shape) != expected[n]]
    problems = [f"{what}: {', '.join(names[:8])}" for what, names in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", misshapen)) if names]
    if problems:
        raise ValueError(f"state dict does not fit model {config.name!r}: " + "; ".join(problems))
