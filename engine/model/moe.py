"""``MoE``: a mixture-of-experts layer's MLP (Qwen3-MoE, Mixtral, Qwen2-MoE), computed as transformers 5.x computes it.

A token's path through it:

    router   logits [T, E] = x W_r^T (float32 on the native products, as every product), softmax in float32 over all
             E experts, the top k; renormalized to sum to 1 where the config says (``norm_topk_prob``: Qwen3-MoE's
             flag; Mixtral always, which is its softmax over the chosen logits)
    group    the (token, expert) pairs sorted by expert (a stable sort: each expert's rows in token order), counted
    experts  for each expert that got rows, its SwiGLU (fused gate|up product, SiLU(gate) * up, down product) on
             those rows only, scaled by each row's routing weight and added into the output at its token's row, the
             experts in ascending order (transformers' order)
    shared   with a shared expert (Qwen2-MoE), every token's SwiGLU scaled by sigmoid(x w_g), added last

so prefill runs one product per expert over all the tokens routed to it (compute-bound: as many rows as the batch
routes there), and a decode step reads only the chosen experts' weights. Each expert's products are ``Linear``s:
the native kernels' (float32 panels or quantized blocks) where the model has them, ``F.linear`` otherwise.

**Batch invariance.** A token's output is the sum, in ascending expert order, of its own k rows' products, and a
native product's row is a function of that row and the weights alone (one tiling, whatever the row count): so a
token's bits do not depend on which other tokens share its step, chunk or experts. (``F.linear`` on the PyTorch path
promises no such thing, as for the dense layers.)

**Expert parallelism.** A tensor-parallel rank holds the experts ``config.expert_range`` (layout.py gives each rank
E / R of them); the router is replicated, so every rank routes every token alike and computes its own experts' rows;
the layer's output is then summed over the ranks by the all-reduce that ends every row-parallel product
(sharded_model.py), so EP rides on the TP group's all-reduce; or, with ``EngineConfig.moe_dispatch`` "all_to_all",
the tokens travel to their experts' ranks (``dispatch``, engine/parallel/expert_dispatch.py).

A shared expert is a dense MLP of its own width, split over tensor-parallel ranks as the dense layers' MLP is
(column- then row-parallel): its partial output times the token's gate is a share of the sum like the experts'.

``tokens_routed`` [E] counts the (token, expert) pairs since the model was built, for the pod's
``splitserve_moe_expert_tokens_total`` (runtime/metrics.py).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels.cpu_kernels import CpuKernels
from splitserve.engine.model.layers import MLP, Products


class MoE(nn.Module):
    """The router and this model's experts (all, or a rank's ``expert_range``), each a dense SwiGLU ``MLP`` of width
    ``moe_intermediate_size``; state-dict names ``router.weight``, ``experts.{e}.gate_up_proj.weight``,
    ``experts.{e}.down_proj.weight`` (parameter_layout.py)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None,
                 products: Products):
        super().__init__()
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        # The gate: never quantized (parameter_layout.product_weights keeps it out of the quantized weights).
        self.router = products.linear("mlp.router", config.hidden_size, config.num_experts, False, dtype, device,
                                      kernels)
        self.first, end = config.expert_range
        self.experts = nn.ModuleDict({
            str(e): MLP(config, dtype, device, kernels, products, f"mlp.experts.{e}.", config.moe_intermediate_size)
            for e in range(self.first, end)
        })
        self.local = list(self.experts.values())  # by expert index - first
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:  # Qwen2-MoE: every token's, scaled by a sigmoid gate
            self.shared_expert = MLP(config, dtype, device, kernels, products, "mlp.shared_expert.",
                                     config.shared_expert_intermediate_size)
            self.shared_expert_gate = products.linear("mlp.shared_expert_gate", config.hidden_size, 1, False, dtype,
                                                      device, kernels)
        self.register_buffer("tokens_routed", torch.zeros(config.num_experts, dtype=torch.long), persistent=False)
        # Set on a tensor-parallel rank that sends tokens to their experts' ranks (engine/parallel/expert_dispatch.py):
        # ``dispatch(self, x)`` is then the layer's whole output; None: this rank's experts' share.
        self.dispatch = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> each token's top-k experts [T, k] and their weights [T, k] float32."""
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:  # summed in one order whatever T (a reduction may group a row's k otherwise at other T)
            total = weights[:, 0].clone()
            for j in range(1, self.top_k):
                total += weights[:, j]
            weights /= total[:, None]
        return experts, weights

    def counted_route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``route``, its (token, expert) pairs counted per expert in ``tokens_routed`` (the pod's metric)."""
        experts, weights = self.route(x)
        self.tokens_routed.add_(torch.bincount(experts.flatten(), minlength=len(self.tokens_routed)))
        return experts, weights

    def local_rows(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """For each of this rank's experts, in order, the positions of ``ids`` [N] (expert ids) that name it,
        ascending."""
        order = ids.argsort(stable=True)
        counts = torch.bincount(ids, minlength=len(self.tokens_routed))
        starts = [int(counts[: self.first].sum())]
        for n in counts[self.first : self.first + len(self.local)].tolist():
            starts.append(starts[-1] + n)
        return [order[a:b] for a, b in zip(starts, starts[1:])]

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output times each token's gate (Qwen2-MoE); None without one."""
        if self.shared_expert is None:
            return None
        return _sigmoid_per_token(self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> the weighted sum of each token's experts' outputs [T, H] (this rank's experts only)."""
        if self.dispatch is not None:
            return self.dispatch(self, x)
        experts, weights = self.counted_route(x)
        pair_weights = weights.flatten()
        out = torch.zeros_like(x)
        for expert, pairs in zip(self.local, self.local_rows(experts.flatten())):  # pairs grouped by expert
            if len(pairs):
                rows = pairs // self.top_k  # their tokens, in order
                out.index_add_(0, rows, expert(x[rows]).mul_(pair_weights[pairs, None]))
        shared = self.shared_output(x)
        if shared is not None:  # transformers adds it last
            out += shared
        return out


def _sigmoid_per_token(gate: torch.Tensor) -> torch.Tensor:
    """sigmoid of each token's gate [T, 1], its bits independent of T. PyTorch's vectorized CPU loop computes a
    tensor's last (T mod 2 vector widths) elements with the scalar exp, whose last bit may differ from the vector
    one's: a token's gate would change with its place in the batch (measured: one row in 40). A strided input takes
    the element-at-a-time loop for every element."""
    strided = gate.new_empty(len(gate), 2)[:, :1]
    return torch.sigmoid(strided.copy_(gate))


def tokens_routed(layers: nn.ModuleList) -> dict[int, list[int]]:
    """Each mixture-of-experts layer's (token, expert) pairs per expert since the model was built, by layer index:
    what the pod exports as ``splitserve_moe_expert_tokens_total`` (runtime/metrics.py reads it at each scrape)."""
    return {i: layer.mlp.tokens_routed.tolist() for i, layer in enumerate(layers) if isinstance(layer.mlp, MoE)}
