"""Where do the KV codecs' greedy divergences come from? A measurement behind docs/PERFORMANCE.md's codec section.

    .venv/bin/python scripts/codec_diagnosis.py [--prompts 40] [--variants none,bf16,kivi8,kivi8:only=k,...]

On the served float16 cache and ``bench codecs``' agreement prompts, as ``bench codecs`` measures agreement
(``reference_run``, then ``greedy_outputs`` per variant), plus:
  - the lossless reference's top-2 log-probability gap at every generated position (a second lossless run with
    ``logprobs=2``, checked to give the same tokens): how many near ties a perturbation of the KV can flip;
  - per variant, each diverging (prompt, position) with the reference's gap there.
A variant is a codec name, optionally with ``:`` and ``;``-separated settings: ``only=k`` / ``only=v`` round-trips
that kind alone (the other stays exact), and ``sinks=``, ``window=``, ``key_group=`` build a KIVI codec with them.
"""

from __future__ import annotations

import argparse
import math

from splitserve.engine import SamplingParams
from splitserve.engine.config import DEFAULT_MODEL
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.kvtransfer.codecs import get_codec
from splitserve.measure.codec_agreement import (
    AGREEMENT_GROUP,
    KVTally,
    agreement,
    common_prefix,
    greedy_outputs,
    load_model,
    reference_run,
)
from splitserve.measure.codec_texts import agreement_prompts

DEFAULT_VARIANTS = ("none,bf16,kivi8,kivi8:only=k,kivi8:only=v,kivi8:window=128,kivi4,kivi4:only=k,kivi4:only=v,"
                    "kivi4:window=128;key_group=16")
GAP_THRESHOLDS = (0.001, 0.01, 0.03, 0.1)


class OneKind:
    """A codec that round-trips one kind (``"k"`` or ``"v"``) through ``inner`` and the other through ``none``."""

    def __init__(self, inner, kind: str):
        self.inner, self.kind, self.lossless = inner, kind, get_codec("none")

    def encode(self, x, kind, span=None):
        return (self.inner if kind == self.kind else self.lossless).encode(x, kind, span)

    def decode(self, encoded, device):
        return (self.inner if encoded.codec == self.inner.name else self.lossless).decode(encoded, device)


def make_variant(spec: str):
    name, _, settings = spec.partition(":")
    only, kivi = "", {}
    for setting in filter(None, settings.split(";")):
        key, value = setting.split("=")
        if key == "only":
            only = value
        else:
            kivi[key] = int(value)
    codec = type(get_codec(name))(**kivi) if kivi else get_codec(name)
    return OneKind(codec, only) if only else codec


def top2_gaps(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """The lossless greedy answers and, per generated position, log p(top 1) - log p(top 2)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    seqs = [engine.add_request(f"gaps-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    gaps = []
    for seq in seqs:
        tops = [sorted(logprobs.values(), reverse=True) for logprobs in seq.output_logprobs]
        gaps.append([top[0] - top[1] if len(top) > 1 else math.inf for top in tops])
    return [seq.output_token_ids for seq in seqs], gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    args = parser.parse_args()
    variants = args.variants.split(",")
    prompts = agreement_prompts(load_tokenizer(DEFAULT_MODEL), args.prompts)
    groups = [prompts[i:i + AGREEMENT_GROUP] for i in range(0, len(prompts), AGREEMENT_GROUP)]
    engine = load_model(DEFAULT_MODEL, "float16", groups, args.tokens).engine
    reference, gaps, outputs = [], [], {spec: [] for spec in variants}
    for group in groups:
        group_reference, prefilled = reference_run(engine, group, args.tokens)
        group_answers, group_gaps = top2_gaps(engine, group, args.tokens)
        if group_answers != group_reference:
            raise SystemExit("the lossless run with logprobs gave other tokens than the reference")
        reference += group_reference
        gaps += group_gaps
        for spec in variants:
            outputs[spec] += greedy_outputs(engine, prefilled, args.tokens, make_variant(spec), KVTally(), {})
    flat = [gap for row in gaps for gap in row]
    for threshold in GAP_THRESHOLDS:
        print(f"reference positions with a top-2 gap < {threshold}: {sum(g < threshold for g in flat)} of "
              f"{len(flat)}, in {sum(any(g < threshold for g in row) for row in gaps)} of {len(gaps)} answers")
    for spec in variants:
        share, same = agreement(reference, outputs[spec])
        diverged = [(i, common_prefix(ref, out)) for i, (ref, out) in enumerate(zip(reference, outputs[spec]))
                    if ref != out]
        where = ", ".join(f"{i}@{pos} (gap {gaps[i][pos]:.4f})" for i, pos in diverged)
        print(f"{spec}: agreement {share:.1%}, same {same}/{len(reference)}; diverged at {where or 'none'}")


if __name__ == "__main__":
    main()
