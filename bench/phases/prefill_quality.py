"""``splitserve bench phases --prefill-formats``'s quality table: each prefill format's answers against float32's on
the real model (SmolLM2-135M): teacher-forced top-1 agreement over three chat prompts and the 128 tokens float32
generates greedily from each (every position's most likely next token, the whole sequence run as one prefill;
target >= 99%), and the perplexity of GPL-3's text (Debian ships it) in two windows of 1,024 tokens (target within
+0.5% of float32's).

The formats: ``bfloat16``, the engine's bf16 prefill as it serves; and int8 W8A8 *simulated* (``w8a8-token``,
``w8a8-group32``): int8 weights per output channel and int8 activations per token (or per group of 32 inputs), the
products' sums in float64, on the PyTorch path (``cpu_kernels=False``): what an int8 prefill kernel would answer, up to
its summation order, so that whether one is worth building is measured before it is built. ``float32-pytorch`` is the
simulation's control: the PyTorch path unquantized, whose figures show how far the harness alone moves them.
tests/test_bf16_prefill_smollm2.py holds the bf16 figures to their targets with the same functions.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.kv_formats import open_keys
from splitserve.engine.model.attention import AttentionMetadata

GENERATED = 128
REFERENCE_TEXT = Path("/usr/share/common-licenses/GPL-3")
WINDOW, WINDOWS = 1024, 2  # tokens per perplexity window, windows
BLOCK = 16
# Three chat prompts: one prompt's ~170 positions is too few to tell 99% from 98% (a few near-ties decide it).
QUESTIONS = ("Explain how a CPU cache works, step by step, for a new engineer.",
             "Write a short story about a lighthouse keeper.", "What are the main causes of inflation?")
TARGETS = {"top1_min": 0.99, "ppl_change_max_pct": 0.5}
SIMULATED = {"float32-pytorch": None, "w8a8-token": 0, "w8a8-group32": 32}  # activation group (0: per token)
PRODUCTS = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@torch.inference_mode()
def sequence_logits(llm: LLM, tokens: list[int], cache_dtype: str = "float16") -> torch.Tensor:
    """Every position's next-token logits [n, V] float32, the sequence run as one prefill on a cache of its own (the
    pods' default cache dtype, float16, unless ``cache_dtype`` names another). Each position attends over the K/V
    as the cache holds them, its own included: what a decode step over that pool attends over (a scaled pool's own
    block's keys in float16, from an open block past the sequence's)."""
    model = llm.engine.runner.model
    n = len(tokens)
    blocks = -(-n // BLOCK)
    cache = PagedKVCache(model.config, blocks + 1, BLOCK, cache_dtype)
    opens = [blocks] if open_keys.used_by(cache.dtype) else None
    meta = AttentionMetadata.build([n], [n], [list(range(blocks))], BLOCK, open_blocks=opens)
    return model.compute_logits(model(torch.tensor(tokens), torch.arange(n), cache, meta))


def agreement_sequences(reference: LLM) -> list[list[int]]:
    """The three prompts, each followed by the 128 tokens ``reference`` generates greedily."""
    prompts = [reference.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    outputs = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True))
    return [out.prompt_token_ids + out.token_ids for out in outputs]


def top1_agreement(reference: LLM, candidate: LLM, sequences: list[list[int]]) -> float:
    """The share of the sequences' positions whose most likely next token is the same under both."""
    agree = sum(int((sequence_logits(reference, s).argmax(-1) == sequence_logits(candidate, s).argmax(-1)).sum())
                for s in sequences)
    return agree / sum(len(s) for s in sequences)


def perplexity_tokens(llm: LLM) -> list[int]:
    """The reference text's first ``WINDOW * WINDOWS`` tokens (empty where the text is missing)."""
    if not REFERENCE_TEXT.is_file():
        return []
    return llm.tokenizer.encode(REFERENCE_TEXT.read_text())[: WINDOW * WINDOWS]


