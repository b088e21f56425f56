"""Speculative decoding benchmark: the same prompts decoded with and without it, side by side in one run.

Two kinds of prompts, built from local text (this repository's own source files and docs):
  - input-grounded: summarise, extract from, rewrite or edit a given text or code, whose answers copy from it
    (what prompt lookup predicts);
  - open-ended: questions and stories with nothing to copy from (where speculation must not cost more than ~5%).
For each batch size (1, 4 and 16 by default) and each kind, one engine with speculation and one without decode the
same batch greedily, taking turns step by step, over ``--rounds`` rounds (each keeps its best); the figures are
decode tokens/s (output tokens over the wall time of the steps that prefilled nothing), TPOT (mean over requests of
each engine's own step time per token after the first), and for speculation the acceptance rate (accepted / draft
tokens) and the mean accepted length (tokens per verification: 1 + accepted / drafts). Greedy outputs must be
identical; the run says so.

Pin it to a core (``taskset -c 1 splitserve bench spec``): a machine shared with other work moves the figures, the
ratios measured side by side move less.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import DEFAULT_MODEL
from splitserve.measure.figures import FiguresOutput, headless_pyplot, save_figure, save_results
from splitserve.runtime.config import described, parse_config

BATCHES = (1, 4, 16)
REPO = Path(__file__).resolve().parents[1]
# (instruction, file): the input-grounded tasks, each over a slice of one of the repository's files.
GROUNDED_TASKS = [
    ("Summarise this text in a few sentences.", "docs/architecture.md"),
    ("Rewrite this Python code without its comments and docstrings.", "engine/sequence.py"),
    ("List every function and class this code defines, with its first docstring line.", "engine/scheduler.py"),
    ("Add a docstring to every function of this code that has none; return the whole code.",
     "engine/sampling/sampler.py"),
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


class BatchRun:
    """One engine decoding one batch to the end, a step at a time (so that two runs can take turns step by step),
    timing the steps in which no prompt was prefilled."""

    def __init__(self, llm: LLM, prompts: list[str], max_tokens: int, tag: str, ignore_eos: bool = False):
        self.engine = engine = llm.engine
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        counts = engine.spec_decode
        self._counts_before = (counts.num_draft_tokens, counts.num_accepted_tokens, counts.num_drafts)
        self.seqs = [engine.add_request(f"spec-bench-{tag}-{i}", llm.tokenizer.encode(p), params)
                     for i, p in enumerate(prompts)]
        self.decode_seconds, self.decode_tokens = 0.0, 0
        # Per request: this engine's step time since its first token (the other run's steps do not count).
        self._seconds_since_first = [0.0] * len(self.seqs)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def step(self) -> None:
        before = sum(seq.num_output_tokens for seq in self.seqs)
        decoding = [i for i, seq in enumerate(self.seqs) if seq.num_output_tokens and not seq.is_finished]
        start = time.perf_counter()
        self.engine.step()
        elapsed = time.perf_counter() - start
        for i in decoding:
            self._seconds_since_first[i] += elapsed
        if self.engine.last_step.num_prefill_tokens == 0:  # a pure decode step (verified drafts included)
            self.decode_seconds += elapsed
            self.decode_tokens += sum(seq.num_output_tokens for seq in self.seqs) - before

    def figures(self) -> dict:
        tpots = [seconds / (seq.num_output_tokens - 1)
                 for seq, seconds in zip(self.seqs, self._seconds_since_first) if seq.num_output_tokens > 1]
        counts = self.engine.spec_decode
        drafted, accepted, drafts = (counts.num_draft_tokens - self._counts_before[0],
                                     counts.num_accepted_tokens - self._counts_before[1],
                                     counts.num_drafts - self._counts_before[2])
        return {"tok_s": self.decode_tokens / self.decode_seconds, "tpot_ms": 1e3 * sum(tpots) / len(tpots),
                "draft_tokens": drafted, "accepted_tokens": accepted, "drafts": drafts,
                "token_ids": [seq.output_token_ids for seq in self.seqs]}


def decode_side_by_side(plain: LLM, spec: LLM, prompts: list[str], max_tokens: int, tag: str) -> tuple[dict, dict]:
    """Both engines decode the batch, taking turns step by step: a machine whose load drifts (a shared one) slows
    both alike, which separate runs one after the other would not."""
    runs = [BatchRun(plain, prompts, max_tokens, tag), BatchRun(spec, prompts, max_tokens, tag)]
    while not all(run.finished for run in runs):
        for run in runs:
            if not run.finished:
                run.step()
    return runs[0].figures(), runs[1].figures()


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
            best_off = best_on = None
            for r in range(rounds):
                log(f"{kind}, batch {batch}, round {r + 1}/{rounds}: with and without speculation, step by step ...")
                off, on = decode_side_by_side(plain, spec, prompts, max_tokens, f"{kind}-{batch}-{r}")
                best_off = off if best_off is None or off["tok_s"] > best_off["tok_s"] else best_off
                best_on = on if best_on is None or on["tok_s"] > best_on["tok_s"] else best_on
            results["rows"].append({
                "kind": kind, "batch": batch,
                "off_tok_s": best_off["tok_s"], "on_tok_s": best_on["tok_s"],
                "speedup": best_on["tok_s"] / best_off["tok_s"],
                "off_tpot_ms": best_off["tpot_ms"], "on_tpot_ms": best_on["tpot_ms"],
                "acceptance_rate": best_on["accepted_tokens"] / best_on["draft_tokens"] if best_on["draft_tokens"]
                else 0.0,
                "mean_accepted_length": 1 + best_on["accepted_tokens"] / best_on["drafts"] if best_on["drafts"]
                else 1.0,
                "draft_tokens": best_on["draft_tokens"], "identical": best_on["token_ids"] == best_off["token_ids"],
                "output_tokens": sum(len(t) for t in best_on["token_ids"]),
            })
    return results


# The targets, as speedups of tokens/s: (prompt kind or None for both, batch) -> (least speedup, wording).
TARGETS = {("input-grounded", 1): (1.8, ">= 1.8x"), ("open-ended", 1): (0.95, ">= 0.95x (at most 5% slower)"),
           (None, 16): (1.0, ">= 1.0x (not slower)")}


def report(results: dict, log=print) -> None:
    log(f"\n== speculative decoding (ngram, k <= {results['num_speculative_tokens']}), greedy, "
        f"{results['max_tokens']} tokens max, steps taking turns, best of {results['rounds']} round(s) ==")
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
    save_figure(fig, path)


@dataclass
class SpecBenchConfig(FiguresOutput):
    """Speculative decoding on vs off: the same requests through two engines taking turns step by step."""

    model: str = field(default=DEFAULT_MODEL, metadata=described("Model to load (tiny-random for a quick run)."))
    batches: list[int] = field(default_factory=lambda: list(BATCHES), metadata=described(
        "Batch sizes (requests decoded together)."))
    max_tokens: int = field(default=128, metadata=described("Output tokens per request at most."))
    rounds: int = field(default=1, metadata=described("Rounds (each setting keeps its best)."))
    num_speculative_tokens: int = field(default=4, metadata=described("Most draft tokens verified per step."))

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be >= 1, got {self.batches}")
        if min(self.max_tokens, self.rounds, self.num_speculative_tokens) < 1:
            raise ValueError("max_tokens, rounds and num_speculative_tokens must be >= 1")


def main(argv: list[str] | None = None) -> None:
    config = parse_config(SpecBenchConfig, argv, prog="splitserve bench spec")
    results = run(config.model, tuple(config.batches), config.max_tokens, config.rounds, config.num_speculative_tokens)
    report(results)
    save_results(results, config.json, config.plot, plot)
