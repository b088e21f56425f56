"""Engine benchmark: splitserve's engine against `transformers` eager on the same weights, in one run.

Prints, for the chosen model (SmolLM2-135M-Instruct by default):
  - prefill tokens/s for prompts of ``PROMPT_LENS`` tokens, and the share of the float32 matmul peak measured right
    before and after each (the higher of the two: the machine's clock drifts over minutes);
  - decode ms per step at the batch sizes of ``DECODE_BATCHES`` with a context of ``DECODE_CONTEXT`` tokens, for
    each KV cache dtype asked for (float16, the engine's default, and float32 by default); the batch sizes take
    turns over ``--rounds`` rounds and each keeps its best round, so the largest / batch-1 ratio compares the
    machine in the same state;
  - the memory-bandwidth floor of a decode step (weights + KV bytes read / the read bandwidth measured at the start
    of the round the step time comes from);
and the ratios the targets are stated in, per cache dtype. Figures vary with the machine's load: run it on a quiet
machine; the README holds measured figures. transformers keeps its own float32 cache throughout.

With ``--quantizations none,gguf,int8,int4`` it compares the weight formats instead (docs/quantization.md), one
engine at a time, at each of ``--threads``: decode ms per step at the batch
sizes of ``DECODE_BATCHES`` against each format's own floor (its weights' bytes + K/V over the read bandwidth),
prefill tokens/s at ``QUANT_PROMPT_LENS``, the weights' resident bytes, and perplexity on the codec benchmark's
text (GPL-3) against float32's.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import dataclass, field

import torch

from splitserve.bench.phases.step_cost import decode_bytes, prefill_flops
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import CACHE_DTYPES, DEFAULT_MODEL, QUANTIZATIONS
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.weights.hf_checkpoint import export_hf_checkpoint
from splitserve.engine.weights.model_files import load_model_files
from splitserve.measure.figures import FiguresOutput, headless_pyplot, save_figure, save_results
from splitserve.runtime.config import described, parse_config

PROMPT_LENS = (512, 1024)
QUANT_PROMPT_LENS = (512, 2048)
PERPLEXITY_WINDOW = 512  # tokens per perplexity window (each scores its 511 next-token predictions)
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXT = 512


@dataclass
class MachinePeaks:
    matmul_gflops: float
    read_gbps: float


def measure_machine(log, rounds: int = 3) -> MachinePeaks:
    """fp32 GEMM peak (2048^3) and streaming read bandwidth (sum over 1 GiB), best of `rounds` rounds each."""
    gemm, read = matmul_peak(rounds), read_bandwidth(rounds)
    log(f"machine: fp32 matmul peak {gemm:.1f} GFLOP/s, read bandwidth {read:.1f} GB/s")
    return MachinePeaks(gemm, read)


def read_bandwidth(rounds: int = 3) -> float:
    """GB/s of a streaming read (torch's sum over 1 GiB of float32), best of `rounds` rounds of 3."""
    big = torch.ones(256 * 1024 * 1024)
    return max(big.numel() * 4 / _time(big.sum, repeat=3) for _ in range(rounds)) / 1e9


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


def ours_prefill(llm: LLM, prompt_len: int, repeat: int, salt: int = 0) -> float:
    """Prefill tokens/s of fresh prompts of ``prompt_len`` tokens, best of ``repeat`` (after one warm-up); calls
    on one engine with the same length need distinct ``salt`` values, or their prompts would be cached."""
    greedy1 = SamplingParams(temperature=0, max_tokens=1)
    vocab = llm.engine.model_config.vocab_size
    times = []
    for r in range(repeat + 1):
        # A seed per (length, repeat): prompts of one seed share their first tokens, which the prefix cache would
        # serve instead of computing them.
        seed = (salt * 100_003 + prompt_len) * (repeat + 1) + r
        prompt = torch.randint(100, vocab, (prompt_len,), generator=torch.Generator().manual_seed(seed)).tolist()
        start = time.perf_counter()
        out = llm.generate(prompt, greedy1)[0]
        times.append(time.perf_counter() - start)
        if out.num_cached_tokens:
            raise RuntimeError(f"prefill prompt {r} of {prompt_len} tokens hit the prefix cache")
    return prompt_len / min(times[1:])


def decode_prompt(vocab: int, i: int, context: int) -> list[int]:
    """Prompt i of every decode batch: batch b runs prompts 0..b-1, so after the first round they are all
    prefix-cache hits and a round costs its decode steps only."""
    return torch.randint(100, vocab, (context,), generator=torch.Generator().manual_seed(1000 + i)).tolist()


def ours_decode(llm: LLM, batch: int, context: int, steps: int, tag: str = "") -> float:
    """Median seconds per decode step once all `batch` sequences are past their prefill."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{tag}{batch}-{i}", decode_prompt(vocab, i, context), params)
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

    # The model's weights widened to float32 (the engine may keep a file's quantized blocks: the same model).
    state = load_model_files(llm.engine.config.model, seed=llm.engine.config.seed, quantization="none").state_dict
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


def engine_for(model: str, cache_dtype: str, quantization: str = "none", kv_bytes: int = 4 << 30) -> LLM:
    # Prefix caching lets the decode rounds reuse their prompts' KV; the prefill prompts never repeat, so their
    # figures are whole prefills.
    return LLM(model=model, max_num_seqs=max(DECODE_BATCHES), max_num_batched_tokens=2048,
               kv_cache_memory_bytes=kv_bytes, cache_dtype=cache_dtype, quantization=quantization)


def weight_bytes_of(llm: LLM) -> int:
    """The bytes the model's parameters hold (what a decode step streams): packed floats or quantized blocks."""
    return sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())


