"""Structured outputs' cost: decode step time (TPOT) with a JSON schema against an unconstrained request, side by side.

    splitserve bench structured [--batches 1,16] [--tokens 48] [--rounds 3]

Two engines of the same model decode the same chat prompts, one with a JSON schema (an object with one string of exactly
400 characters, so that no request ends before ``--tokens``), one unconstrained (``ignore_eos``), taking turns step by
step; every request of a batch decodes ``--tokens`` tokens. The figure is the mean wall time of the steps that prefilled
nothing (one token per request), each engine's best round; the overhead is the constrained engine's over the
unconstrained one's. The grammar's masks are computed on a worker thread while the model runs
(engine/structured_output/masks.py): on one core (``taskset -c 1``) the two share it, so the overlap hides nothing
there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import DEFAULT_MODEL
from splitserve.engine.sampling.params import StructuredOutput

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400, "maxLength": 400}},
          "required": ["text"], "additionalProperties": False}
PROMPTS = ["Describe the sea.", "Write about a city at night.", "Tell me about bread.", "Explain the tides."]


def decode_step_times(llm: LLM, batch: int, params: SamplingParams) -> list[float]:
    """Seconds of each step of ``batch`` requests that prefilled nothing."""
    engine = llm.engine
    for i in range(batch):
        text = f"<|im_start|>user\n{PROMPTS[i % len(PROMPTS)]}<|im_end|>\n<|im_start|>assistant\n"
        engine.add_request(f"r{time.monotonic_ns()}-{i}", llm.tokenizer.encode(text), params)
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        if engine.last_step is not None and engine.last_step.num_prefill_tokens == 0:
            times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    engines = {name: LLM(model=args.model, kv_cache_memory_bytes=256 << 20) for name in ("plain", "json")}
    params = {"plain": SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True),
              "json": SamplingParams(temperature=0, max_tokens=args.tokens,
                                     structured_output=StructuredOutput(json=json.dumps(SCHEMA)))}
    print(f"model {args.model}, {args.tokens} tokens per request, best of {args.rounds} rounds (spread: all rounds)")
    for batch in [int(b) for b in args.batches.split(",")]:
        rounds = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():  # taking turns, so that load on the machine hits both alike
                rounds[name].append(statistics.mean(decode_step_times(llm, batch, params[name])) * 1e3)
        best = {name: min(values) for name, values in rounds.items()}
        spread = {name: f"{min(values):.2f}-{max(values):.2f}" for name, values in rounds.items()}
        print(f"batch {batch:>3}: TPOT plain {best['plain']:.2f} ms ({spread['plain']}), json {best['json']:.2f} ms "
              f"({spread['json']}): {100 * (best['json'] / best['plain'] - 1):+.1f}%")


if __name__ == "__main__":
    main()
