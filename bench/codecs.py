"""KV codec benchmark: what each codec of ``available_codecs()`` costs in size, speed and model quality, measured on
a real model's KV cache (SmolLM2-135M-Instruct by default) against the lossless path in the same run, once per
cache dtype of ``--cache-dtypes``: float16 (the pods' default, what is served) and float32 (the model's exact K/V).

Per codec:
  - size: encoded bytes (payload + scales) of every KV tensor the benchmark round-trips below (each prompt's and
    each perplexity context's, every layer, K and V), as a ratio to bf16 (2 bytes per element): "2.0x smaller";
  - speed: encode and decode MB/s (MB of cache-dtype input per second), best of ``--repeat`` runs on one layer's
    K and V of a ``SPEED_CHUNK_TOKENS``-token prompt of the reference text, every codec back to back (the same
    load on the machine);
  - error: the largest |decoded - original| over all the round-tripped KV;
  - greedy agreement: ``--prompts`` prompts (``agreement_prompts``: 20 short ones of ``PROMPT_LENS`` tokens, module
    docs and function sources of Python's standard library, then 20 long ones at the lengths of the Azure
    conversation and code workloads, license texts and module sources) prefill losslessly and sample their first
    token, as on a prefill pod; their prompt KV then makes the codec round trip in place in the paged cache, which
    is what a decode pod receives; then greedy decoding runs to ``--tokens`` tokens, the generated tokens' KV
    computed locally and uncompressed, as on a decode pod. Reported against a run without any round trip: the
    share of tokens generated before each continuation's first divergence (``agreement``: a token after a
    divergence counts as lost even where it happens to match), and the share of continuations equal in full;
  - teacher-forced quality: windows of GPL-3's text (Debian ships it), ``CONTEXT_TOKENS`` + ``SCORED_TOKENS`` tokens
    each (a context long enough for the KV to matter): the context prefills, its KV makes the round trip, then the
    continuation runs as one prefill chunk over the lossy context with every row's logits kept. At every scored
    position, not only until a first divergence: perplexity = exp(mean NLL), as a % change against codec ``none``;
    top-1 agreement, the share of positions whose most likely next token is the lossless path's; and the mean KL
    divergence KL(lossless || codec) of the next-token distributions, in nats.
``X@kc`` (keys scaled per channel) and ``X@prerope`` (keys quantized before RoPE) name variants of codec X that no pod
serves (codec_variants.py): measured like the rest, left out of the quality table.
An ``X+zstd`` codec decodes to exactly X's tensor (zstd is lossless), so its quality figures are X's, taken in the
same round trip; only its size is its own, measured on the very KV X encoded.
Then the ``TARGETS`` per cache dtype: size, perplexity and agreement bounds per codec. ``--quality-table PATH``
writes the agreement of every codec per cache dtype, the file the prefill pods read (kvtransfer/quality/).
The texts and the round trip with its greedy agreement are the measurement library's (``splitserve.measure``:
``codec_texts.py``, ``codec_agreement.py``), shared with ``--through-up`` (codecs_served.py) and
scripts/codec_diagnosis.py; perplexity and speed are measured here. docs/PERFORMANCE.md holds measured figures.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from splitserve.bench import codec_variants, codecs_served
from splitserve.engine import LLMEngine, SamplingParams
from splitserve.engine.config import CACHE_DTYPES as ENGINE_CACHE_DTYPES
from splitserve.engine.config import DEFAULT_MODEL
from splitserve.engine.kv_cache import KV_KINDS
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.sequence import Sequence
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.kvtransfer.codecs import KVCodec, available_codecs
from splitserve.measure.codec_agreement import (
    AGREEMENT_GROUP,
    KVTally,
    PromptKV,
    agreement,
    greedy_outputs,
    load_model,
    read_prompt_kv,
    reference_run,
    write_round_trip,
)
from splitserve.measure.codec_texts import REFERENCE_TEXT, agreement_prompts, reference_tokens
from splitserve.measure.figures import FiguresOutput, headless_pyplot, save_figure, save_results
from splitserve.runtime.config import described, parse_config
from splitserve.runtime.kv_codecs import ZSTD_SUFFIX, check_kv_codecs

CONTEXT_TOKENS = 1024
SCORED_TOKENS = 256
SPEED_CHUNK_TOKENS = 1024
CACHE_DTYPES = ("float16", "float32")  # the pods' default first: what is served
# (size ratio to bf16 at least, perplexity change in % at most, agreement at least): the targets
TARGETS = {"int8": (1.9, 0.5, 0.97), "kivi8": (1.9, 0.5, 0.97), "int4": (3.5, 0.5, 0.85),
           "kivi4": (3.5, 0.5, 0.85), "kivi2": (6.0, 2.0, 0.0)}


# ---- perplexity over a lossy context -----------------------------------------------------------------------------

def perplexity_windows(tokens: list[int], count: int) -> list[list[int]]:
    """``count`` disjoint windows: context, then the scored tokens' inputs, then the last target."""
    size = CONTEXT_TOKENS + SCORED_TOKENS + 1
    if count * size > len(tokens):
        raise SystemExit(f"{REFERENCE_TEXT} gives {len(tokens) // size} windows of {size} tokens, not {count}")
    return [tokens[i * size:(i + 1) * size] for i in range(count)]


