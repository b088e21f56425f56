"""KV codec benchmark: what each codec of ``available_codecs()`` costs in size, speed and model quality, measured on
a real model's KV cache (SmolLM2-135M-Instruct by default) against the lossless path in the same run.

Per codec:
  - size: encoded bytes (payload + scales) of every KV tensor the benchmark round-trips below (each prompt's and
    each perplexity context's, every layer, K and V), as a ratio to bf16 (2 bytes per element): "2.0x smaller";
  - speed: encode and decode MB/s (MB of cache-dtype input per second), best of ``--repeat`` runs on one layer's
    K and V of a ``SPEED_CHUNK_TOKENS``-token prompt of the reference text, every codec back to back (the same load on the machine);
  - error: the largest |decoded - original| over all the round-tripped KV;
  - greedy agreement: ``--prompts`` prompts of ``PROMPT_LENS`` tokens (module docs and function sources of Python's
    standard library, English and code) prefill losslessly and sample their first token, as on a prefill pod;
    their prompt KV then makes the codec round trip in place in the paged cache, which is what a decode pod
    receives; then greedy decoding runs to ``--tokens`` tokens, the generated tokens' KV computed locally and
    uncompressed, as on a decode pod. Reported: the share of positions equal to a run without any round trip,
    and how many continuations are equal in full;
  - perplexity: windows of GPL-3's text (Debian ships it), ``CONTEXT_TOKENS`` + ``SCORED_TOKENS`` tokens each: the
    context prefills, its KV makes the round trip, then the continuation runs as one prefill chunk over the lossy
    context with every row's logits kept; perplexity = exp(mean NLL), as a % change against codec ``none``.
Then the ``TARGETS``: how much smaller than bf16 at least, within how much of a perplexity change, per codec.
The README holds measured figures.
"""

from __future__ import annotations

import importlib
import inspect
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import FiguresOutput, headless_pyplot, save_figure, save_results
from engine import LLM, LLMEngine, SamplingParams
from engine.attention import AttentionMetadata
from engine.config import DEFAULT_MODEL, CacheConfig
from engine.kv_cache import KV_KINDS
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from kvtransfer.codecs import EncodedKV, KVCodec, available_codecs, get_codec
from runtime.config import described, parse_config
from runtime.kv_codecs import check_kv_codecs

REFERENCE_TEXT = Path("/usr/share/common-licenses/GPL-3")
CONTEXT_TOKENS = 512
SCORED_TOKENS = 256
SPEED_CHUNK_TOKENS = 1024
BLOCK_SIZE = CacheConfig.block_size
PROMPT_LENS = (100, 300)  # shortest and longest agreement prompt, in tokens
BF16_BYTES = 2
# (size ratio to bf16 at least, perplexity change in % at most)
TARGETS = {"int8": (1.9, 0.5), "int4": (3.5, 3.0)}

# Agreement prompts: prose (module docs) and code (function sources) of the standard library, which comes with the
# interpreter: the same text on every machine with the same Python, unlike anything downloaded.
PROSE_SOURCES = ("argparse", "json", "re", "statistics", "configparser", "socketserver", "hashlib", "wave", "uuid",
                 "urllib.request")  # modules: their docstrings
CODE_SOURCES = (("heapq", "merge"), ("textwrap", "TextWrapper._wrap_chunks"),
                ("difflib", "SequenceMatcher.find_longest_match"), ("json.encoder", "_make_iterencode"),
                ("collections", "namedtuple"), ("argparse", "ArgumentParser._parse_known_args"),
                ("shlex", "shlex.read_token"), ("csv", "Sniffer._guess_quote_and_delimiter"),
                ("configparser", "RawConfigParser._read"), ("fnmatch", "translate"))  # (module, qualname): sources


# ---- texts -------------------------------------------------------------------------------------------------------

def reference_tokens(tokenizer: Tokenizer) -> list[int]:
    """GPL-3's text, tokenized: the fixed English text of the perplexity windows and the speed chunk (and of the
    transfer benchmark's prompts)."""
    if not REFERENCE_TEXT.is_file():
        raise SystemExit(f"{REFERENCE_TEXT} is missing: the benchmark's reference text (Debian's base-files "
                         "package ships it)")
    return tokenizer.encode(REFERENCE_TEXT.read_text())


