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
  - perplexity: windows of GPL-3's text (Debian ships it), ``CONTEXT_TOKENS`` + ``SCORED_TOKENS`` tokens each: the
    context prefills, its KV makes the round trip, then the continuation runs as one prefill chunk over the lossy
    context with every row's logits kept; perplexity = exp(mean NLL), as a % change against codec ``none``.
An ``X+zstd`` codec decodes to exactly X's tensor (zstd is lossless), so its quality figures are X's, taken in the
same round trip; only its size is its own, measured on the very KV X encoded.
Then the ``TARGETS`` per cache dtype: size, perplexity and agreement bounds per codec. ``--quality-table PATH``
writes the agreement of every codec per cache dtype, the file the prefill pods read (kvtransfer/quality/).
docs/PERFORMANCE.md holds measured figures.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from splitserve.bench import FiguresOutput, headless_pyplot, save_figure, save_results
from splitserve.bench.workload import AZURE_LENGTHS
from splitserve.engine import LLM, LLMEngine, SamplingParams
from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.config import CACHE_DTYPES as ENGINE_CACHE_DTYPES
from splitserve.engine.config import DEFAULT_MODEL, CacheConfig
from splitserve.engine.kv_cache import KV_KINDS
from splitserve.engine.sequence import Sequence
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.kvtransfer.codecs import EncodedKV, KVCodec, available_codecs, get_codec
from splitserve.runtime.config import described, parse_config
from splitserve.runtime.kv_codecs import ZSTD_SUFFIX, check_kv_codecs

REFERENCE_TEXT = Path("/usr/share/common-licenses/GPL-3")
CONTEXT_TOKENS = 512
SCORED_TOKENS = 256
SPEED_CHUNK_TOKENS = 1024
BLOCK_SIZE = CacheConfig.block_size
PROMPT_LENS = (100, 300)  # shortest and longest short agreement prompt, in tokens
# Long agreement prompts take the workloads' prompt lengths (bench/workload.py) at evenly spaced quantiles, capped
# here (as bench serve's --max-prompt-tokens scales traces down to small machines).
LONG_PROMPT_CAP = 1024
AGREEMENT_GROUP = 10  # prompts decoded together (and their lossless KV held at once)
BF16_BYTES = 2
CACHE_DTYPES = ("float16", "float32")  # the pods' default first: what is served
# (size ratio to bf16 at least, perplexity change in % at most, agreement at least): the targets
TARGETS = {"int8": (1.9, 0.5, 0.97), "kivi8": (1.9, 0.5, 0.97), "int4": (3.5, 0.5, 0.85),
           "kivi4": (3.5, 0.5, 0.85), "kivi2": (6.0, 2.0, 0.0)}

# Agreement prompts: prose (module docs) and code (function sources) of the standard library, which comes with the
# interpreter: the same text on every machine with the same Python, unlike anything downloaded.
PROSE_SOURCES = ("argparse", "json", "re", "statistics", "configparser", "socketserver", "hashlib", "wave", "uuid",
                 "urllib.request")  # modules: their docstrings
CODE_SOURCES = (("heapq", "merge"), ("textwrap", "TextWrapper._wrap_chunks"),
                ("difflib", "SequenceMatcher.find_longest_match"), ("json.encoder", "_make_iterencode"),
                ("collections", "namedtuple"), ("argparse", "ArgumentParser._parse_known_args"),
                ("shlex", "shlex.read_token"), ("csv", "Sniffer._guess_quote_and_delimiter"),
                ("configparser", "RawConfigParser._read"), ("fnmatch", "translate"))  # (module, qualname): sources
# Long prompts: prose from the other licenses Debian ships (two windows each), code from whole module sources.
LICENSE_TEXTS = ("Apache-2.0", "GPL-2", "LGPL-2.1", "MPL-2.0", "GFDL-1.3")
MODULE_SOURCES = ("difflib", "argparse", "typing", "dataclasses", "pathlib", "tarfile", "zipfile", "email.message",
                  "logging.handlers", "subprocess")


