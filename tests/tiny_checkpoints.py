"""Tiny Hugging Face checkpoint directories built in a test: a byte-level BPE tokenizer of a given vocabulary
(``write_byte_level_tokenizer``, engine/text/byte_tokenizer.py) beside a ``transformers`` model's ``save_pretrained``,
which is what ``LLM(model=DIRECTORY)`` needs (no model hub here); and the harness that holds an architecture's tiny
random checkpoint against ``transformers`` on the same weights (``Shape``, ``Checkpoint``, ``scored``), which the
model registry's tests share."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from splitserve.engine.text.byte_tokenizer import write_byte_level_tokenizer

# ---- an architecture's tiny checkpoint, held against transformers ---------------------------------------------------

VOCAB = 256
TOLERANCE = 1e-4
GREEDY_STEPS = 32
# 40 tokens: two blocks of 16 and a partial one. On every checkpoint the tests build, its 32 greedy steps have top-two
# logit gaps of at least 0.005 in transformers (1e-3 asserted), ~2000 times the engine's distance from it: no near-tie
# decides.
PROMPT = [(41 * k + 3) % VOCAB for k in range(40)]
OTHERS = [[(13 * k + 5) % VOCAB for k in range(23)], [(71 * k + 2) % VOCAB for k in range(9)]]


@dataclass(frozen=True)
class Shape:
    """One architecture's tiny checkpoint: its transformers config and model classes and the config's shape (the
    family's real head_dim and GQA ratio; 2 layers and the byte-level vocabulary are added)."""

    config_cls: type
    model_cls: type
    config: dict

    def hf_config(self, **overrides):
        return self.config_cls(**copy.deepcopy({**self.config, **overrides}),  # a config class mutates its dicts
                               vocab_size=VOCAB, num_hidden_layers=2, rms_norm_eps=1e-6, bos_token_id=0,
                               eos_token_id=1, attn_implementation="eager")


def save_checkpoint(directory: Path, shape: Shape, **overrides):
    """A tiny random checkpoint of ``shape`` saved as safetensors with its tokenizer; the transformers model."""
    import torch

    model = shape.model_cls(shape.hf_config(**overrides)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Matrices 1 / sqrt(fan-in): activations of unit scale at every hidden size and logits of std ~1, with
            # the engine's and transformers' float32 within 3e-6 of float64 (measured; 2 / sqrt(fan-in) doubles the
            # logits and takes it to 2e-5, too near the tolerance); norms around 1, so that a swapped tensor shows.
            scale = 1 / p.shape[-1] ** 0.5 if p.dim() >= 2 else 0.05 if name.endswith("bias") else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory, safe_serialization=True)
    write_byte_level_tokenizer(Path(directory), VOCAB)
    return model


class Checkpoint:
    """One architecture's directory, its transformers model (the reference) and the engine's ``LLM`` over it."""

    def __init__(self, directory: Path, shape: Shape, name: str = "", **overrides):
        self.directory, self.name = directory, name or shape.config_cls.model_type
        self.hf = save_checkpoint(directory, shape, **overrides)

    def llm(self, **settings):
        from splitserve.engine import LLM

        settings = {"num_blocks": 64, "block_size": 16, "cache_dtype": "float32", "prefill_compute_dtype": "float32",
                    **settings}
        return LLM(model=str(self.directory), **settings)

    def logprobs(self, tokens: list[int]):
        """transformers' log-softmax at every position of ``tokens``, [len, V]."""
        import torch

        with torch.no_grad():
            return torch.log_softmax(self.hf(torch.tensor([tokens])).logits[0].double(), -1).float()

    def greedy(self, prompt: list[int], steps: int) -> list[int]:
        """transformers' greedy tokens, each step's top two logits asserted apart by far more than the tolerance
        (else a disagreement would say nothing about the engine)."""
        import torch

        tokens, step_input, cache = [], torch.tensor([prompt]), None
        with torch.no_grad():
            for _ in range(steps):
                out = self.hf(step_input, cache=cache, use_cache=True)
                top = out.logits[0, -1].topk(2)
                assert top.values[0] - top.values[1] > 10 * TOLERANCE, "a near-tie: choose another prompt"
                tokens.append(int(top.indices[0]))
                step_input, cache = top.indices[:1].view(1, 1), out.cache
        return tokens


def scored(llm, prompts: list[list[int]], **settings):
    """``llm``'s greedy answers to ``prompts`` with 5 logprobs and prompt logprobs at every position."""
    from splitserve.engine.sampling.params import SamplingParams

    params = SamplingParams(**{"max_tokens": GREEDY_STEPS, "temperature": 0.0, "ignore_eos": True,
                               "prompt_logprobs": 5, "logprobs": 5, **settings})
    return llm.generate(prompts, params)


# ---- the checks every architecture's module runs on its checkpoints --------------------------------------------------

def architecture_fixtures(shapes: dict[str, Shape]):
    """A test module's ``checkpoint`` fixture (one per shape, module-scoped) and its ``llm`` (the engine over it):
    ``checkpoint, llm = architecture_fixtures(SHAPES)``."""
    import pytest

    @pytest.fixture(scope="module", params=list(shapes))
    def checkpoint(request, tmp_path_factory) -> Checkpoint:
        return Checkpoint(tmp_path_factory.mktemp(request.param), shapes[request.param], request.param)

    @pytest.fixture(scope="module")
    def llm(checkpoint):
        return checkpoint.llm()

    return checkpoint, llm


def check_prompt_logprobs(checkpoint: Checkpoint, **settings) -> None:
    """Prompt logprobs (and the top 5 at each position) within 1e-4 of transformers' on an engine of ``settings``."""
    (out,) = scored(checkpoint.llm(**settings), [PROMPT], max_tokens=0)
    reference = checkpoint.logprobs(PROMPT)
    assert reference.std(dim=-1).min() > 0.5  # a real spread of logprobs at every position: 1e-4 is a tight bound
    for position in range(1, len(PROMPT)):
        entry, expected = out.prompt_logprobs[position], reference[position - 1]
        assert entry.token_id == PROMPT[position]
        assert abs(entry.logprob - expected[PROMPT[position]].item()) <= TOLERANCE, position
        top = expected.topk(5)
        assert list(entry.top) == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(entry.top.values(), top.values.tolist())) <= TOLERANCE