@torch.inference_mode()
def perplexity(llm: LLM, tokens: list[int], windows: int) -> float:
    """exp(mean next-token NLL) over ``windows`` consecutive windows of ``PERPLEXITY_WINDOW`` tokens, each prefilled
    alone into a float32 cache of its own (the weights' format is the only difference between engines)."""
    model, block_size = llm.engine.runner.model, 16
    blocks = -(-PERPLEXITY_WINDOW // block_size)
    cache = PagedKVCache(model.config, blocks, block_size, torch.float32)
    nll, count = 0.0, 0
    for w in range(windows):
        ids = torch.tensor(tokens[w * PERPLEXITY_WINDOW:(w + 1) * PERPLEXITY_WINDOW])
        if len(ids) < PERPLEXITY_WINDOW:
            raise SystemExit(f"the perplexity text has {len(tokens)} tokens, fewer than {windows} windows")
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], block_size)
        logits = model.compute_logits(model(ids, torch.arange(len(ids)), cache, meta))  # [n, V]
        nll += torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum").item()
        count += len(ids) - 1
    return float(torch.tensor(nll / count).exp())


def run_quantizations(model: str, quantizations: tuple[str, ...], threads: tuple[int, ...], steps: int,
                      repeat: int, rounds: int, windows: int, machine_rounds: int = 3, log=print) -> dict:
    """Every weight format in turn, one engine at a time (four at once do not fit a small machine's memory beside
    its other work), each measured over ``rounds`` rounds per thread count (module docstring)."""
    from splitserve.measure.codec_texts import reference_tokens  # the codec benchmark's perplexity text

    peaks = measure_machine(log, machine_rounds)
    results: dict = {"model": model, "machine": peaks.__dict__, "rounds": rounds, "formats": {}}
    saved_threads = torch.get_num_threads()
    try:
        for q in quantizations:
            log(f"loading {model} with quantization {q} ...")
            # Room for every decode batch's sequences (context + steps) and the longest prefill, float16 K/V.
            llm = engine_for(model, "float16", q, kv_bytes=512 << 20)
            cfg = llm.engine.model_config
            elem_bytes = llm.engine.runner.kv_cache.element_size
            lens = tuple(n for n in QUANT_PROMPT_LENS if n < cfg.max_position_embeddings)  # prompts it takes
            weights = weight_bytes_of(llm)
            log(f"perplexity of {q} over {windows} windows of {PERPLEXITY_WINDOW} tokens ...")
            result = results["formats"][q] = {
                "weight_bytes": weights, "perplexity": perplexity(llm, reference_tokens(llm.tokenizer), windows),
                "threads": {}}
            for t in threads:
                torch.set_num_threads(t)
                prefill = {n: 0.0 for n in lens}
                best = {b: (float("inf"), 0.0) for b in DECODE_BATCHES}
                for r in range(rounds):
                    read_gbps = read_bandwidth(machine_rounds)
                    log(f"{q}, {t} thread(s), round {r + 1}/{rounds} (read {read_gbps:.1f} GB/s) ...")
                    for n in lens:
                        salt = 1 + r + rounds * threads.index(t)  # fresh prompts every round (no prefix hits)
                        prefill[n] = max(prefill[n], ours_prefill(llm, n, repeat, salt))
                    for b in DECODE_BATCHES:
                        best[b] = min(best[b], (ours_decode(llm, b, DECODE_CONTEXT, steps, tag=f"{t}-{r}-"),
                                                read_gbps))
                result["threads"][t] = {
                    "prefill_tok_s": prefill,
                    "decode": {b: {"ms": s * 1e3, "read_gbps": g,
                                   "floor_ms": decode_bytes(cfg, weights, b, DECODE_CONTEXT, elem_bytes) / g / 1e6}
                               for b, (s, g) in best.items()},
                }
            del llm
            gc.collect()
    finally:
        torch.set_num_threads(saved_threads)
    return results