def agreement_prompts(llm: LLM, count: int) -> list[list[int]]:
    """``count`` prompts, prose and code in turn, their lengths spread evenly over PROMPT_LENS."""
    texts = [text for pair in zip(map(_module_doc, PROSE_SOURCES), (_source(*c) for c in CODE_SOURCES))
             for text in pair]
    if not 1 <= count <= len(texts):
        raise SystemExit(f"--prompts must be in 1..{len(texts)}, got {count}")
    shortest, longest = PROMPT_LENS
    prompts = []
    for i, text in enumerate(texts[:count]):
        length = shortest + (longest - shortest) * i // max(1, count - 1)
        tokens = llm.tokenizer.encode(text)
        if len(tokens) < length:
            raise SystemExit(f"prompt {i} needs {length} tokens, its text has {len(tokens)}: {text[:60]!r}")
        prompts.append(tokens[:length])
    return prompts


def _module_doc(module: str) -> str:
    return importlib.import_module(module).__doc__ or ""  # None under python -OO: then the length check fails


def _source(module: str, qualname: str) -> str:
    obj = importlib.import_module(module)
    for attribute in qualname.split("."):
        obj = getattr(obj, attribute)
    return inspect.getsource(obj)


# ---- the codec round trip, in place in the paged cache -----------------------------------------------------------

@dataclass
class KVTally:
    """What a codec did to the KV it round-tripped."""

    elements: int = 0
    encoded_bytes: int = 0  # payload + scales
    max_abs_error: float = 0.0

    def add(self, original: torch.Tensor, decoded: torch.Tensor, encoded: EncodedKV) -> None:
        self.elements += original.numel()
        self.encoded_bytes += encoded.nbytes
        self.max_abs_error = max(self.max_abs_error, (decoded.float() - original.float()).abs().max().item())

    @property
    def ratio_to_bf16(self) -> float:
        return BF16_BYTES * self.elements / self.encoded_bytes


def round_trip(engine: LLMEngine, seq: Sequence, num_tokens: int, codec: KVCodec, tally: KVTally) -> None:
    """Replace the KV of ``seq``'s first ``num_tokens`` tokens, every layer, K and V, by its codec round trip."""
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, num_tokens)
    for layer in range(cache.num_layers):
        for kind in KV_KINDS:
            original = cache.read(layer, kind, slots)  # [num_tokens, H, D]
            encoded = codec.encode(original, kind)
            decoded = codec.decode(encoded, original.device)
            tally.add(original, decoded, encoded)
            cache.write(layer, kind, slots, decoded)


# ---- greedy agreement --------------------------------------------------------------------------------------------

def greedy_outputs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, codec: KVCodec | None,
                   tally: KVTally) -> list[list[int]]:
    """Greedy continuations of ``prompts``, batched; with a codec, each prompt's KV makes the round trip right
    after its prefill step (first token sampled from lossless logits, as on a prefill pod)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(f"agree-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    awaiting = list(seqs)  # prefill not yet done
    while engine.has_unfinished_requests():
        engine.step()
        prefilled = [seq for seq in awaiting if seq.num_computed_tokens >= seq.num_prompt_tokens]
        for seq in prefilled:
            awaiting.remove(seq)
            if codec is not None and not seq.is_finished:  # finished: max_tokens 1, its blocks are free
                round_trip(engine, seq, seq.num_prompt_tokens, codec, tally)
    if any(seq.num_preemptions for seq in seqs):  # a re-prefill would have recomputed the KV losslessly
        raise RuntimeError("a sequence was preempted: the KV cache is too small for the agreement batch")
    return [seq.output_token_ids for seq in seqs]


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[float, int]:
    """(share of positions equal to the reference, number of continuations equal in full)."""
    positions = sum(len(ref) for ref in reference)
    equal = sum(a == b for ref, out in zip(reference, outputs) for a, b in zip(ref, out))
    return equal / positions, sum(ref == out for ref, out in zip(reference, outputs))


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


def window_nll(engine: LLMEngine, window: list[int], codec: KVCodec, tally: KVTally) -> float:
    """Summed NLL of the window's SCORED_TOKENS targets, each predicted by a row attending to the lossy context."""
    # Blocks for the whole window, reserved as a decode pod reserves them for a pushed prompt.
    seq = engine.reserve_for_transfer("perplexity", window[:-1], SamplingParams())
    if seq is None:
        raise RuntimeError("the KV cache has no room for a perplexity window")
    try:
        forward(engine, seq, 0, CONTEXT_TOKENS)
        round_trip(engine, seq, CONTEXT_TOKENS, codec, tally)
        hidden = forward(engine, seq, CONTEXT_TOKENS, len(window) - 1)  # [SCORED_TOKENS, H]
        with torch.inference_mode():
            logits = engine.runner.model.compute_logits(hidden)  # [SCORED_TOKENS, vocab] float32
            targets = torch.tensor(window[CONTEXT_TOKENS + 1:], device=logits.device)
            return F.cross_entropy(logits, targets, reduction="sum").item()
    finally:
        engine.release_transfer(seq)


