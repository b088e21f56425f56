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