def report_quantizations(results: dict, log=print) -> None:
    formats = results["formats"]
    base = formats.get("none")
    log(f"\n== weight formats ({results['model']}; best of {results['rounds']} rounds per format) ==")
    log(f"{'format':>7} {'weights MB':>11} {'vs none':>8} {'perplexity':>11} {'vs none':>8}")
    for q, f in formats.items():
        mem = f"{f['weight_bytes'] / base['weight_bytes']:.2f}x" if base else "-"
        ppl = f"{f['perplexity'] / base['perplexity'] - 1:+.2%}" if base else "-"
        log(f"{q:>7} {f['weight_bytes'] / 1e6:>11.1f} {mem:>8} {f['perplexity']:>11.3f} {ppl:>8}")
    first = next(iter(formats.values()))["threads"]
    lens = list(next(iter(first.values()))["prefill_tok_s"])
    for t in first:
        log(f"\n== {t} thread(s): decode ms per step (context {DECODE_CONTEXT}) and its floor, prefill tok/s ==")
        log(f"{'format':>7} " + " ".join(f"{'b' + str(b) + ' ms':>9} {'floor':>6} {'x':>5}" for b in DECODE_BATCHES)
            + " " + " ".join(f"{'pf' + str(n):>8}" for n in lens))
        for q, f in formats.items():
            run_t = f["threads"][t]
            cells = [f"{d['ms']:>9.2f} {d['floor_ms']:>6.2f} {d['ms'] / d['floor_ms']:>5.2f}"
                     for d in run_t["decode"].values()]
            log(f"{q:>7} " + " ".join(cells) + " " + " ".join(f"{v:>8.0f}" for v in run_t["prefill_tok_s"].values()))
        if base:
            none_t = base["threads"][t]
            big = max(DECODE_BATCHES)
            for q, f in formats.items():
                if q == "none":
                    continue
                run_t = f["threads"][t]
                one, many = run_t["decode"][1], run_t["decode"][big]
                log(f"{q}: batch-1 {one['ms'] / one['floor_ms']:.2f}x its floor (target <= 1.5x); batch-{big} "
                    f"throughput {none_t['decode'][big]['ms'] / many['ms']:.2f}x float32's (target >= 1); prefill "
                    + ", ".join(
                        f"{n}: {run_t['prefill_tok_s'][n] / none_t['prefill_tok_s'][n]:.0%}" for n in lens)
                    + " of float32's (target >= 90%)")
    log("(floor: the format's weight bytes + K/V bytes / the read bandwidth measured at the start of that round)")