def perplexity(engine: LLMEngine, windows: list[list[int]], codec: KVCodec, tally: KVTally) -> float:
    nll = sum(window_nll(engine, window, codec, tally) for window in windows)
    return math.exp(nll / (len(windows) * SCORED_TOKENS))


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
    agreement: float  # share of the prompts x tokens positions equal to the lossless run
    identical: int  # continuations equal in full
    perplexity: float
    ppl_change_pct: float = 0.0  # against codec none
    encode_mb_s: float = 0.0
    decode_mb_s: float = 0.0


def run(model: str, codecs: list[str], num_prompts: int, max_tokens: int, num_windows: int, repeat: int,
        log=print) -> dict:
    """Every figure of every codec in ``codecs`` (``none`` among them: the perplexity baseline)."""
    log(f"loading {model} ...")
    # All prompts prefill in one step, and the cache holds them with their outputs: no chunking, no preemption.
    # The KV is float32, so that every codec's error is measured against the model's exact K/V.
    llm = LLM(model=model, enable_prefix_caching=False, max_num_seqs=num_prompts, block_size=BLOCK_SIZE,
              cache_dtype="float32",
              num_blocks=_cache_blocks(num_prompts, max_tokens), long_prefill_token_threshold=PROMPT_LENS[1],
              max_num_batched_tokens=max(2048, num_prompts * PROMPT_LENS[1]))
    engine = llm.engine
    text = reference_tokens(llm.tokenizer)
    prompts, windows = agreement_prompts(llm, num_prompts), perplexity_windows(text, num_windows)
    chunk = speed_chunk(engine, text)
    # Back to back, so that every codec's speed is taken under the same load on the machine.
    speeds = {name: codec_speed(get_codec(name), chunk, repeat) for name in codecs}
    log(f"measured encode/decode speeds on one layer's K and V of {SPEED_CHUNK_TOKENS} tokens, best of {repeat} runs")
    log(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {max_tokens} greedy "
        f"tokens each; {len(windows)} perplexity windows of {CONTEXT_TOKENS}+{SCORED_TOKENS} tokens")
    start = time.perf_counter()
    reference = greedy_outputs(engine, prompts, max_tokens, None, KVTally())
    log(f"lossless reference run: {time.perf_counter() - start:.1f} s")
    figures: dict[str, CodecFigures] = {}
    for i, name in enumerate(codecs, start=1):
        start = time.perf_counter()
        figures[name] = measure_codec(engine, get_codec(name), prompts, max_tokens, reference, windows)
        f = figures[name]
        f.encode_mb_s, f.decode_mb_s = speeds[name]
        log(f"[{i}/{len(codecs)}] {name}: {f.ratio_to_bf16:.2f}x smaller than bf16, agreement {f.agreement:.1%}, "
            f"perplexity {f.perplexity:.3f} ({time.perf_counter() - start:.1f} s)")
    for f in figures.values():
        f.ppl_change_pct = 100.0 * (f.perplexity / figures["none"].perplexity - 1.0)
    return {"model": model, "prompts": len(prompts), "tokens": max_tokens, "windows": len(windows),
            "context_tokens": CONTEXT_TOKENS, "scored_tokens": SCORED_TOKENS,
            "codecs": {name: asdict(f) for name, f in figures.items()}, "targets": targets(figures)}


