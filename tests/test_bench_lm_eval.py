"""``splitserve bench lm_eval``'s side of the check, without lm-eval: samples logged in lm-eval's shape are compared
with the offline engine's answers to the same requests (lm-eval's split of a context and its continuation, the sum
of the continuation's prompt logprobs, greedy generation to a stop string); any difference is reported. And the
side-by-side mode's sweeps (bench/lm_eval/scores.py): the settings each runs, their labels, a shared one run once."""

from __future__ import annotations

import json

from splitserve.bench.lm_eval import check as lm_eval_bench
from splitserve.bench.lm_eval import scores
from splitserve.engine import LLM
from splitserve.engine.kernels.cpu_features import prefill_compute_dtype
from splitserve.up_config import UpConfig


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


def test_each_sweep_varies_its_field_under_the_other_sweeps_references_and_a_shared_setting_runs_once():
    both = ["recall_choice", "recall_generate"]
    plan = scores.sweeps(["float32", "bfloat16"], ["none", "int8"], "bfloat16", ["float16", "int8"])
    assert [(s["varies"], s["tasks"], [scores.label(x) for x in s["settings"]]) for s in plan] == [
        ("prefill_compute_dtype", both, ["float32/none/float16", "bfloat16/none/float16"]),
        ("kv_codec", ["recall_generate"], ["bfloat16/none/float16", "bfloat16/int8/float16"]),
        # the pool dtype reaches both pods, and the prefill pod scores the loglikelihoods from its own pool's rows
        ("cache_dtype", both, ["float32/none/float16", "float32/none/int8"]),
    ]
    assert plan[2]["settings"][1] == {"prefill_compute_dtype": "float32", "kv_codec": "none", "cache_dtype": "int8"}
    assert set(plan[2]["settings"][1]) <= set(UpConfig.__dataclass_fields__)  # start_cluster's UpConfig takes each
    runs = scores.settings_to_run(plan)
    assert {name: tasks for name, (_, tasks) in runs.items()} == {
        "float32/none/float16": both, "bfloat16/none/float16": both, "bfloat16/int8/float16": ["recall_generate"],
        "float32/none/int8": both}


def test_a_pool_dtype_sweep_alone_runs_the_pods_defaults_with_auto_named_as_this_cpus_prefill_format():
    plan = scores.sweeps([], [], "auto", ["float16", "int8"])
    here = prefill_compute_dtype("auto")
    assert here in ("float32", "bfloat16")
    assert [scores.label(s) for s in plan[0]["settings"]] == [f"{here}/none/float16", f"{here}/none/int8"]
    assert scores.sweeps([], ["none"], "auto", [])[0]["settings"] == [
        {"prefill_compute_dtype": here, "kv_codec": "none", "cache_dtype": "float16"}]
    assert scores.sweeps([], [], "auto", []) == []
