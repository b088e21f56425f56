"""Speculative decoding benchmark: the same prompts decoded with and without it, side by side in one run.

Two kinds of prompts, built from local text (this repository's own source files and docs):
  - input-grounded: summarise, extract from, rewrite or edit a given text or code, whose answers copy from it
    (what prompt lookup predicts);
  - open-ended: questions and stories with nothing to copy from (where speculation must not cost more than ~5%).
For each batch size (1, 4 and 16 by default) and each kind, one engine with speculation and one without decode the
same batch greedily, taking turns over ``--rounds`` rounds (each keeps its best); the figures are decode tokens/s
(output tokens after each request's first, over the wall time of the steps that decoded), TPOT (mean over
requests), and for speculation the acceptance rate (accepted / draft tokens) and the mean accepted length (tokens
per verification: 1 + accepted / drafts). Greedy outputs must be identical; the run says so.

Pin it to a core (``taskset -c 1 splitserve bench spec``): a machine shared with other work moves the figures, the
ratios measured side by side move less.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

from engine import LLM, SamplingParams
from engine.config import DEFAULT_MODEL
from splitserve.bench import headless_pyplot, save_results

BATCHES = (1, 4, 16)
REPO = Path(__file__).resolve().parents[2]
# (instruction, file): the input-grounded tasks, each over a slice of one of the repository's files.
GROUNDED_TASKS = [
    ("Summarise this text in a few sentences.", "docs/architecture.md"),
    ("Rewrite this Python code without its comments and docstrings.", "engine/sequence.py"),
    ("List every function and class this code defines, with its first docstring line.", "engine/scheduler.py"),
    ("Add a docstring to every function of this code that has none; return the whole code.", "engine/sampler.py"),
    ("Extract every configuration field and its default value from this code.", "engine/config.py"),
    ("Rewrite this text as a bulleted list of its main points.", "docs/PERFORMANCE.md"),
    ("Rename the variable `seq` to `sequence` everywhere in this code and return it.", "engine/block_manager.py"),
    ("Summarise what this code does, then quote its most important line.", "engine/kv_cache.py"),
]
OPEN_ENDED = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue, as you would to a curious ten-year-old.",
    "What are three good habits for staying healthy while working from home?",
    "Describe a day in the life of a medieval blacksmith.",
    "Give me some ideas for a birthday party for a friend who loves astronomy.",
    "Why do cats purr? Give a few possible reasons.",
    "Write a poem about autumn rain in a big city.",
    "What would you pack for a week-long hiking trip in the mountains, and why?",
]
SLICE_CHARS = 1800  # of each file: prompts of ~500 tokens


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def grounded_prompts(count: int) -> list[str]:
    """``count`` input-grounded prompts: each task over successive slices of its file."""
    prompts = []
    for i in range(count):
        instruction, path = GROUNDED_TASKS[i % len(GROUNDED_TASKS)]
        text = (REPO / path).read_text()
        start = (i // len(GROUNDED_TASKS)) * SLICE_CHARS % max(1, len(text) - SLICE_CHARS)
        prompts.append(chat(f"{instruction}\n\n{text[start:start + SLICE_CHARS]}"))
    return prompts


def open_ended_prompts(count: int) -> list[str]:
    return [chat(OPEN_ENDED[i % len(OPEN_ENDED)] + ("" if i < len(OPEN_ENDED) else f" (take {i // 8 + 1})"))
            for i in range(count)]


@dataclass
class DecodeRun:
    tokens_per_s: float
    tpot_s: float
    token_ids: list[list[int]]
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafts: int = 0


def decode_batch(llm: LLM, prompts: list[str], max_tokens: int) -> DecodeRun:
    """Run ``prompts`` as one batch to the end; time the steps in which every running request decoded."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    counts_before = (engine.spec_decode.num_draft_tokens, engine.spec_decode.num_accepted_tokens,
                     engine.spec_decode.num_drafts)
    seqs = [engine.add_request(f"spec-bench-{time.monotonic_ns()}-{i}", llm.tokenizer.encode(p), params)
            for i, p in enumerate(prompts)]
    decode_seconds, decode_tokens, done_at = 0.0, 0, {}
    while engine.has_unfinished_requests():
        before = {seq.request_id: seq.num_output_tokens for seq in seqs}
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        stats = engine.last_step
        for seq in seqs:
            if seq.is_finished and seq.request_id not in done_at:
                done_at[seq.request_id] = time.monotonic()
        if stats.num_prefill_tokens == 0:  # a pure decode step (speculation's verified drafts included)
            decode_seconds += elapsed
            decode_tokens += sum(seq.num_output_tokens - before[seq.request_id] for seq in seqs)
    tpots = [(done_at[seq.request_id] - seq.first_token_time) / (seq.num_output_tokens - 1)
             for seq in seqs if seq.num_output_tokens > 1]
    counts = engine.spec_decode
    return DecodeRun(decode_tokens / decode_seconds, sum(tpots) / len(tpots), [seq.output_token_ids for seq in seqs],
                     counts.num_draft_tokens - counts_before[0], counts.num_accepted_tokens - counts_before[1],
                     counts.num_drafts - counts_before[2])