def check_greedy_tokens(checkpoint: Checkpoint, llm) -> None:
    (out,) = scored(llm, [PROMPT])
    assert out.token_ids == checkpoint.greedy(PROMPT, GREEDY_STEPS)


def check_same_bits(checkpoint: Checkpoint, llm) -> None:
    """A prompt's tokens, logprobs and prompt logprobs the same bits alone, beside two other prompts and in chunks of
    8 (each on an engine of its own without prefix caching), and its tokens and logprobs from the prefix cache (``llm``,
    which has run it before)."""
    uncached = {"enable_prefix_caching": False}
    (alone,) = scored(checkpoint.llm(**uncached), [PROMPT])
    beside = scored(checkpoint.llm(**uncached), [OTHERS[0], PROMPT, OTHERS[1]])[1]
    (chunked,) = scored(checkpoint.llm(long_prefill_token_threshold=8, **uncached), [PROMPT])
    for other in (beside, chunked):
        assert other.token_ids == alone.token_ids
        assert other.logprobs == alone.logprobs and other.prompt_logprobs == alone.prompt_logprobs
    scored(llm, [PROMPT])
    (cached,) = scored(llm, [PROMPT], prompt_logprobs=None)
    assert cached.num_cached_tokens == 32  # its two full blocks
    assert (cached.token_ids, cached.logprobs) == (alone.token_ids, alone.logprobs)


def check_ranks_agree(checkpoint: Checkpoint, *parallel: dict, inspect=None) -> None:
    """``checkpoint``'s answer to PROMPT on one process and on each ``parallel`` setting (``tensor_parallel_size``,
    ``pipeline_parallel_size``): the same greedy tokens, prompt logprobs within 1e-4 (the row-parallel sums round in
    another order). ``inspect(llm)`` looks into each parallel engine before it stops. Each engine is collected
    before the next starts: its ranks stop, and this thread's CPU mask comes back (the later modules' clusters plan
    over every CPU again)."""
    import gc
    import os

    mask = os.sched_getaffinity(0)
    answers = []
    for settings in ({}, *parallel):
        llm = checkpoint.llm(**settings)
        answers.append(scored(llm, [PROMPT])[0])
        if settings and inspect is not None:
            inspect(llm)
        del llm
        gc.collect()
    assert os.sched_getaffinity(0) == mask
    one, *split = answers
    for other in split:
        assert other.token_ids == one.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(one.prompt_logprobs[1:], other.prompt_logprobs[1:])) \
            <= TOLERANCE