def perplexity(llm: LLM, tokens: list[int]) -> float:
    """exp(mean next-token NLL) over ``tokens`` in windows of ``WINDOW``."""
    nll = [F.cross_entropy(sequence_logits(llm, w)[:-1], torch.tensor(w[1:]))
           for w in (tokens[i: i + WINDOW] for i in range(0, len(tokens), WINDOW))]
    return torch.stack(nll).mean().exp().item()


def w8a8_simulated(model: str, group: int | None) -> LLM:
    """The model on the PyTorch path with its layers' products in simulated W8A8: weights rounded to int8 per output
    channel, inputs to int8 per token (``group`` 0) or per ``group`` inputs, products summed in float64. ``group``
    None: unquantized (the control)."""
    llm = LLM(model=model, quantization="none", cpu_kernels=False, prefill_compute_dtype="float32",
              kv_cache_memory_bytes=64 << 20)
    if group is None:
        return llm
    for layer in llm.engine.runner.model.layers:
        for name in PRODUCTS:
            linear = layer.get_submodule(name)
            linear.weight.data = _int8_round_trip(linear.weight.data.unsqueeze(1)).squeeze(1)
            linear.forward = _w8a8_forward(linear, group)
    return llm


def _int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., groups, size] rounded to int8 with one symmetric scale per group (its largest magnitude -> 127)."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def _w8a8_forward(linear, group: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        grouped = x.view(len(x), 1, -1) if group == 0 else x.view(len(x), -1, group)
        y = F.linear(_int8_round_trip(grouped).view_as(x).double(), linear.weight.double()).float()
        return y if linear.bias is None else y + linear.bias
    return forward


def run(model: str, log=print) -> dict:
    """{format: {"top1_agreement", "perplexity", "ppl_change_pct"}} against float32, with float32's perplexity."""
    reference = LLM(model=model, prefill_compute_dtype="float32", kv_cache_memory_bytes=64 << 20)
    sequences, text = agreement_sequences(reference), perplexity_tokens(reference)
    base = perplexity(reference, text) if text else float("nan")
    candidates = {"bfloat16": lambda: LLM(model=model, prefill_compute_dtype="bfloat16",
                                          kv_cache_memory_bytes=64 << 20),
                  **{name: (lambda g=g: w8a8_simulated(model, g)) for name, g in SIMULATED.items()}}
    results = {"positions": sum(len(s) for s in sequences), "float32_perplexity": base, "formats": {}}
    for name, build in candidates.items():
        log(f"quality: {name} ...")
        llm = build()
        ppl = perplexity(llm, text) if text else float("nan")
        results["formats"][name] = {"top1_agreement": top1_agreement(reference, llm, sequences), "perplexity": ppl,
                                    "ppl_change_pct": 100 * (ppl / base - 1)}
    return results


def report(results: dict, log=print) -> None:
    log(f"\n== prefill formats' quality against float32 (top-1 over {results['positions']} teacher-forced positions, "
        f"target >= {TARGETS['top1_min']:.0%}; perplexity of GPL-3, float32 {results['float32_perplexity']:.3f}, "
        f"target <= +{TARGETS['ppl_change_max_pct']}%) ==")
    log(f"{'format':<16}{'top-1':>9}{'perplexity':>12}{'change':>9}  meets targets")
    for name, r in results["formats"].items():
        ok = (r["top1_agreement"] >= TARGETS["top1_min"] and r["ppl_change_pct"] <= TARGETS["ppl_change_max_pct"])
        log(f"{name:<16}{r['top1_agreement']:>9.2%}{r['perplexity']:>12.3f}{r['ppl_change_pct']:>+8.2f}%  "
            f"{'yes' if ok else 'no'}")
    log("(w8a8-*: simulated int8 weights per channel and activations per token / per 32 inputs, float64 sums; "
        "float32-pytorch: the simulation's unquantized control)")