def run(model: str, steps: int, repeat: int, cache_dtypes: tuple[str, ...] = ("float16", "float32"), rounds: int = 3,
        machine_rounds: int = 3, log=print) -> dict:
    peaks = measure_machine(log, machine_rounds)
    log(f"loading {model} (KV cache {cache_dtypes[0]}) ...")
    llm = engine_for(model, cache_dtypes[0])
    cfg = llm.engine.model_config
    weight_bytes = weight_bytes_of(llm)
    kernels = llm.engine.runner.model.kernels
    log(f"native CPU kernels: {kernels.isa if kernels else 'off (PyTorch path)'}")
    results: dict = {"model": model, "machine": peaks.__dict__, "kernels": kernels.isa if kernels else None,
                     "rounds": rounds, "prefill": {}, "hf_decode_ms": {}, "decode": {}}
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model(llm, tmp)
        for n in PROMPT_LENS:
            log(f"prefill {n} tokens ...")
            # The machine's clock drifts by tens of percent over minutes (a shared VM): the peak this prefill is
            # held to is measured right before and right after it, the higher of the two.
            before = matmul_peak(machine_rounds)
            ours = ours_prefill(llm, n, repeat)
            peak = max(before, matmul_peak(machine_rounds))
            theirs = hf_prefill(hf, n, repeat)
            gflops = prefill_flops(cfg, n) * ours / n / 1e9
            results["prefill"][n] = {"ours_tok_s": ours, "hf_tok_s": theirs, "gflops": gflops,
                                     "peak_gflops": peak, "share_of_peak": gflops / peak}
        for b in DECODE_BATCHES:
            log(f"transformers decode batch {b}, context {DECODE_CONTEXT} ...")
            results["hf_decode_ms"][b] = hf_decode(hf, b, DECODE_CONTEXT, steps) * 1e3
    del hf
    for cache_dtype in cache_dtypes:
        if cache_dtype != cache_dtypes[0]:
            del llm
            log(f"loading {model} (KV cache {cache_dtype}) ...")
            llm = engine_for(model, cache_dtype)
        elem_bytes = llm.engine.runner.kv_cache.element_size
        # Per batch size: its best round's step time, and the read bandwidth measured at that round's start, which
        # its floor is computed from (the machine's bandwidth drifts over minutes as its clock does).
        best = {b: (float("inf"), 0.0) for b in DECODE_BATCHES}
        for r in range(rounds):
            read_gbps = read_bandwidth(machine_rounds)
            for b in DECODE_BATCHES:
                log(f"decode, KV cache {cache_dtype}, round {r + 1}/{rounds} (read {read_gbps:.1f} GB/s): batch {b}, "
                    f"context {DECODE_CONTEXT} ...")
                best[b] = min(best[b], (ours_decode(llm, b, DECODE_CONTEXT, steps, tag=f"{cache_dtype}-{r}-"),
                                        read_gbps))
        results["decode"][cache_dtype] = {
            b: {"ours_ms": seconds * 1e3, "read_gbps": read_gbps,
                "floor_ms": decode_bytes(cfg, weight_bytes, b, DECODE_CONTEXT, elem_bytes) / read_gbps / 1e6}
            for b, (seconds, read_gbps) in best.items()
        }
    return results


def report(results: dict, log=print) -> None:
    log("\n== prefill ==")
    log(f"{'tokens':>7} {'ours tok/s':>11} {'hf tok/s':>9} {'ours/hf':>8} {'GFLOP/s':>8} {'peak':>6} {'of peak':>8}")
    for n, r in results["prefill"].items():
        log(f"{n:>7} {r['ours_tok_s']:>11.0f} {r['hf_tok_s']:>9.0f} {r['ours_tok_s'] / r['hf_tok_s']:>7.2f}x "
            f"{r['gflops']:>8.1f} {r['peak_gflops']:>6.0f} {r['share_of_peak']:>7.0%}")
    log("(peak: the fp32 matmul peak measured right before and after that prefill, the higher)")
    hf_ms = results["hf_decode_ms"]
    for cache_dtype, rows in results["decode"].items():
        log(f"\n== decode (context {DECODE_CONTEXT}, our KV cache {cache_dtype}, best of {results['rounds']} "
            "interleaved rounds) ==")
        log(f"{'batch':>6} {'ours ms':>8} {'hf ms':>7} {'hf/ours':>8} {'read GB/s':>10} {'floor ms':>9} "
            f"{'ours/floor':>11} {'tok/s':>7}")
        for b, r in rows.items():
            log(f"{b:>6} {r['ours_ms']:>8.2f} {hf_ms[b]:>7.2f} {hf_ms[b] / r['ours_ms']:>7.2f}x "
                f"{r['read_gbps']:>10.1f} {r['floor_ms']:>9.2f} {r['ours_ms'] / r['floor_ms']:>10.2f}x "
                f"{b * 1e3 / r['ours_ms']:>7.0f}")
    log("(floor: weights + K/V bytes / the read bandwidth measured at the start of that batch's best round)")
    worst = min(r["share_of_peak"] for r in results["prefill"].values())
    for cache_dtype, rows in results["decode"].items():
        b1, big = rows[1], max(rows)
        log(f"\n== targets (KV cache {cache_dtype}) ==")
        log(f"batch-1 decode vs bandwidth floor: {b1['ours_ms'] / b1['floor_ms']:.2f}x (target <= 1.5x)")
        log(f"batch-1 decode vs transformers eager: {hf_ms[1] / b1['ours_ms']:.2f}x faster (target >= 2x)")
        scale = (big / rows[big]["ours_ms"]) / (1 / b1["ours_ms"])
        log(f"batch-{big} decode throughput vs batch 1: {scale:.1f}x (target >= 6x)")
        log(f"prefill share of fp32 matmul peak: {worst:.0%} at worst (target >= 75%)")