def _cache_blocks(num_prompts: int, max_tokens: int) -> int:
    """Blocks for the agreement batch at its longest, or for the speed chunk (the largest single sequence)."""
    per_prompt = -(-(PROMPT_LENS[1] + max_tokens) // BLOCK_SIZE)
    return max(num_prompts * per_prompt, -(-SPEED_CHUNK_TOKENS // BLOCK_SIZE))


def measure_codec(engine: LLMEngine, codec: KVCodec, prompts: list[list[int]], max_tokens: int,
                  reference: list[list[int]], windows: list[list[int]]) -> CodecFigures:
    """Size, error, agreement and perplexity of one codec (its speed is measured apart)."""
    tally = KVTally()
    outputs = greedy_outputs(engine, prompts, max_tokens, codec, tally)
    agree, identical = agreement(reference, outputs)
    ppl = perplexity(engine, windows, codec, tally)
    return CodecFigures(tally.ratio_to_bf16, tally.max_abs_error, agree, identical, ppl)


def targets(figures: dict[str, CodecFigures]) -> list[dict]:
    checks = []
    for name, (min_ratio, max_ppl_pct) in TARGETS.items():
        if name in figures:
            f = figures[name]
            checks.append({"codec": name, "ratio_to_bf16": f.ratio_to_bf16, "min_ratio": min_ratio,
                           "ppl_change_pct": f.ppl_change_pct, "max_ppl_change_pct": max_ppl_pct,
                           "passed": f.ratio_to_bf16 >= min_ratio and f.ppl_change_pct <= max_ppl_pct})
    return checks


def report(results: dict, log=print) -> None:
    log(f"\n== KV codecs on {results['model']}: {results['prompts']} prompts x {results['tokens']} greedy tokens, "
        f"perplexity over {results['windows']} windows of {results['context_tokens']}+{results['scored_tokens']} "
        "tokens ==")
    log(f"{'codec':<11} {'vs bf16':>8} {'enc MB/s':>9} {'dec MB/s':>9} {'max |err|':>10} {'agree':>7} "
        f"{'same':>6} {'ppl':>8} {'ppl chg':>8}")
    for name, f in results["codecs"].items():
        log(f"{name:<11} {f['ratio_to_bf16']:>7.2f}x {f['encode_mb_s']:>9.0f} {f['decode_mb_s']:>9.0f} "
            f"{f['max_abs_error']:>10.2e} {f['agreement']:>7.1%} {f['identical']:>3}/{results['prompts']:<2} "
            f"{f['perplexity']:>8.3f} {f['ppl_change_pct']:>+7.2f}%")
    log("\n== targets ==")
    for t in results["targets"]:
        log(f"{t['codec']}: {t['ratio_to_bf16']:.2f}x smaller than bf16 (target >= {t['min_ratio']}x), perplexity "
            f"{t['ppl_change_pct']:+.2f}% (target <= +{t['max_ppl_change_pct']}%): {'PASS' if t['passed'] else 'FAIL'}")


def plot(results: dict, path: str) -> None:
    plt = headless_pyplot()

    names = list(results["codecs"])
    panels = [("ratio_to_bf16", "size: x smaller than bf16", 1.0), ("ppl_change_pct", "perplexity change (%)", 1.0),
              ("agreement", "greedy-token agreement (%)", 100.0)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 9), sharex=True)
    for ax, (key, title, scale) in zip(axes, panels):
        ax.bar(names, [results["codecs"][n][key] * scale for n in names], color="tab:blue")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].tick_params(axis="x", rotation=30)
    fig.suptitle(f"KV codecs on {results['model']}")
    save_figure(fig, path)


@dataclass
class CodecsBenchConfig(FiguresOutput):
    """KV codec benchmark: each codec's size, speed and model quality against the lossless path, in one run."""

    model: str = field(default=DEFAULT_MODEL, metadata=described("Model to load (tiny-random for a quick run)."))
    codecs: list[str] = field(default_factory=available_codecs, metadata=described(
        "Codecs to measure (none is always measured: it is the baseline)."))
    prompts: int = field(default=20, metadata=described("Greedy-agreement prompts."))
    tokens: int = field(default=128, metadata=described("Greedy tokens per prompt."))
    windows: int = field(default=6, metadata=described("Perplexity windows."))
    repeat: int = field(default=10, metadata=described("Encode/decode timing runs (best is kept)."))

    def __post_init__(self) -> None:
        check_kv_codecs("codecs", self.codecs)
        if min(self.prompts, self.tokens, self.windows, self.repeat) < 1:
            raise ValueError("prompts, tokens, windows and repeat must be >= 1")


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(CodecsBenchConfig, argv, prog="splitserve bench codecs")
    codecs = ["none", *(name for name in config.codecs if name != "none")]
    results = run(config.model, codecs, config.prompts, config.tokens, config.windows, config.repeat)
    report(results)
    save_results(results, config.json, config.plot, plot)
    return results