@torch.inference_mode()
def forward(engine: LLMEngine, seq: Sequence, start: int, end: int) -> torch.Tensor:
    """Run tokens [start, end) of ``seq`` as one chunk over its cached [0, start); final hidden [end - start, H]."""
    runner = engine.runner
    meta = AttentionMetadata.build([end - start], [end], [seq.block_table], engine.config.cache.block_size,
                                   runner.device)
    input_ids = torch.tensor(seq.prompt_token_ids[start:end], device=runner.device)
    positions = torch.arange(start, end, device=runner.device)
    return runner.model(input_ids, positions, runner.kv_cache, meta)


def prefill_contexts(engine: LLMEngine, windows: list[list[int]]) -> list[PromptKV]:
    """Each window's context KV, computed once (every codec's perplexity starts from it)."""
    contexts = []
    for window in windows:
        seq = _reserve(engine, window[:CONTEXT_TOKENS])
        try:
            forward(engine, seq, 0, CONTEXT_TOKENS)
            contexts.append(PromptKV(window, read_prompt_kv(engine, seq, CONTEXT_TOKENS)))
        finally:
            engine.release_transfer(seq)
    return contexts


def window_logprobs(engine: LLMEngine, context: PromptKV, codec: KVCodec, tally: KVTally,
                    sized: dict[str, tuple[KVCodec, KVTally]]) -> torch.Tensor:
    """[SCORED_TOKENS, vocab] float32 log-probabilities of each scored row's next token, the row attending to the
    lossy context."""
    window = context.tokens
    seq = _reserve(engine, window[:-1])  # blocks for the whole window, as a decode pod reserves a pushed prompt's
    try:
        write_round_trip(engine, seq, context.kv, codec, tally, sized)
        hidden = forward(engine, seq, CONTEXT_TOKENS, len(window) - 1)  # [SCORED_TOKENS, H]
        with torch.inference_mode():
            return F.log_softmax(engine.runner.model.compute_logits(hidden).float(), dim=-1)
    finally:
        engine.release_transfer(seq)


def _reserve(engine: LLMEngine, tokens: list[int]) -> Sequence:
    seq = engine.reserve_for_transfer("perplexity", tokens, SamplingParams())
    if seq is None:
        raise RuntimeError("the KV cache has no room for a perplexity window")
    return seq


@dataclass
class TeacherForced:
    """A codec's teacher-forced figures over every scored position of every window."""

    perplexity: float
    top1_agreement: float  # share of positions whose argmax is the lossless path's
    mean_kl: float  # nats per position, KL(lossless || codec)


def teacher_forced(engine: LLMEngine, contexts: list[PromptKV], codec: KVCodec, tally: KVTally,
                   sized: dict[str, tuple[KVCodec, KVTally]], lossless: list[torch.Tensor]) -> TeacherForced:
    """``lossless``: each window's log-probabilities through codec none (``window_logprobs``), the reference."""
    nll = kl = same = 0.0
    for context, reference in zip(contexts, lossless):
        logprobs = window_logprobs(engine, context, codec, tally, sized)
        targets = torch.tensor(context.tokens[CONTEXT_TOKENS + 1:], device=logprobs.device)
        nll += F.nll_loss(logprobs, targets, reduction="sum").item()
        same += (logprobs.argmax(-1) == reference.argmax(-1)).sum().item()
        kl += F.kl_div(logprobs, reference, log_target=True, reduction="sum").item()
    rows = len(contexts) * SCORED_TOKENS
    return TeacherForced(math.exp(nll / rows), same / rows, kl / rows)


# ---- speed -------------------------------------------------------------------------------------------------------