def plot(results: dict, path: str) -> None:
    """Decode throughput against the batch size (ours per cache dtype, transformers) and prefill tokens/s."""
    plt = headless_pyplot()
    fig, (decode_ax, prefill_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for cache_dtype, rows in results["decode"].items():
        batches = [int(b) for b in rows]
        decode_ax.plot(batches, [b * 1e3 / r["ours_ms"] for b, r in zip(batches, rows.values())], "o-",
                       label=f"splitserve, {cache_dtype} KV")
    batches = [int(b) for b in results["hf_decode_ms"]]
    decode_ax.plot(batches, [b * 1e3 / ms for b, ms in zip(batches, results["hf_decode_ms"].values())], "s--",
                   label="transformers eager")
    decode_ax.set(xlabel="batch (sequences)", ylabel="decode tokens/s", xscale="log", xticks=batches,
                  xticklabels=[str(b) for b in batches], title=f"decode, context {DECODE_CONTEXT}")
    decode_ax.legend()
    lens = [str(n) for n in results["prefill"]]
    ours = [r["ours_tok_s"] for r in results["prefill"].values()]
    theirs = [r["hf_tok_s"] for r in results["prefill"].values()]
    xs = range(len(lens))
    prefill_ax.bar([x - 0.2 for x in xs], ours, 0.4, label="splitserve")
    prefill_ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="transformers eager")
    for x, r in zip(xs, results["prefill"].values()):
        prefill_ax.annotate(f"{r['share_of_peak']:.0%} of peak", (x - 0.2, r["ours_tok_s"]), ha="center",
                            va="bottom", fontsize=8)
    prefill_ax.set(xticks=list(xs), xticklabels=lens, xlabel="prompt tokens", ylabel="prefill tokens/s",
                   title="prefill")
    prefill_ax.legend()
    fig.suptitle(f"{results['model']}: engine vs transformers, same weights, same run")
    save_figure(fig, path)


@dataclass
class EngineBenchConfig(FiguresOutput):
    """Engine benchmark: splitserve's engine against `transformers` eager on the same weights, in one run."""

    model: str = field(default=DEFAULT_MODEL, metadata=described("Model to load (tiny-random for a quick run)."))
    steps: int = field(default=24, metadata=described("Decode steps timed per batch size."))
    repeat: int = field(default=3, metadata=described("Prefill repetitions (best is kept)."))
    cache_dtypes: list[str] = field(default_factory=lambda: ["float16", "float32"], metadata=described(
        "Our engine's KV cache dtypes for the decode figures; the first also runs the prefill (transformers keeps "
        "float32)."))
    rounds: int = field(default=3, metadata=described("Interleaved decode rounds (best is kept)."))
    machine_rounds: int = field(default=3, metadata=described(
        "Rounds of each matmul peak and read bandwidth measurement (best kept)."))
    quantizations: list[str] = field(default_factory=list, metadata=described(
        "Weight formats to compare side by side instead of the comparison with transformers, e.g. "
        "none,gguf,int8,int4: decode against each format's floor, prefill, weight bytes, perplexity."))
    threads: list[int] = field(default_factory=lambda: [1, 2], metadata=described(
        "Thread counts the weight formats are compared at (with --quantizations)."))
    perplexity_windows: int = field(default=4, metadata=described(
        "Windows of 512 tokens of GPL-3's text the perplexity of each format is measured on."))

    def __post_init__(self) -> None:
        if min(self.steps, self.repeat, self.rounds, self.machine_rounds, self.perplexity_windows, *self.threads) < 1:
            raise ValueError("steps, repeat, rounds, machine_rounds, perplexity_windows and threads must be >= 1")
        if not set(self.quantizations) <= set(QUANTIZATIONS):
            raise ValueError(f"quantizations must be among {', '.join(QUANTIZATIONS)}, got {self.quantizations}")
        if not self.cache_dtypes or not set(self.cache_dtypes) <= set(CACHE_DTYPES):
            raise ValueError(f"cache_dtypes must be among {', '.join(CACHE_DTYPES)}, got {self.cache_dtypes}")


def main(argv: list[str] | None = None) -> None:
    config = parse_config(EngineBenchConfig, argv, prog="splitserve bench engine")
    torch.manual_seed(0)
    if config.quantizations:
        results = run_quantizations(config.model, tuple(config.quantizations), tuple(config.threads), config.steps,
                                    config.repeat, config.rounds, config.perplexity_windows, config.machine_rounds)
        report_quantizations(results)
        save_results(results, config.json)
        return
    results = run(config.model, config.steps, config.repeat, tuple(config.cache_dtypes), config.rounds,
                  config.machine_rounds)
    report(results)
    save_results(results, config.json, config.plot, plot)
