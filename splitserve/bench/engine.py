"""Engine benchmark: splitserve's engine against `transformers` eager on the same weights, in one run.

Prints, for the chosen model (SmolLM2-135M-Instruct by default):
  - prefill tokens/s for 512- and 1024-token prompts, and the share of the float32 matmul peak measured right
    before and after each (the higher of the two: the machine's clock drifts over minutes);
  - decode ms per step at batch 1, 8 and 32 with a 512-token context;
  - the memory-bandwidth floor of a decode step (weights + KV bytes read / measured read bandwidth);
and the ratios the targets are stated in. Figures vary with the machine's load: run it on a quiet machine.
``--cache-dtype bfloat16`` (or float16) runs our engine with a 16-bit KV cache (transformers keeps float32): the
floor then counts 2 bytes per cached element.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass

import torch

from engine import LLM, SamplingParams
from engine.config import CACHE_DTYPES
from engine.weights import export_hf_checkpoint

PROMPT_LENS = (512, 1024)
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 512


@dataclass
class MachinePeaks:
    matmul_gflops: float
    read_gbps: float


def measure_machine(log) -> MachinePeaks:
    """fp32 GEMM peak (2048^3) and streaming read bandwidth (sum over 1 GiB), best of several runs."""
    gemm = matmul_peak()
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32
    read = max(big.numel() * 4 / _time(big.sum, repeat=3) for _ in range(3)) / 1e9
    log(f"machine: fp32 matmul peak {gemm:.1f} GFLOP/s, read bandwidth {read:.1f} GB/s")
    return MachinePeaks(gemm, read)


def matmul_peak(rounds: int = 3) -> float:
    """GFLOP/s of torch's (MKL's) float32 2048^3 matrix multiply, best of `rounds` rounds of 8."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return max(2 * 2048**3 / _time(lambda: a @ b, repeat=8) for _ in range(rounds)) / 1e9