# ---- texts -------------------------------------------------------------------------------------------------------

def reference_tokens(tokenizer: Tokenizer) -> list[int]:
    """GPL-3's text, tokenized: the fixed English text of the perplexity windows and the speed chunk (and of the
    transfer benchmark's prompts)."""
    if not REFERENCE_TEXT.is_file():
        raise SystemExit(f"{REFERENCE_TEXT} is missing: the benchmark's reference text (Debian's base-files "
                         "package ships it)")
    return tokenizer.encode(REFERENCE_TEXT.read_text())


def agreement_prompts(tokenizer: Tokenizer, count: int) -> list[list[int]]:
    """``count`` prompts: the short ones (prose and code in turn, their lengths spread evenly over PROMPT_LENS),
    then the long ones (prose at the conversation workload's lengths, code at the code workload's, in turn)."""
    short_texts = [text for pair in zip(map(_module_doc, PROSE_SOURCES), (_source(*c) for c in CODE_SOURCES))
                   for text in pair]
    long_texts = [text for pair in zip(_license_windows(), map(_module_code, MODULE_SOURCES)) for text in pair]
    if not 1 <= count <= len(short_texts) + len(long_texts):
        raise SystemExit(f"--prompts must be in 1..{len(short_texts) + len(long_texts)}, got {count}")
    num_short = min(count, len(short_texts))
    shortest, longest = PROMPT_LENS
    lengths = [shortest + (longest - shortest) * i // max(1, num_short - 1) for i in range(num_short)]
    lengths += _workload_lengths(len(long_texts))
    prompts = []
    for i, (text, length) in enumerate(zip([*short_texts, *long_texts][:count], lengths)):
        tokens = tokenizer.encode(text)
        if len(tokens) < length:
            raise SystemExit(f"prompt {i} needs {length} tokens, its text has {len(tokens)}: {text[:60]!r}")
        prompts.append(tokens[:length])
    return prompts


def _workload_lengths(count: int) -> list[int]:
    """``count`` prompt lengths, conversation and code workload in turn, each at evenly spaced quantiles, capped."""
    workloads = [AZURE_LENGTHS[name][0] for name in ("azure-conv", "azure-code")]  # (prompt, output) lengths
    per_workload = -(-count // 2)
    return [min(LONG_PROMPT_CAP, workloads[i % 2].quantile((i // 2 + 0.5) / per_workload)) for i in range(count)]


def _license_windows() -> list[str]:
    texts = []
    for name in LICENSE_TEXTS:
        text = (REFERENCE_TEXT.parent / name).read_text()
        texts += [text, text[len(text) // 2:]]  # from the start and from the middle
    return texts


def _module_code(module: str) -> str:
    source = inspect.getsource(importlib.import_module(module))
    return source[re.search(r"^(def|class) ", source, re.MULTILINE).start():]  # past the header and docstring


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
        self.add_size(original, encoded)
        self.max_abs_error = max(self.max_abs_error, (decoded.float() - original.float()).abs().max().item())

    def add_size(self, original: torch.Tensor, encoded: EncodedKV) -> None:
        self.elements += original.numel()
        self.encoded_bytes += encoded.nbytes

    @property
    def ratio_to_bf16(self) -> float:
        return BF16_BYTES * self.elements / self.encoded_bytes


@dataclass
class PromptKV:
    """A prompt prefilled once, losslessly: its KV and first token, which every codec's run starts from."""

    tokens: list[int]
    kv: torch.Tensor  # [layers, 2 (K, V), T, H, D] in the cache dtype, on the cache's device
    first_token: int = -1  # sampled from the lossless logits, as on a prefill pod; -1 for perplexity contexts


def read_prompt_kv(engine: LLMEngine, seq: Sequence, num_tokens: int) -> torch.Tensor:
    """The KV of ``seq``'s first ``num_tokens`` tokens, every layer, K and V: [layers, 2, T, H, D] (copies)."""
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, num_tokens)
    return torch.stack([torch.stack([cache.read(layer, kind, slots) for kind in KV_KINDS])
                        for layer in range(cache.num_layers)])


def write_round_trip(engine: LLMEngine, seq: Sequence, kv: torch.Tensor, codec: KVCodec, tally: KVTally,
                     sized: dict[str, tuple[KVCodec, KVTally]]) -> None:
    """Write ``kv`` ([layers, 2, T, H, D]) after its codec round trip into ``seq``'s first T slots, as a decode pod
    stores a pushed prompt; the ``sized`` codecs (``codec``+zstd) encode the same KV too, for their sizes alone."""
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, kv.shape[2])
    for layer in range(cache.num_layers):
        for index, kind in enumerate(KV_KINDS):
            original = kv[layer, index]  # [T, H, D]
            encoded = codec.encode(original, kind)
            decoded = codec.decode(encoded, original.device)
            tally.add(original, decoded, encoded)
            for other, other_tally in sized.values():
                other_tally.add_size(original, other.encode(original, kind))
            cache.write(layer, kind, slots, decoded)


# ---- greedy agreement --------------------------------------------------------------------------------------------

def reference_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]],
                                                                                          list[PromptKV]]:
    """The lossless greedy continuations of ``prompts``, batched, and each prompt's KV and first token, taken
    right after its prefill step."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(f"reference-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    prefilled: dict[int, PromptKV] = {}
    while engine.has_unfinished_requests():
        engine.step()
        for i, seq in enumerate(seqs):
            if i not in prefilled and seq.num_computed_tokens >= seq.num_prompt_tokens and not seq.is_finished:
                kv = read_prompt_kv(engine, seq, seq.num_prompt_tokens)
                prefilled[i] = PromptKV(seq.prompt_token_ids, kv, seq.output_token_ids[0])
    _check_no_preemption(seqs)
    return [seq.output_token_ids for seq in seqs], [prefilled[i] for i in range(len(seqs))]


def greedy_outputs(engine: LLMEngine, prompts: list[PromptKV], max_tokens: int, codec: KVCodec, tally: KVTally,
                   sized: dict[str, tuple[KVCodec, KVTally]]) -> list[list[int]]:
    """Greedy continuations of the prefilled ``prompts`` as a decode pod runs them: blocks reserved, the prompt's
    KV written after its codec round trip, the sequence admitted with its first token; the generated tokens' KV is
    computed here, uncompressed."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = engine.reserve_for_transfer(f"agree-{i}", prompt.tokens, params)
        if seq is None:
            raise RuntimeError("the KV cache has no room for the agreement batch")
        write_round_trip(engine, seq, prompt.kv, codec, tally, sized)
        seqs.append(engine.admit_prefilled(seq, prompt.first_token))
    while engine.has_unfinished_requests():
        engine.step()
    _check_no_preemption(seqs)
    return [seq.output_token_ids for seq in seqs]


def _check_no_preemption(seqs: list[Sequence]) -> None:
    if any(seq.num_preemptions for seq in seqs):  # a re-prefill would have recomputed the KV losslessly
        raise RuntimeError("a sequence was preempted: the KV cache is too small for the agreement batch")


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[float, int]:
    """(share of the reference's tokens generated before each continuation's first divergence, number of
    continuations equal in full)."""
    kept = sum(_common_prefix(ref, out) for ref, out in zip(reference, outputs))
    return kept / sum(map(len, reference)), sum(ref == out for ref, out in zip(reference, outputs))


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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


def window_nll(engine: LLMEngine, context: PromptKV, codec: KVCodec, tally: KVTally,
               sized: dict[str, tuple[KVCodec, KVTally]]) -> float:
    """Summed NLL of the window's SCORED_TOKENS targets, each predicted by a row attending to the lossy context."""
    window = context.tokens
    seq = _reserve(engine, window[:-1])  # blocks for the whole window, as a decode pod reserves a pushed prompt's
    try:
        write_round_trip(engine, seq, context.kv, codec, tally, sized)
        hidden = forward(engine, seq, CONTEXT_TOKENS, len(window) - 1)  # [SCORED_TOKENS, H]
        with torch.inference_mode():
            logits = engine.runner.model.compute_logits(hidden)  # [SCORED_TOKENS, vocab] float32
            targets = torch.tensor(window[CONTEXT_TOKENS + 1:], device=logits.device)
            return F.cross_entropy(logits, targets, reduction="sum").item()
    finally:
        engine.release_transfer(seq)


def _reserve(engine: LLMEngine, tokens: list[int]) -> Sequence:
    seq = engine.reserve_for_transfer("perplexity", tokens, SamplingParams())
    if seq is None:
        raise RuntimeError("the KV cache has no room for a perplexity window")
    return seq


def perplexity(engine: LLMEngine, contexts: list[PromptKV], codec: KVCodec, tally: KVTally,
               sized: dict[str, tuple[KVCodec, KVTally]]) -> float:
    nll = sum(window_nll(engine, context, codec, tally, sized) for context in contexts)
    return math.exp(nll / (len(contexts) * SCORED_TOKENS))


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
    engine = _load(model, cache_dtype, groups, max_tokens).engine
    chunk = speed_chunk(engine, text)
    # Back to back, so that every codec's speed is taken under the same load on the machine.
    speeds = {name: codec_speed(get_codec(name), chunk, repeat) for name in codecs}
    log(f"measured encode/decode speeds on one layer's K and V of {SPEED_CHUNK_TOKENS} tokens, best of {repeat} runs")
    log(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens in groups of "
        f"{AGREEMENT_GROUP}, {max_tokens} greedy tokens each; {len(windows)} perplexity windows of "
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
            sized = {other: (get_codec(other), tallies[other]) for other in zstd_of[name]}
            outputs[name] += greedy_outputs(engine, prefilled, max_tokens, get_codec(name), tallies[name], sized)
        log(f"group {number}/{len(groups)}: every codec's greedy run ({time.perf_counter() - start:.1f} s)")
    contexts = prefill_contexts(engine, windows)
    figures: dict[str, CodecFigures] = {}
    for name in measured:
        sized = {other: (get_codec(other), tallies[other]) for other in zstd_of[name]}
        ppl = perplexity(engine, contexts, get_codec(name), tallies[name], sized)
        agree, identical = agreement(reference, outputs[name])
        for figured in (name, *sized):
            tally = tallies[figured]
            f = figures[figured] = CodecFigures(tally.ratio_to_bf16, tallies[name].max_abs_error, agree, identical,
                                                ppl, 0.0, *speeds[figured])
            log(f"{figured}: {f.ratio_to_bf16:.2f}x smaller than bf16, agreement {f.agreement:.1%}, identical "
                f"{f.identical}/{len(prompts)}, perplexity {f.perplexity:.3f}")
    for f in figures.values():
        f.ppl_change_pct = 100.0 * (f.perplexity / figures["none"].perplexity - 1.0)
    return {"cache_dtype": cache_dtype, "codecs": {name: asdict(figures[name]) for name in codecs},
            "targets": targets(figures, len(prompts))}


def _load(model: str, cache_dtype: str, groups: list[list[list[int]]], max_tokens: int) -> LLM:
    # A group's prompts prefill in steps of at most max_num_batched_tokens, and the cache holds them with their
    # outputs: no preemption.
    return LLM(model=model, enable_prefix_caching=False, max_num_seqs=max(map(len, groups)), block_size=BLOCK_SIZE,
               cache_dtype=cache_dtype, num_blocks=max(_cache_blocks(group, max_tokens) for group in groups),
               long_prefill_token_threshold=LONG_PROMPT_CAP, max_num_batched_tokens=4096)


def _cache_blocks(prompts: list[list[int]], max_tokens: int) -> int:
    """Blocks for the agreement batch with its outputs, or for the speed chunk (the largest single sequence):
    no more, since a float32 cache of 40 long prompts is gigabytes."""
    batch = sum(-(-(len(prompt) + max_tokens) // BLOCK_SIZE) for prompt in prompts)
    return max(batch, -(-SPEED_CHUNK_TOKENS // BLOCK_SIZE), -(-(CONTEXT_TOKENS + SCORED_TOKENS) // BLOCK_SIZE))


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
                                            "ratio_to_bf16": round(f["ratio_to_bf16"], 3),
                                            "encode_mb_s": round(f["encode_mb_s"]),
                                            "decode_mb_s": round(f["decode_mb_s"])}
                                     for name, f in run["codecs"].items()}
                             for dtype, run in results["cache_dtypes"].items()}}


def report(results: dict, log=print) -> None:
    for dtype, run_figures in results["cache_dtypes"].items():
        log(f"\n== KV codecs on {results['model']}, {dtype} cache: {results['prompts']} prompts x "
            f"{results['tokens']} greedy tokens, perplexity over {results['windows']} windows of "
            f"{results['context_tokens']}+{results['scored_tokens']} tokens ==")
        log(f"{'codec':<11} {'vs bf16':>8} {'enc MB/s':>9} {'dec MB/s':>9} {'max |err|':>10} {'agree':>7} "
            f"{'same':>6} {'ppl':>8} {'ppl chg':>8}")
        for name, f in run_figures["codecs"].items():
            log(f"{name:<11} {f['ratio_to_bf16']:>7.2f}x {f['encode_mb_s']:>9.0f} {f['decode_mb_s']:>9.0f} "
                f"{f['max_abs_error']:>10.2e} {f['agreement']:>7.1%} {f['identical']:>3}/{results['prompts']:<2} "
                f"{f['perplexity']:>8.3f} {f['ppl_change_pct']:>+7.2f}%")
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
        "Codecs to measure (none is always measured: it is the baseline)."))
    cache_dtypes: list[str] = field(default_factory=lambda: list(CACHE_DTYPES), metadata=described(
        "KV cache dtypes to measure on, each a run of its own (float16: the pods' default)."))
    prompts: int = field(default=40, metadata=described("Greedy-agreement prompts (20 short, then 20 long)."))
    tokens: int = field(default=128, metadata=described("Greedy tokens per prompt."))
    windows: int = field(default=6, metadata=described("Perplexity windows."))
    repeat: int = field(default=10, metadata=described("Encode/decode timing runs (best is kept)."))
    quality_table: str = field(default="", metadata=described(
        "Also write the quality table the prefill pods read (e.g. kvtransfer/quality/smollm2-135m.json)."))
    through_up: bool = field(default=False, metadata=described(
        "Instead: each codec's agreement over the real path, a splitserve up cluster per codec against the none "
        "one (bench/codecs_served.py), beside the shipped quality table's."))
    through_up_concurrency: int = field(default=4, metadata=described(
        "--through-up: requests in flight at once."))

    def __post_init__(self) -> None:
        check_kv_codecs("codecs", self.codecs)
        if not self.cache_dtypes or not set(self.cache_dtypes) <= set(ENGINE_CACHE_DTYPES):
            raise ValueError(f"cache_dtypes must name some of {', '.join(ENGINE_CACHE_DTYPES)}, "
                             f"got {self.cache_dtypes!r}")
        if min(self.prompts, self.tokens, self.windows, self.repeat, self.through_up_concurrency) < 1:
            raise ValueError("prompts, tokens, windows, repeat and through_up_concurrency must be >= 1")


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(CodecsBenchConfig, argv, prog="splitserve bench codecs")
    codecs = ["none", *(name for name in config.codecs if name != "none")]
    if config.through_up:
        from splitserve.bench import codecs_served  # it builds on this module

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