class PrefillDecodeCluster:
    """``splitserve up`` of ``checkpoint`` with one prefill and one decode pod (``start_cluster``, the tests'
    fixture), both pools of ``cache_dtype``, and the greedy answers to PROMPT and OTHERS of the offline engine with
    that pool: entering starts the cluster and checks that every prompt prefilled on the prefill pod, its KV loaded on
    the decode pod, and gave the offline engine's tokens, and that the ``openai`` client's completion of PROMPT
    through the router's HTTP API is its text (the test then checks what else it wants on ``.cluster`` and
    ``.client``); leaving waits for every block to be free, and stops
    it."""

    def __init__(self, start_cluster, directory: Path, checkpoint: Checkpoint, kv_codec: str = "none",
                 cache_dtype: str = "float16"):
        from splitserve.engine import LLM, SamplingParams

        self.start_cluster, self.directory = start_cluster, directory
        self.checkpoint, self.kv_codec, self.cache_dtype = checkpoint, kv_codec, cache_dtype
        self.prompts = [PROMPT, *OTHERS]
        self.engine = LLM(model=str(checkpoint.directory), prefill_compute_dtype="float32", cache_dtype=cache_dtype)
        self.params = SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True)
        self.offline = self.engine.generate(self.prompts, self.params)
        self.greedy = dict(temperature=0, extra_body={"ignore_eos": True})  # the openai client's greedy settings

    def __enter__(self) -> "PrefillDecodeCluster":
        from tests.reliability.live_cluster import START_S, TINY, openai_client_of, stream
        from tests.test_tp_cluster import kv_loaded

        self.cluster = self.start_cluster(self.directory, **{
            **TINY, "model": str(self.checkpoint.directory), "prefill": 1, "decode": 1, "kv_codec": self.kv_codec,
            "cache_dtype": self.cache_dtype, "conditional_prefill_threshold": 0, "decode_pod_wait_s": START_S})
        try:
            answers = [stream(self.cluster, prompt, GREEDY_STEPS, timeout_s=START_S) for prompt in self.prompts]
            assert [(a.finish, a.error) for a in answers] == [("FINISH_REASON_LENGTH", "")] * len(self.prompts)
            assert [a.token_ids for a in answers] == [out.token_ids for out in self.offline]
            assert kv_loaded(self.cluster, self.cluster.pods[1]) == len(self.prompts)  # each came from the P pod
            self.client = openai_client_of(self.cluster)  # the HTTP API too: the first prompt's text
            self.model = self.client.models.list().data[0].id
            completion = self.client.completions.create(model=self.model, prompt=PROMPT, max_tokens=GREEDY_STEPS,
                                                        **self.greedy)
            assert completion.choices[0].text == self.offline[0].text and self.offline[0].text
        except BaseException:
            self.cluster.stop()
            raise
        return self

    def __exit__(self, kind, *_) -> None:
        from tests.reliability.live_cluster import wait_every_block_free

        try:
            if kind is None:
                wait_every_block_free(self.cluster)
        finally:
            self.cluster.stop()


def check_export(checkpoint: Checkpoint, directory: Path):
    """``export_hf_checkpoint`` of the loaded checkpoint into ``directory``: transformers loads it as the same class,
    with the same logits, bit for bit; the ``ModelConfig`` it was loaded as (for the caller's further checks)."""
    import json

    import torch
    import transformers

    from splitserve.engine.weights.hf_checkpoint import export_hf_checkpoint, load_hf_checkpoint

    config, state = load_hf_checkpoint(checkpoint.directory)
    export_hf_checkpoint(config, state, directory)
    assert json.loads((directory / "config.json").read_text())["model_type"] == checkpoint.hf.config.model_type
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    assert type(reloaded) is type(checkpoint.hf)
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        assert torch.equal(reloaded(ids).logits, checkpoint.hf(ids).logits)
    return config
