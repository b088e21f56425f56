"""The engine loop: requests in, one scheduled step at a time, tokens out.

``add_request`` wraps a prompt in a ``Sequence`` and hands it to the ``Scheduler``; each ``step`` asks the
scheduler what to run, runs it through the ``ModelRunner`` (model + sampler) and feeds the sampled tokens back,
which appends them, checks stop conditions and frees finished sequences' blocks. With speculative decoding
configured, the ``SpeculativeProposer`` proposes draft tokens for the decoding sequences before the scheduler runs
and learns after the step how many were accepted (engine/speculative/proposer.py). The engine knows token ids
only; text lives in the layer above (the offline ``LLM`` and the router).
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from splitserve.engine.config import EngineConfig
from splitserve.engine.kernels.cpu_features import matrix_features
from splitserve.engine.kernels.cpu_kernels import KernelChoice
from splitserve.engine.kv_groups import block_managers
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.prefill_budget import TPOTSlackBudget
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.engine.sequence import Sequence
from splitserve.engine.speculative.draft_model import DraftModel
from splitserve.engine.speculative.proposer import SpecDecodeCounts, SpeculativeProposer
from splitserve.engine.step_time import StepSample, StepTimeFit, attention_positions
from splitserve.engine.structured_output.grammar import GrammarCompiler
from splitserve.engine.structured_output.masks import GrammarMasks
from splitserve.engine.weights.model_files import load_model_files, resolve_quantization

logger = logging.getLogger(__name__)

# Prompt lengths of warm_up_step_times: a spread of chunk sizes and starts for the fit of a prompt token's cost.
WARM_UP_PROMPTS = (32, 96, 192, 320)


class KVExportHook(Protocol):
    """Told after each layer of a step has written its K/V (the prefill pod streams it to a decode pod)."""

    def wants(self, batch: SchedulerOutput) -> bool: ...

    def on_layer(self, layer: int, batch: SchedulerOutput) -> None: ...


@dataclass
class StepStats:
    """What one engine step did: the pod's load reports and metrics are made of these."""

    num_prefill_tokens: int  # prompt (or recomputed) tokens computed
    num_decode_tokens: int  # sequences that decoded (one token, or drafts verified after one)
    num_preempted: int  # sequences preempted to make room
    num_context_tokens: int = 0  # positions the step's attention reads, over all its tokens (step_time.py)
    seconds: float = 0.0  # wall time of the model run and the bookkeeping around it
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)  # the step's drafts and acceptances

    @classmethod
    def of(cls, batch: SchedulerOutput) -> "StepStats":
        decodes = [item for item in batch.scheduled if item.num_new_tokens - len(item.draft_token_ids) == 1
                   and item.start >= item.seq.num_prompt_tokens]
        decode_rows = sum(item.num_new_tokens for item in decodes)
        context = sum(attention_positions(item.start, item.num_new_tokens) for item in batch.scheduled)
        return cls(batch.num_batched_tokens - decode_rows, len(decodes), len(batch.preempted), context)

    def sample(self) -> StepSample:
        """What the step-time fit learns from this step."""
        return StepSample(self.num_decode_tokens, self.num_prefill_tokens, self.num_context_tokens, self.seconds)


class EngineStepError(RuntimeError):
    """A step failed; ``sequences`` are the requests it held, already aborted and freed."""

    def __init__(self, sequences: list[Sequence], cause: Exception):
        super().__init__(f"engine step failed for {len(sequences)} request(s): {cause!r}")
        self.sequences = sequences