def run(model: str, batches: tuple[int, ...], max_tokens: int, rounds: int, num_speculative_tokens: int,
        log=print) -> dict:
    log(f"loading {model} twice: without speculation, and with ngram (k <= {num_speculative_tokens}) ...")
    settings = {"kv_cache_memory_bytes": 512 << 20, "max_num_seqs": max(batches)}
    plain = LLM(model=model, **settings)
    spec = LLM(model=model, speculative_config={"method": "ngram", "num_speculative_tokens": num_speculative_tokens},
               **settings)
    results: dict = {"model": model, "max_tokens": max_tokens, "rounds": rounds,
                     "num_speculative_tokens": num_speculative_tokens, "rows": []}
    for kind, prompts_for in (("input-grounded", grounded_prompts), ("open-ended", open_ended_prompts)):
        for batch in batches:
            prompts = prompts_for(batch)
            best: dict[str, DecodeRun] = {}
            for r in range(rounds):
                for name, llm in (("off", plain), ("on", spec)):
                    log(f"{kind}, batch {batch}, round {r + 1}/{rounds}: speculation {name} ...")
                    result = decode_batch(llm, prompts, max_tokens)
                    if name not in best or result.tokens_per_s > best[name].tokens_per_s:
                        best[name] = result
            off, on = best["off"], best["on"]
            results["rows"].append({
                "kind": kind, "batch": batch,
                "off_tok_s": off.tokens_per_s, "on_tok_s": on.tokens_per_s, "speedup": on.tokens_per_s / off.tokens_per_s,
                "off_tpot_ms": off.tpot_s * 1e3, "on_tpot_ms": on.tpot_s * 1e3,
                "acceptance_rate": on.accepted_tokens / on.draft_tokens if on.draft_tokens else 0.0,
                "mean_accepted_length": 1 + on.accepted_tokens / on.drafts if on.drafts else 1.0,
                "draft_tokens": on.draft_tokens, "identical": on.token_ids == off.token_ids,
                "output_tokens": sum(len(t) for t in on.token_ids),
            })
    return results


# The targets, as speedups of tokens/s: (prompt kind or None for both, batch) -> (least speedup, wording).
TARGETS = {("input-grounded", 1): (1.8, ">= 1.8x"), ("open-ended", 1): (0.95, ">= 0.95x (at most 5% slower)"),
           (None, 16): (1.0, ">= 1.0x (not slower)")}


def report(results: dict, log=print) -> None:
    log(f"\n== speculative decoding (ngram, k <= {results['num_speculative_tokens']}), greedy, "
        f"{results['max_tokens']} tokens max, best of {results['rounds']} interleaved rounds ==")
    log(f"{'prompts':<15} {'batch':>5} {'off tok/s':>10} {'on tok/s':>9} {'speedup':>8} {'off TPOT':>9} "
        f"{'on TPOT':>8} {'accept':>7} {'acc.len':>8} {'identical':>10}")
    for row in results["rows"]:
        log(f"{row['kind']:<15} {row['batch']:>5} {row['off_tok_s']:>10.1f} {row['on_tok_s']:>9.1f} "
            f"{row['speedup']:>7.2f}x {row['off_tpot_ms']:>7.1f}ms {row['on_tpot_ms']:>6.1f}ms "
            f"{row['acceptance_rate']:>7.0%} {row['mean_accepted_length']:>8.2f} {str(row['identical']):>10}")
    log("\n== targets ==")
    for row in results["rows"]:
        target = TARGETS.get((row["kind"], row["batch"])) or TARGETS.get((None, row["batch"]))
        if target:
            verdict = "met" if row["speedup"] >= target[0] else "MISSED"
            log(f"{row['kind']}, batch {row['batch']}: {row['speedup']:.2f}x (target {target[1]}): {verdict}")


def plot(results: dict, path: str) -> None:
    """Tokens/s with and without speculation per batch size, one panel per prompt kind."""
    plt = headless_pyplot()
    kinds = list(dict.fromkeys(row["kind"] for row in results["rows"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows = [row for row in results["rows"] if row["kind"] == kind]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [row["off_tok_s"] for row in rows], 0.4, label="without speculation")
        ax.bar([x + 0.2 for x in xs], [row["on_tok_s"] for row in rows], 0.4, label="ngram speculation")
        for x, row in zip(xs, rows):
            ax.annotate(f"{row['speedup']:.2f}x\naccept {row['acceptance_rate']:.0%}", (x + 0.2, row["on_tok_s"]),
                        ha="center", va="bottom", fontsize=8)
        ax.set(xticks=list(xs), xticklabels=[str(row["batch"]) for row in rows], xlabel="batch (requests)",
               ylabel="decode tokens/s", title=f"{kind} prompts")
        ax.legend(loc="upper left")
    fig.suptitle(f"{results['model']}: speculative decoding on vs off, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="splitserve bench spec", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)),
                        type=lambda s: tuple(int(b) for b in s.split(",")), help="batch sizes, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each setting keeps its best)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--plot", help="also draw the figures into this .png")
    args = parser.parse_args(argv)
    results = run(args.model, args.batches, args.max_tokens, args.rounds, args.num_speculative_tokens)
    report(results)
    save_results(results, args.json, args.plot, plot)
