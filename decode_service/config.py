"""``DecodeConfig``: a decode or mixed pod's settings, filled by ``splitserve.runtime.config.parse_config`` from flags
(``--kv-lease-s``) and ``SPLITSERVE_*`` environment variables. The fields every pod shares come from ``PodConfig``;
checked in ``__post_init__``, so a bad value stops the pod at start, naming the field.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from splitserve.engine.config import KV_LEASE_S, SPECULATIVE_METHODS, EngineConfig, SpeculativeConfig
from splitserve.kvtransfer.codecs import available_codecs
from splitserve.kvtransfer.receiver import KV_LOAD_FAILURE_POLICIES
from splitserve.kvtransfer.shm import DEFAULT_SHM_DIR
from splitserve.runtime.config import member
from splitserve.runtime.kv_codecs import check_kv_codecs
from splitserve.runtime.pod_server import PodConfig
from splitserve.runtime.roles import Role


@dataclass
class DecodeConfig(PodConfig):
    """A splitserve decode pod (or mixed pod): takes in prompt KV and streams generated tokens."""

    port: int = field(default=50062, metadata={"help": "gRPC port of the Decode and KVTransfer services (0: any)."})
    role: Role = field(default=Role.DECODE, metadata={"help": (
        "'decode' (prompts prefilled on prefill pods, or here when the router says so) or 'mixed' (the colocated "
        "baseline: both phases here); it names the pod in the registry and the metrics.")})
    kv_lease_s: float = field(default=KV_LEASE_S, metadata={"help": (
        "How long pushed KV waits for its Decode call when the push names no lease.")})
    accepted_kv_codecs: list[str] = field(default_factory=available_codecs, metadata={"help": (
        "KV codecs this pod decodes (comma-separated); pushes with others fail the handshake.")})
    kv_load_failure_policy: str = field(default="fail", metadata={"help": (
        "When pushed KV fails to load (a corrupt chunk, a lease gone): 'fail' the request (the router retries it "
        "elsewhere, and the failure shows) or 'recompute' the prompt on this pod. 'fail' by default, as vLLM's: a "
        "silent recompute hides a broken link or a misconfigured pod behind slow answers.")})
    kv_shm_dir: str = field(default=DEFAULT_SHM_DIR, metadata={"help": (
        "Directory prefill pods on this host put shared-memory KV arenas in (kvtransfer/shm.py; in Kubernetes a "
        "volume both pods mount at this path); empty: KV over gRPC only.")})
    # Speculative decoding (engine/speculative/proposer.py, docs/speculative.md), vLLM's speculative_config as flags.
    speculative_method: str = field(default="", metadata={"help": (
        f"Speculative decoding: '' (off) or {', '.join(SPECULATIVE_METHODS)} (prompt lookup; suffix: also the pod's "
        "recent responses; draft: --speculative-model).")})
    num_speculative_tokens: int = field(default=SpeculativeConfig.num_speculative_tokens, metadata={"help": (
        "Most draft tokens a request verifies per step (each request adapts below it to its acceptance).")})
    prompt_lookup_max: int = field(default=SpeculativeConfig.prompt_lookup_max, metadata={"help": (
        "ngram, suffix: longest suffix looked up in the prompt and output (and, suffix, recent responses).")})
    prompt_lookup_min: int = field(default=SpeculativeConfig.prompt_lookup_min, metadata={"help": (
        "ngram, suffix: shortest suffix looked up.")})
    speculative_model: str = field(default="", metadata={"help": (
        "draft: the draft model (a smaller model of the same tokenizer; names as --model), run on this pod with "
        "its own KV cache.")})
    # Hybrid scheduling (docs/architecture.md, "Hybrid scheduling"): prefills lent to this pod in chunks.
    tpot_slack_chunking: bool = field(default=False, metadata={"help": (
        "Prefill prompts here in chunks sized each step to the largest whose predicted step time (the pod's "
        "measured step-time model) keeps every decoding request within its TPOT target; the pod warms its "
        "step-time model up before serving.")})
    tpot_target_s: float = field(default=0.0, metadata={"help": (
        "TPOT target of decoding requests whose Decode call names none (0: none): what --tpot-slack-chunking and "
        "core lending (--activity-file: how long the pod may pause for a prefill pod's step) keep.")})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.role = member(Role, "role", self.role)
        if not self.role.can_decode:
            raise ValueError(f"role must be one of {Role.DECODE}, {Role.MIXED}, got {self.role.value!r}")
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        check_kv_codecs("accepted_kv_codecs", self.accepted_kv_codecs)
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}, "
                             f"got {self.kv_load_failure_policy!r}")
        if self.kv_shm_dir and not os.path.isdir(self.kv_shm_dir):
            raise ValueError(f"kv_shm_dir: no directory {self.kv_shm_dir!r}")
        if self.tpot_target_s < 0:
            raise ValueError(f"tpot_target_s must be >= 0, got {self.tpot_target_s}")

    def engine_config(self) -> EngineConfig:
        config = super().engine_config()
        scheduler = dataclasses.replace(config.scheduler, tpot_slack_chunking=self.tpot_slack_chunking,
                                        default_tpot_target_s=self.tpot_target_s)
        return dataclasses.replace(config, scheduler=scheduler, speculative=self.speculative_config())

    def speculative_config(self) -> SpeculativeConfig | None:
        if not self.speculative_method:
            return None
        # The flags are independent (as the chart's values are): --speculative-model counts only for draft.
        model = (self.speculative_model or None) if self.speculative_method == "draft" else None
        return SpeculativeConfig(self.speculative_method, self.num_speculative_tokens, self.prompt_lookup_max,
                                 self.prompt_lookup_min, model=model)