def speed_chunk(engine: LLMEngine, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The middle layer's K and V ([SPEED_CHUNK_TOKENS, H, D] each) of the text's first SPEED_CHUNK_TOKENS."""
    seq = engine.reserve_for_transfer("speed", tokens[:SPEED_CHUNK_TOKENS], SamplingParams())
    try:
        forward(engine, seq, 0, SPEED_CHUNK_TOKENS)
        cache, layer = engine.runner.kv_cache, engine.model_config.num_layers // 2
        slots = cache.slots(seq.block_table, 0, SPEED_CHUNK_TOKENS)
        return {kind: cache.read(layer, kind, slots) for kind in KV_KINDS}
    finally:
        engine.release_transfer(seq)


def codec_speed(codec: KVCodec, chunk: dict[str, torch.Tensor], repeat: int) -> tuple[float, float]:
    """(encode MB/s, decode MB/s) of K and V together, best of ``repeat`` runs each."""
    input_bytes = sum(t.numel() * t.element_size() for t in chunk.values())
    encoded = {kind: codec.encode(t, kind) for kind, t in chunk.items()}  # also warms the codec up
    encode_s = _best_time(lambda: [codec.encode(t, kind) for kind, t in chunk.items()], repeat)
    decode_s = _best_time(lambda: [codec.decode(e) for e in encoded.values()], repeat)
    return input_bytes / encode_s / 1e6, input_bytes / decode_s / 1e6


def _best_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# ---- the run -----------------------------------------------------------------------------------------------------

@dataclass
class CodecFigures:
    ratio_to_bf16: float
    max_abs_error: float
    agreement: float  # share of the reference's tokens generated before each continuation's first divergence
    identical: int  # continuations equal in full
    perplexity: float
    ppl_change_pct: float = 0.0  # against codec none
    encode_mb_s: float = 0.0
    decode_mb_s: float = 0.0
    top1_agreement: float = 1.0  # teacher-forced, every scored position
    mean_kl: float = 0.0  # nats per scored position, against the lossless path


def run(model: str, codecs: list[str], cache_dtype: str, num_prompts: int, max_tokens: int, num_windows: int,
        repeat: int, log=print) -> dict:
    """Every figure of every codec in ``codecs`` (``none`` among them: the perplexity baseline) on a cache of
    ``cache_dtype``. The prompts go in groups of ``AGREEMENT_GROUP`` (each group's lossless KV held while every
    codec runs on it), so that the memory held is a group's, not all prompts' (a float32 run of 40 long prompts at
    once was killed for memory on a shared machine)."""
    log(f"loading {model} with a {cache_dtype} KV cache ...")
    tokenizer = load_tokenizer(model)
    text = reference_tokens(tokenizer)
    prompts, windows = agreement_prompts(tokenizer, num_prompts), perplexity_windows(text, num_windows)
    groups = [prompts[i:i + AGREEMENT_GROUP] for i in range(0, len(prompts), AGREEMENT_GROUP)]
    engine = load_model(model, cache_dtype, groups, max_tokens,
                        longest_other=max(SPEED_CHUNK_TOKENS, CONTEXT_TOKENS + SCORED_TOKENS)).engine
    chunk = speed_chunk(engine, text)

    def codec_named(name: str) -> KVCodec:  # X@kc, X@prerope: variants of codec X (codec_variants.py)
        return codec_variants.named_codec(name, engine.model_config)

    # Back to back, so that every codec's speed is taken under the same load on the machine.
    speeds = {name: codec_speed(codec_named(name), chunk, repeat) for name in codecs}
    log(f"measured encode/decode speeds on one layer's K and V of {SPEED_CHUNK_TOKENS} tokens, best of {repeat} runs")
    log(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens in groups of "
        f"{AGREEMENT_GROUP}, {max_tokens} greedy tokens each; {len(windows)} teacher-forced windows of "
        f"{CONTEXT_TOKENS}+{SCORED_TOKENS} tokens")
    # Codecs measured themselves; X+zstd comes with X (the same decoded KV), its size tallied on the side.
    measured = [name for name in codecs
                if not (name.endswith(ZSTD_SUFFIX) and name.removesuffix(ZSTD_SUFFIX) in codecs)]
    zstd_of = {name: [other for other in codecs if other == name + ZSTD_SUFFIX] for name in measured}
    tallies = {name: KVTally() for name in codecs}
    reference: list[list[int]] = []
    outputs: dict[str, list[list[int]]] = {name: [] for name in measured}
    for number, group in enumerate(groups, start=1):
        start = time.perf_counter()
        group_reference, prefilled = reference_run(engine, group, max_tokens)
        reference += group_reference
        for name in measured:
            sized = {other: (codec_named(other), tallies[other]) for other in zstd_of[name]}
            outputs[name] += greedy_outputs(engine, prefilled, max_tokens, codec_named(name), tallies[name], sized)
        log(f"group {number}/{len(groups)}: every codec's greedy run ({time.perf_counter() - start:.1f} s)")
    contexts = prefill_contexts(engine, windows)
    lossless = [window_logprobs(engine, context, codec_named("none"), KVTally(), {}) for context in contexts]
    figures: dict[str, CodecFigures] = {}
    for name in measured:
        sized = {other: (codec_named(other), tallies[other]) for other in zstd_of[name]}
        forced = teacher_forced(engine, contexts, codec_named(name), tallies[name], sized, lossless)
        agree, identical = agreement(reference, outputs[name])
        for figured in (name, *sized):
            tally = tallies[figured]
            f = figures[figured] = CodecFigures(tally.ratio_to_bf16, tallies[name].max_abs_error, agree, identical,
                                                forced.perplexity, 0.0, *speeds[figured], forced.top1_agreement,
                                                forced.mean_kl)
            log(f"{figured}: {f.ratio_to_bf16:.2f}x smaller than bf16, agreement {f.agreement:.1%}, identical "
                f"{f.identical}/{len(prompts)}, perplexity {f.perplexity:.3f}, top-1 {f.top1_agreement:.2%}, "
                f"KL {f.mean_kl:.2e}")
    for f in figures.values():
        f.ppl_change_pct = 100.0 * (f.perplexity / figures["none"].perplexity - 1.0)
    return {"cache_dtype": cache_dtype, "codecs": {name: asdict(figures[name]) for name in codecs},
            "targets": targets(figures, len(prompts))}


def targets(figures: dict[str, CodecFigures], num_prompts: int) -> list[dict]:
    checks = []
    for name, (min_ratio, max_ppl_pct, min_agreement) in TARGETS.items():
        if name in figures:
            f = figures[name]
            checks.append({"codec": name, "ratio_to_bf16": f.ratio_to_bf16, "min_ratio": min_ratio,
                           "ppl_change_pct": f.ppl_change_pct, "max_ppl_change_pct": max_ppl_pct,
                           "agreement": f.agreement, "min_agreement": min_agreement,
                           "passed": (f.ratio_to_bf16 >= min_ratio and f.ppl_change_pct <= max_ppl_pct
                                      and f.agreement >= min_agreement)})
    return checks


def quality_table(results: dict) -> dict:
    """What the prefill pods read (kvtransfer/quality/): per cache dtype, per codec, agreement, size and speed."""
    return {"model": results["model"], "prompts": results["prompts"], "tokens": results["tokens"],
            "measured_by": "splitserve bench codecs",
            "cache_dtypes": {dtype: {name: {"agreement": round(f["agreement"], 4),
                                            "identical_share": round(f["identical"] / results["prompts"], 4),
                                            "ppl_change_pct": round(f["ppl_change_pct"], 3),
                                            "top1_agreement": round(f["top1_agreement"], 4),
                                            "mean_kl": f["mean_kl"],
                                            "ratio_to_bf16": round(f["ratio_to_bf16"], 3),
                                            "encode_mb_s": round(f["encode_mb_s"]),
                                            "decode_mb_s": round(f["decode_mb_s"])}
                                     for name, f in run["codecs"].items()
                                     if name == codec_variants.registered_name(name)}  # no pod serves variants
                             for dtype, run in results["cache_dtypes"].items()}}


def report(results: dict, log=print) -> None:
    for dtype, run_figures in results["cache_dtypes"].items():
        log(f"\n== KV codecs on {results['model']}, {dtype} cache: {results['prompts']} prompts x "
            f"{results['tokens']} greedy tokens, teacher-forced over {results['windows']} windows of "
            f"{results['context_tokens']}+{results['scored_tokens']} tokens ==")
        log(f"{'codec':<11} {'vs bf16':>8} {'enc MB/s':>9} {'dec MB/s':>9} {'max |err|':>10} {'agree':>7} "
            f"{'same':>6} {'ppl':>8} {'ppl chg':>8} {'top-1':>7} {'KL nats':>9}")
        for name, f in run_figures["codecs"].items():
            log(f"{name:<11} {f['ratio_to_bf16']:>7.2f}x {f['encode_mb_s']:>9.0f} {f['decode_mb_s']:>9.0f} "
                f"{f['max_abs_error']:>10.2e} {f['agreement']:>7.1%} {f['identical']:>3}/{results['prompts']:<2} "
                f"{f['perplexity']:>8.3f} {f['ppl_change_pct']:>+7.2f}% {f['top1_agreement']:>7.2%} "
                f"{f['mean_kl']:>9.2e}")
        log(f"\n== targets, {dtype} cache ==")
        for t in run_figures["targets"]:
            log(f"{t['codec']}: {t['ratio_to_bf16']:.2f}x smaller than bf16 (target >= {t['min_ratio']}x), "
                f"perplexity {t['ppl_change_pct']:+.2f}% (target <= +{t['max_ppl_change_pct']}%), agreement "
                f"{t['agreement']:.1%} (target >= {t['min_agreement']:.0%}): {'PASS' if t['passed'] else 'FAIL'}")


def plot(results: dict, path: str) -> None:
    plt = headless_pyplot()

    dtypes = list(results["cache_dtypes"])
    names = list(results["cache_dtypes"][dtypes[0]]["codecs"])
    panels = [("ratio_to_bf16", "size: x smaller than bf16", 1.0), ("ppl_change_pct", "perplexity change (%)", 1.0),
              ("agreement", "greedy tokens before the first divergence (%)", 100.0)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 9), sharex=True)
    width = 0.8 / len(dtypes)
    for ax, (key, title, scale) in zip(axes, panels):
        for i, dtype in enumerate(dtypes):
            figures = results["cache_dtypes"][dtype]["codecs"]
            ax.bar([n + i * width for n in range(len(names))], [figures[n][key] * scale for n in names], width,
                   label=f"{dtype} cache")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    axes[-1].set_xticks([n + 0.4 - width / 2 for n in range(len(names))], names, rotation=30)
    fig.suptitle(f"KV codecs on {results['model']}")
    save_figure(fig, path)


@dataclass
class CodecsBenchConfig(FiguresOutput):
    """KV codec benchmark: each codec's size, speed and model quality against the lossless path, in one run."""

    model: str = field(default=DEFAULT_MODEL, metadata=described("Model to load (tiny-random for a quick run)."))
    codecs: list[str] = field(default_factory=available_codecs, metadata=described(
        "Codecs to measure (none is always measured: it is the baseline); X@kc: fp8 or int8 with keys scaled per "
        "channel, X@prerope: X on keys un-rotated before quantizing (bench/codec_variants.py)."))
    cache_dtypes: list[str] = field(default_factory=lambda: list(CACHE_DTYPES), metadata=described(
        "KV cache dtypes to measure on, each a run of its own (float16: the pods' default)."))
    prompts: int = field(default=40, metadata=described("Greedy-agreement prompts (20 short, then 20 long)."))
    tokens: int = field(default=128, metadata=described("Greedy tokens per prompt."))
    windows: int = field(default=5, metadata=described(
        f"Teacher-forced windows ({CONTEXT_TOKENS}-token context, {SCORED_TOKENS} scored positions each)."))
    repeat: int = field(default=10, metadata=described("Encode/decode timing runs (best is kept)."))
    quality_table: str = field(default="", metadata=described(
        "Also write the quality table the prefill pods read (e.g. kvtransfer/quality/smollm2-135m.json)."))
    through_up: bool = field(default=False, metadata=described(
        "Instead: each codec's agreement over the real path, a splitserve up cluster per codec against the none "
        "one (bench/codecs_served.py), beside the shipped quality table's."))
    through_up_concurrency: int = field(default=4, metadata=described(
        "--through-up: requests in flight at once."))

    def __post_init__(self) -> None:
        check_kv_codecs("codecs", [codec_variants.registered_name(name) for name in self.codecs])
        if not self.cache_dtypes or not set(self.cache_dtypes) <= set(ENGINE_CACHE_DTYPES):
            raise ValueError(f"cache_dtypes must name some of {', '.join(ENGINE_CACHE_DTYPES)}, "
                             f"got {self.cache_dtypes!r}")
        if min(self.prompts, self.tokens, self.windows, self.repeat, self.through_up_concurrency) < 1:
            raise ValueError("prompts, tokens, windows, repeat and through_up_concurrency must be >= 1")


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(CodecsBenchConfig, argv, prog="splitserve bench codecs")
    codecs = ["none", *(name for name in config.codecs if name != "none")]
    if config.through_up:
        results = codecs_served.run(config.model, codecs, config.prompts, config.tokens,
                                    config.through_up_concurrency)
        save_results(results, config.json)
        return results
    runs = {dtype: run(config.model, codecs, dtype, config.prompts, config.tokens, config.windows, config.repeat)
            for dtype in config.cache_dtypes}
    results = {"model": config.model, "prompts": config.prompts, "tokens": config.tokens, "windows": config.windows,
               "context_tokens": CONTEXT_TOKENS, "scored_tokens": SCORED_TOKENS, "cache_dtypes": runs}
    report(results)
    save_results(results, config.json, config.plot, plot)
    if config.quality_table:
        Path(config.quality_table).write_text(json.dumps(quality_table(results), indent=2) + "\n")
    return results
