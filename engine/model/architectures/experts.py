"""``ExpertsFormat``: what a mixture-of-experts entry of the registry states beyond the core (engine/model/moe.py
computes it): how its ``config.json`` names the experts' shape and routing, and how its checkpoints name their
tensors. Its layers' attention is the core's; which layers route to experts is the config's (``moe_layers``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from splitserve.engine.config import ModelConfig

HFConfig = dict[str, Any]  # a config.json, as read


@dataclass(frozen=True)
class ExpertsFormat:
    """``read``: the ``ModelConfig`` fields of a config.json's experts (num_experts, num_experts_per_tok,
    moe_intermediate_size, norm_topk_prob, moe_layers); ``write``: the config.json keys that give them back;
    ``hf_names``: the hub checkpoints' name of each expert part of parameter_layout.py (``router``, ``expert_gate``,
    ``expert_up``, ``expert_down``; with a shared expert ``shared_gate``, ``shared_up``, ``shared_down``,
    ``shared_expert_gate``), ``{i}`` the layer and ``{e}`` the expert."""

    read: Callable[[HFConfig], dict[str, Any]]
    write: Callable[[ModelConfig], HFConfig]
    hf_names: dict[str, str]
