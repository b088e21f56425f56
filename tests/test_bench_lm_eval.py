"""``splitserve bench lm_eval``'s side of the check, without lm-eval: samples logged in lm-eval's shape are compared
with the offline engine's answers to the same requests (lm-eval's split of a context and its continuation, the sum
of the continuation's prompt logprobs, greedy generation to a stop string); any difference is reported."""

from __future__ import annotations

import json

from splitserve.bench.lm_eval import check as lm_eval_bench
from splitserve.engine import LLM


def write_samples(out_dir, task: str, samples: list[dict]) -> None:
    directory = out_dir / "tiny-random"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"samples_{task}_2026.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def test_answers_equal_to_the_offline_engines_pass_and_any_other_is_a_difference(tmp_path):
    llm = LLM(model="tiny-random", num_blocks=64)
    context, continuations = "The opposite of hot is ", ["cold", "warm"]
    scores = [lm_eval_bench.offline_loglikelihood(llm, context, c) for c in continuations]
    # lm-eval's split: the trailing space belongs to the continuation.
    context_ids, continuation_ids = lm_eval_bench.encode_pair(llm.tokenizer, context, "cold")
    assert llm.tokenizer.decode(continuation_ids) == " cold" and llm.tokenizer.decode(context_ids) == context[:-1]
    choice = {"arguments": {f"gen_args_{i}": {"arg_0": context, "arg_1": c} for i, c in enumerate(continuations)},
              "resps": [[[str(logprob), str(greedy)]] for logprob, greedy in scores]}
    until = ["\n"]
    generated = lm_eval_bench.offline_generation(llm, "List three animals:", until)
    generate = {"arguments": {"gen_args_0": {"arg_0": "List three animals:", "arg_1": {"until": until}}},
                "resps": [[generated]]}
    write_samples(tmp_path, "splitserve_choice", [choice])
    write_samples(tmp_path, "splitserve_generate", [generate])
    assert lm_eval_bench.compare(llm, tmp_path) == {"loglikelihood": 2, "generate_until": 1, "differences": []}

    choice["resps"][1] = [[str(scores[1][0] + 1e-6), str(scores[1][1])]]
    generate["resps"] = [[generated + "x"]]
    write_samples(tmp_path, "splitserve_choice", [choice])
    write_samples(tmp_path, "splitserve_generate", [generate])
    differences = lm_eval_bench.compare(llm, tmp_path)["differences"]
    assert [d.get("continuation") for d in differences] == ["warm", None]


def test_under_a_lossy_codec_only_the_first_generated_token_is_checked(tmp_path):
    """A lossy KV codec changes what the decode pod generates from its second token on; the first is sampled on the
    prefill pod from its own KV and must still be the offline engine's."""
    llm = LLM(model="tiny-random", num_blocks=64)
    context, until = "List three animals:", ["\n"]
    full = lm_eval_bench.offline_generation(llm, context, until)
    first = lm_eval_bench.offline_generation(llm, context, until, max_tokens=1)
    assert first and full.startswith(first)
    arguments = {"gen_args_0": {"arg_0": context, "arg_1": {"until": until}}}
    for served, differs in ((first + "\u2603 other tokens", False), ("\u2603" + full, True)):
        write_samples(tmp_path, "recall_generate", [{"arguments": arguments, "resps": [[served]]}])
        result = lm_eval_bench.compare(llm, tmp_path, ("recall_generate",), exact_generation=False)
        assert (result["generate_until"], bool(result["differences"])) == (1, differs)