def _time(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def prefill_flops(cfg, num_tokens: int) -> float:
    """Matmul FLOPs of one prefill of `num_tokens` (projections, MLP, causal attention, one lm_head row)."""
    h, d, hq, hkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    per_token_layer = 2 * h * (hq + 2 * hkv) * d + 2 * hq * d * h + 2 * h * 2 * inter + 2 * inter * h
    attention_layer = 2 * 2 * hq * d * num_tokens * (num_tokens + 1) / 2  # QK^T and PV, causal half
    return cfg.num_layers * (per_token_layer * num_tokens + attention_layer) + 2 * h * cfg.vocab_size


def decode_bytes(cfg, weight_bytes: int, batch: int, context: int, cache_elem_bytes: int = 4) -> int:
    """Bytes a decode step must read at least: every weight once, plus each sequence's K and V."""
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cache_elem_bytes * context * batch
    return weight_bytes + kv


def ours_prefill(llm: LLM, prompt_len: int, repeat: int) -> float:
    greedy1 = SamplingParams(temperature=0, max_tokens=1)
    vocab = llm.engine.model_config.vocab_size
    times = []
    for r in range(repeat + 1):
        prompt = torch.randint(100, vocab, (prompt_len,), generator=torch.Generator().manual_seed(r)).tolist()
        start = time.perf_counter()
        llm.generate(prompt, greedy1)
        times.append(time.perf_counter() - start)
    return prompt_len / min(times[1:])


def ours_decode(llm: LLM, batch: int, context: int, steps: int) -> float:
    """Mean seconds per decode step once all `batch` sequences are past their prefill."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    gen = torch.Generator().manual_seed(1000 + batch)
    for i in range(batch):
        engine.add_request(f"bench-{batch}-{i}", torch.randint(100, vocab, (context,), generator=gen).tolist(), params)
    decode_times = []
    while engine.has_unfinished_requests():
        plan_start = time.perf_counter()
        scheduled = engine.scheduler.schedule()
        decoding = all(s.num_new_tokens == 1 for s in scheduled.scheduled) and len(scheduled.scheduled) == batch
        sampled = engine.runner.execute(scheduled)
        engine.scheduler.update_from_output(scheduled, sampled)
        if decoding:
            decode_times.append(time.perf_counter() - plan_start)
    decode_times = decode_times[2:]  # warm-up steps
    return sorted(decode_times)[len(decode_times) // 2]


def hf_model(llm: LLM, tmp: str):
    from transformers import AutoModelForCausalLM

    state = {k: v for k, v in llm.engine.runner.model.state_dict().items()}
    export_hf_checkpoint(llm.engine.model_config, state, tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.inference_mode()
def hf_prefill(model, prompt_len: int, repeat: int) -> float:
    ids = torch.randint(100, model.config.vocab_size, (1, prompt_len))
    return prompt_len / _time(lambda: model(ids, use_cache=True, logits_to_keep=1), repeat)


@torch.inference_mode()
def hf_decode(model, batch: int, context: int, steps: int) -> float:
    ids = torch.randint(100, model.config.vocab_size, (batch, context))
    out = model(ids, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times.append(time.perf_counter() - start)
    times = times[2:]
    return sorted(times)[len(times) // 2]


def run(model: str, steps: int, repeat: int, cache_dtype: str = "float32", log=print) -> dict:
    peaks = measure_machine(log)
    log(f"loading {model} (KV cache {cache_dtype}) ...")
    llm = LLM(model=model, enable_prefix_caching=False, max_num_seqs=max(DECODE_BATCHES),
              max_num_batched_tokens=2048, kv_cache_memory_bytes=3 << 30, cache_dtype=cache_dtype)
    cfg = llm.engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    cache_elem_bytes = llm.engine.runner.kv_cache.k[0].element_size()
    kernels = llm.engine.runner.model.kernels
    log(f"native CPU kernels: {kernels.isa if kernels else 'off (PyTorch path)'}")
    results: dict = {"model": model, "cache_dtype": cache_dtype, "machine": peaks.__dict__,
                     "kernels": kernels.isa if kernels else None, "prefill": {}, "decode": {}}
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model(llm, tmp)
        for n in PROMPT_LENS:
            log(f"prefill {n} tokens ...")
            # The machine's clock drifts by tens of percent over minutes (a shared VM): the peak this prefill is
            # held to is measured right before and right after it, the higher of the two.
            before = matmul_peak()
            ours = ours_prefill(llm, n, repeat)
            peak = max(before, matmul_peak())
            theirs = hf_prefill(hf, n, repeat)
            gflops = prefill_flops(cfg, n) * ours / n / 1e9
            results["prefill"][n] = {"ours_tok_s": ours, "hf_tok_s": theirs, "gflops": gflops,
                                     "peak_gflops": peak, "share_of_peak": gflops / peak}
        for b in DECODE_BATCHES:
            log(f"decode batch {b}, context {DECODE_CONTEXT} ...")
            ours, theirs = ours_decode(llm, b, DECODE_CONTEXT, steps), hf_decode(hf, b, DECODE_CONTEXT, steps)
            floor = decode_bytes(cfg, weight_bytes, b, DECODE_CONTEXT, cache_elem_bytes) / (peaks.read_gbps * 1e9)
            results["decode"][b] = {"ours_ms": ours * 1e3, "hf_ms": theirs * 1e3, "floor_ms": floor * 1e3}
    return results


def report(results: dict, log=print) -> None:
    log("\n== prefill ==")
    log(f"{'tokens':>7} {'ours tok/s':>11} {'hf tok/s':>9} {'ours/hf':>8} {'GFLOP/s':>8} {'peak':>6} {'of peak':>8}")
    for n, r in results["prefill"].items():
        log(f"{n:>7} {r['ours_tok_s']:>11.0f} {r['hf_tok_s']:>9.0f} {r['ours_tok_s'] / r['hf_tok_s']:>7.2f}x "
            f"{r['gflops']:>8.1f} {r['peak_gflops']:>6.0f} {r['share_of_peak']:>7.0%}")
    log("(peak: the fp32 matmul peak measured right before and after that prefill, the higher)")
    log(f"\n== decode (context {DECODE_CONTEXT}, KV cache {results['cache_dtype']}) ==")
    log(f"{'batch':>6} {'ours ms':>8} {'hf ms':>7} {'hf/ours':>8} {'floor ms':>9} {'ours/floor':>11} {'tok/s':>7}")
    for b, r in results["decode"].items():
        log(f"{b:>6} {r['ours_ms']:>8.2f} {r['hf_ms']:>7.2f} {r['hf_ms'] / r['ours_ms']:>7.2f}x "
            f"{r['floor_ms']:>9.2f} {r['ours_ms'] / r['floor_ms']:>10.2f}x {b * 1e3 / r['ours_ms']:>7.0f}")
    d = results["decode"]
    b1, b32 = d[1], d[max(d)]
    log("\n== targets ==")
    log(f"batch-1 decode vs bandwidth floor: {b1['ours_ms'] / b1['floor_ms']:.2f}x (target <= 1.5x)")
    log(f"batch-1 decode vs transformers eager: {b1['hf_ms'] / b1['ours_ms']:.2f}x faster (target >= 2x)")
    scale = (max(d) / b32["ours_ms"]) / (1 / b1["ours_ms"])
    log(f"batch-{max(d)} decode throughput vs batch 1: {scale:.1f}x (target >= 6x)")
    worst = min(r["share_of_peak"] for r in results["prefill"].values())
    log(f"prefill share of fp32 matmul peak: {worst:.0%} at worst (target >= 75%)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="splitserve bench engine", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch size")
    parser.add_argument("--repeat", type=int, default=3, help="prefill repetitions (best is kept)")
    parser.add_argument("--cache-dtype", default="float32", choices=CACHE_DTYPES,
                        help="our engine's KV cache dtype (transformers keeps float32)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results = run(args.model, args.steps, args.repeat, args.cache_dtype)
    report(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
