"""``splitserve bench moe``: a mixture of experts beside a dense model of the same active parameters per token, prefill
and decode, on one pinned thread (issue 47's benchmark line).

Two random checkpoints that ``transformers`` builds and saves (its Mixtral and Mistral classes; the ``test`` extra),
sharing everything but the MLP: the MoE's ``--experts`` experts of width ``--expert-width``, each token taking
``--top-k`` of them, against a dense MLP of width top-k x expert width, so a token multiplies the same number of
weights in both. Each gets an offline ``LLM`` (float32, prefix caching off), pinned with the process to the last CPU
it may use, one thread. Then ``--repeat`` rounds, the two models taking turns in each: a ``--prompt-tokens`` prefill
(a prompt's first token out; seconds and tokens/s) and ``--decode-steps`` decode steps of one sequence (ms per step).
Medians over the rounds with [min-max], and the MoE over the dense model. With ``--dispatch``, the MoE again over 2
tensor-parallel ranks (the process's cores split between them) with each ``moe_dispatch``, one engine after the other
(an engine's ranks hold their cores until it stops): the all-reduce of its experts' shares against the all-to-all of
its tokens (engine/parallel/expert_dispatch.py).

What it shows: the MoE's layers compose in PyTorch around the native products (no fused layer calls, a Python loop
over the experts that got rows: docs/models.md, "Mixtures of experts"), where the dense model runs the fused native
layers; the same weights read per token, so the ratio is what the composition and the routing cost.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import MOE_DISPATCHES
from splitserve.engine.kernels.cpu_features import cpu_model
from splitserve.measure.figures import FiguresOutput, save_results
from splitserve.measure.pinning import one_pinned_thread
from splitserve.runtime.config import described, parse_config

VOCAB = 256  # the byte-level tokenizer's: ids are what the runs feed, no text


def checkpoints(directory: Path, hidden: int, layers: int, experts: int, top_k: int, width: int,
                seed: int) -> dict[str, Path]:
    """{"moe": Mixtral directory, "dense": Mistral directory} of random weights, the same shapes but the MLP."""
    import transformers

    from splitserve.engine.text.byte_tokenizer import write_byte_level_tokenizer

    common = dict(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=hidden // 4, sliding_window=None, max_position_embeddings=8192,
                  bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    configs = {"moe": transformers.MixtralForCausalLM(transformers.MixtralConfig(
                   intermediate_size=width, num_local_experts=experts, num_experts_per_tok=top_k, **common)),
               "dense": transformers.MistralForCausalLM(transformers.MistralConfig(
                   intermediate_size=top_k * width, **common))}
    paths = {}
    for name, model in configs.items():
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():  # unit-scale activations: 1 / sqrt(fan-in)
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 if p.dim() >= 2 else torch.ones(p.shape))
        paths[name] = directory / name
        model.save_pretrained(paths[name], safe_serialization=True)
        write_byte_level_tokenizer(paths[name], VOCAB)
    return paths


def run(hidden: int, layers: int, experts: int, top_k: int, width: int, prompt_tokens: int, decode_steps: int,
        repeat: int, seed: int, dispatch: bool = False, log=print) -> dict:
    prompt = [(41 * k + 3) % VOCAB for k in range(prompt_tokens)]
    with tempfile.TemporaryDirectory(prefix="splitserve-bench-moe-") as work:
        log(f"building the checkpoints ({layers} layers, hidden {hidden}; {experts} experts of {width}, top "
            f"{top_k}, against a dense MLP of {top_k * width}) ...")
        paths = checkpoints(Path(work), hidden, layers, experts, top_k, width, seed)
        with one_pinned_thread():
            llms = {name: LLM(model=str(path), prefill_compute_dtype="float32", enable_prefix_caching=False,
                              kv_cache_memory_bytes=256 << 20) for name, path in paths.items()}
            figures = _rounds(llms, prompt, decode_steps, repeat, log)
            del llms
        dispatches = {}
        for moe_dispatch in MOE_DISPATCHES if dispatch else ():
            log(f"the MoE over 2 tensor-parallel ranks, moe_dispatch {moe_dispatch} ...")
            llm = LLM(model=str(paths["moe"]), prefill_compute_dtype="float32", enable_prefix_caching=False,
                      kv_cache_memory_bytes=256 << 20, tensor_parallel_size=2, moe_dispatch=moe_dispatch)
            dispatches.update(_rounds({moe_dispatch: llm}, prompt, decode_steps, repeat, log))
            del llm
            gc.collect()  # its ranks stop and this process's CPUs come back before the next engine splits them
    return {"cpu": cpu_model(), "hidden": hidden, "layers": layers, "experts": experts, "top_k": top_k,
            "expert_width": width, "prompt_tokens": prompt_tokens, "decode_steps": decode_steps, "repeat": repeat,
            "models": figures, "dispatch": dispatches}


def _rounds(llms: dict[str, LLM], prompt: list[int], decode_steps: int, repeat: int, log) -> dict:
    """``repeat`` rounds (and a warm-up) of ``_round``, the engines taking turns in each."""
    figures: dict = {name: {"prefill_s": [], "decode_ms": []} for name in llms}
    for r in range(repeat + 1):  # round 0 warms up
        for name, llm in llms.items():
            prefill_s, decode_ms = _round(llm, prompt, decode_steps)
            if r:
                figures[name]["prefill_s"].append(prefill_s)
                figures[name]["decode_ms"].append(decode_ms)
        log(f"round {r}/{repeat}{' (warm-up)' if not r else ''}: " + ", ".join(
            f"{name} prefill {figures[name]['prefill_s'][-1] * 1e3:.0f} ms" if r else name for name in llms))
    return figures


def _round(llm: LLM, prompt: list[int], steps: int) -> tuple[float, float]:
    """A prefill of ``prompt`` (its first token out), then ``steps`` decode steps of one short sequence: (prefill
    seconds, median ms per decode step)."""
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    prefill_s = time.perf_counter() - start
    engine = llm.engine
    engine.add_request("decode", prompt[:16], SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    engine.step()  # its prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return prefill_s, statistics.median(times) * 1e3


def report(results: dict, log=print) -> None:
    r = results
    log(f"\n== mixture of experts beside a dense model of the same active parameters (CPU: {r['cpu']}; one pinned "
        f"thread; {r['layers']} layers, hidden {r['hidden']}; {r['experts']} experts of {r['expert_width']}, top "
        f"{r['top_k']}; median [min-max] of {r['repeat']} rounds) ==")
    _table(r["models"], r["prompt_tokens"], "moe", "dense", log)
    if r["dispatch"]:
        log("\n== the MoE over 2 tensor-parallel ranks (the process's cores split between them): its experts' "
            "outputs summed by the all-reduce, or its tokens sent to their experts' ranks (all-to-all) ==")
        _table(r["dispatch"], r["prompt_tokens"], "all_to_all", "all_reduce", log)


def _table(models: dict, prompt_tokens: int, over: str, base: str, log) -> None:
    log(f"{'':<11}{'prefill ms':>26}{'prefill tok/s':>15}{'decode ms/step':>26}")
    med = {}
    for name, f in models.items():
        prefill, decode = [s * 1e3 for s in f["prefill_s"]], f["decode_ms"]
        med[name] = statistics.median(prefill), statistics.median(decode)
        log(f"{name:<11}{_spread(prefill):>26}{prompt_tokens / med[name][0] * 1e3:>15.0f}{_spread(decode):>26}")
    prefill, decode = (med[over][i] / med[base][i] for i in (0, 1))
    log(f"{over} / {base}: prefill {prefill:.2f}x the time, decode {decode:.2f}x")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


@dataclass
class MoEBenchConfig(FiguresOutput):
    """A mixture of experts beside a dense model of the same active parameters, prefill and decode."""

    hidden: int = field(default=512, metadata=described("Hidden size of both models (4 heads, one KV head)."))
    layers: int = field(default=4, metadata=described("Layers of both models."))
    experts: int = field(default=8, metadata=described("Experts per MoE layer."))
    top_k: int = field(default=2, metadata=described("Experts each token takes."))
    expert_width: int = field(default=1024, metadata=described(
        "Each expert's MLP width; the dense model's is top_k times it."))
    prompt_tokens: int = field(default=512, metadata=described("Tokens of the timed prefill."))
    decode_steps: int = field(default=32, metadata=described("Decode steps timed per round."))
    repeat: int = field(default=3, metadata=described("Rounds, the two models taking turns in each."))
    seed: int = field(default=0, metadata=described("Seed of the random weights."))
    dispatch: bool = field(default=False, metadata=described(
        "Also run the MoE over 2 tensor-parallel ranks with each moe_dispatch (all_reduce, all_to_all), in turn."))

    def __post_init__(self) -> None:
        if min(self.hidden, self.layers, self.experts, self.top_k, self.expert_width, self.prompt_tokens,
               self.decode_steps, self.repeat) < 1 or self.top_k > self.experts or self.hidden % 4:
            raise ValueError("sizes must be positive, top_k at most experts, hidden a multiple of 4")


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(MoEBenchConfig, argv, prog="splitserve bench moe")
    results = run(config.hidden, config.layers, config.experts, config.top_k, config.expert_width,
                  config.prompt_tokens, config.decode_steps, config.repeat, config.seed, config.dispatch)
    report(results)
    save_results(results, config.json)
    return results