def _return_freed_heap() -> None:
    """Hand the heap pages that loading freed back to the kernel. glibc keeps freed memory for reuse, and a load
    frees hundreds of MiB of it (the file's tensors, their widened, fused and packed copies) that an engine never
    allocates again: resident for nothing, most of a float32 pod's and a third of a ``gguf`` pod's. glibc's
    ``malloc_trim``; a no-op elsewhere."""
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config = replace(config, quantization=resolve_quantization(config))  # "auto" decided, as reported
        self.config = config
        loaded = load_model_files(config.model, seed=config.seed, quantization=config.quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        masks = GrammarMasks(GrammarCompiler(self.tokenizer, self.model_config.vocab_size),
                             self.model_config.vocab_size, self.tokenizer.eos_token_ids)
        self.runner = ModelRunner(config, loaded.config, loaded.state_dict, masks)
        del loaded  # the file's tensors: the model keeps its own (fused, packed) copies
        self.block_manager = block_managers(config, self.model_config, self.runner.kv_cache)
        eos_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids))
        self.step_times = StepTimeFit()  # this engine's measured step-time model (engine/step_time.py)
        budget = (TPOTSlackBudget(lambda: self.step_times.model, config.scheduler.default_tpot_target_s)
                  if config.scheduler.tpot_slack_chunking else None)
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, eos_ids, self.model_config.max_position_embeddings, budget
        )
        self.kv_export: KVExportHook | None = None
        self.proposer = self._proposer(config, self.tokenizer) if config.speculative else None
        self.spec_decode = SpecDecodeCounts()  # since the engine started
        self.last_step: StepStats | None = None  # the latest step that ran
        _return_freed_heap()
        weights = self.weight_bytes
        logger.info(
            "engine ready: model=%s layers=%d kv_blocks=%d x %d tokens; compute path: %s; prefill computes in %s on %s "
            "(CPU features: %s); weights %.1f MiB, + %.1f MiB of bf16 copies for prefill", self.model_config.name,
            self.model_config.num_layers, self.runner.kv_cache.num_blocks, config.cache.block_size, self.compute_path,
            self.prefill_compute, self.runner.model.prefill_isa, matrix_features(), weights["model"] / 2**20,
            weights["bf16_prefill"] / 2**20,
        )

    def _proposer(self, config: EngineConfig, tokenizer) -> SpeculativeProposer:
        if config.speculative.method != "draft":
            return SpeculativeProposer(config.speculative)
        draft = DraftModel(config, self.model_config, tokenizer, self.runner.kv_cache.num_blocks)
        logger.info("draft model %s: %.0f%% of the target's parameters", draft.config.name,
                    100 * draft.parameter_ratio(self.runner.model))
        return SpeculativeProposer(config.speculative, draft, self.block_manager,
                                   draft.parameter_ratio(self.runner.model))

    @property
    def compute_path(self) -> KernelChoice:
        """What runs the model's layers: the native CPU kernels, or PyTorch ops and why (for logs and metrics)."""
        return self.runner.model.compute_path

    @property
    def prefill_compute(self) -> str:
        """What prefill's products compute in (``float32``, ``bfloat16``): ``prefill_compute_dtype`` as resolved
        for this CPU at load (engine/kernels/cpu_features.py)."""
        return self.runner.model.prefill_dtype

    @property
    def weight_bytes(self) -> dict[str, int]:
        """The memory the weights take, by form: ``model`` (the model's parameters, which decode computes from:
        float32 panels or the file's quantized blocks, the embeddings and the head) and ``bf16_prefill`` (the bf16
        copies of the layers' products that prefill computes from where it resolved to bfloat16; else 0). A pod whose
        prefill is bf16 holds both: its decode rows (a decode or mixed pod's outputs, a migrated request's recomputed
        outputs) compute from the model's; a prefill pod's (``prefill_only``) model then holds only the embeddings
        (the head, when tied), the norms and the biases, as its layers compute from the bf16 copies alone."""
        model = self.runner.model
        return {"model": sum(p.nbytes for p in model.parameters()),
                "bf16_prefill": 0 if model.bf16_prefill is None else model.bf16_prefill.nbytes}

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resume_token_ids: list[int] = (), priority: int = 0) -> Sequence:
        """Queue a request; raises ValueError for a prompt that can never run (empty, too long, bad token id).
        ``priority``: vLLM's, lower first (``Scheduler``: the waiting queue's order and the preemption victims).

        ``resume_token_ids``: output tokens the request already generated elsewhere (a migrated request). They are
        prefilled after the prompt and count as output (max_tokens, min_tokens, penalties), and sampling goes on at
        the next position, so greedy and seeded requests continue exactly as they would have."""
        self._validate_prompt(prompt_token_ids)
        self._validate_token_ids(resume_token_ids, "resume_token_ids")
        if len(prompt_token_ids) + len(resume_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt + resume_token_ids have {len(prompt_token_ids) + len(resume_token_ids)} "
                             f"tokens; the model's context is {self.max_model_len}")
        seq = Sequence(request_id, list(prompt_token_ids), params, output_token_ids=list(resume_token_ids),
                       priority=priority)
        self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> Sequence | None:
        seq = self.scheduler.abort(request_id)
        if seq is not None and self.proposer is not None:
            self.proposer.finished(seq)
        return seq

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def cached_block_hashes(self) -> list[int]:
        """Chained hashes of the blocks in the prefix cache, oldest first: a pod's heartbeat publishes them so that
        the router can send a prompt where its prefix is cached."""
        return self.block_manager.cached_block_hashes()

    def step(self) -> list[Sequence]:
        """Run one scheduled batch; returns the sequences that got a token or finished in it."""
        if self.proposer is not None:
            # A guided sequence is not speculated for: its drafts would be verified without the grammar's masks.
            self.proposer.propose([seq for seq in self.scheduler.running
                                   if seq.num_computed_tokens == seq.num_tokens - 1
                                   and seq.sampling_params.structured_output is None])
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            return []
        stats, started = StepStats.of(scheduled), time.perf_counter()
        try:
            sampled = self.runner.execute(scheduled, self._layer_hook(scheduled))
        except Exception as exc:
            # Fail only the requests of this step (their blocks are freed); the engine keeps serving the rest.
            failed = [s.seq for s in scheduled.scheduled]
            for seq in failed:
                self.scheduler.abort(seq.request_id)
            raise EngineStepError(failed, exc) from exc
        self._count_accepted(scheduled, sampled, stats.spec_decode)
        updated = self.scheduler.update_from_output(scheduled, sampled)
        if self.proposer is not None:
            for seq in updated:
                if seq.is_finished:
                    self.proposer.finished(seq)
        stats.seconds = time.perf_counter() - started
        self.step_times.observe(stats.sample())
        self.last_step = stats
        return updated

    def warm_up_step_times(self, max_tokens: int = 4) -> None:
        """Run made-up prompts before serving so that the step-time fit has measured prompt tokens, decode rows and
        attention context (a decode pod may otherwise see no prefill until it is lent one; a prefill pod, with
        ``max_tokens`` 1, measures prompts alone, which the router's placement reads): prompts of growing length
        over one token stream, each prefilling after the previous one's cached prefix (chunks that start late),
        then fresh ones together. Call it before the engine loop starts; every request finishes here."""
        vocab = self.model_config.vocab_size
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        rounds = [[(n, 1)] for n in WARM_UP_PROMPTS] + [[(n, 2 + i) for i, n in enumerate(WARM_UP_PROMPTS)]]
        blocks = self.block_manager
        pool_tokens = (blocks.num_blocks - blocks.keeps_open_blocks) * blocks.block_size  # (less an open block)
        room = min(self.max_model_len, pool_tokens) - max_tokens - 1  # a small pool too
        for r, prompts in enumerate(rounds):
            for n, stream in prompts:
                n = max(1, min(n, room))
                self.add_request(f"warm-up-{r}-{stream}", [(97 * stream * (k + 1)) % vocab for k in range(n)], params)
            while self.has_unfinished_requests():
                self.step()

    def _count_accepted(self, batch: SchedulerOutput, sampled, counts: SpecDecodeCounts) -> None:
        for item in batch.scheduled:
            if item.draft_token_ids and item.seq.request_id in sampled:
                num_accepted = len(sampled[item.seq.request_id]) - 1
                self.proposer.observe(item.seq, len(item.draft_token_ids), num_accepted)
                counts.add(len(item.draft_token_ids), num_accepted)
                self.spec_decode.add(len(item.draft_token_ids), num_accepted)

    def _layer_hook(self, batch: SchedulerOutput) -> Callable[[int], None] | None:
        hook = self.kv_export
        if hook is None or not hook.wants(batch):
            return None
        return lambda layer: hook.on_layer(layer, batch)

    # ---- KV transfer: the decode side receives a prompt's KV computed elsewhere ------------------------------
    def reserve_for_transfer(self, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams) -> Sequence | None:
        """Allocate blocks for a prompt whose KV will arrive from a prefill pod; None when the pool is full.
        The sequence is not scheduled until ``admit_prefilled``; ``release_transfer`` gives the blocks back."""
        self._validate_prompt(prompt_token_ids)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        return seq if self.scheduler.reserve_transfer(seq) else None

    def admit_prefilled(self, seq: Sequence, first_token_id: int,
                        first_logprobs: dict[int, float] | None = None) -> Sequence:
        """Join a transferred sequence (its prompt's KV written) to the running batch with its first token."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.append_token(first_token_id, first_logprobs)
        self.scheduler.add_prefilled(seq)
        return seq

    def cache_transferred_prefix(self, seq: Sequence) -> None:
        """Hand a transferred prompt prefix's KV (a split prefill: ``seq`` holds the first tokens of a prompt that
        prefills here) to the prefix cache: its full blocks are cached and released, and the request added next finds
        them at admission. They are evictable from then on, the most recently freed: a request that waits long
        behind others under a full pool may compute them again, which changes its time, not its answer."""
        self.scheduler.cache_transferred_prefix(seq)

    def fork_prefilled(self, seq: Sequence, request_id: str, params: SamplingParams) -> Sequence | None:
        """A sequence of its own for one sample of a prompt whose KV ``seq`` holds (reserved for a transfer, never
        scheduled): it shares the prompt's full blocks and gets a copy of the last, partly filled one. Admit it with
        ``admit_prefilled`` and its own first token. None when the pool has no block for the copy."""
        child = Sequence(request_id, list(seq.prompt_token_ids), params)
        seq.num_computed_tokens = seq.num_prompt_tokens  # its KV is all there
        copies = self.block_manager.fork(seq, child)
        if copies is None:
            return None
        cache = self.runner.kv_cache
        for table, *blocks in copies:
            source, copy = (cache.slots([block], 0, cache.block_size) for block in blocks)
            for layer in (layer for layer in range(cache.num_layers) if cache.table_of(layer) == table):
                for kind in ("k", "v"):
                    cache.write_rows(layer, kind, copy, cache.read_rows(layer, kind, source))
        return child

    def release_transfer(self, seq: Sequence) -> None:
        """Free the blocks of a reserved transfer that will never be admitted (lease expired, abort, bad KV)."""
        self.scheduler.release_transfer(seq)

    def _validate_token_ids(self, token_ids, what: str) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} token ids must be integers in [0, {vocab}); got {bad[:5]}")

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self._validate_token_ids(prompt_token_ids, "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_token_ids)} tokens; the model's context is {self.max_model_len}"
            )
