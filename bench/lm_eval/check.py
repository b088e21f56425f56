"""The exact check of ``bench lm_eval``: lm-eval's task files written from documents, lm-eval run against a cluster,
and each logged answer recomputed by the offline engine the way lm-eval asked for it (bench/lm_eval/__init__.py
says what must be equal)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.text.tokenizer import Tokenizer

CHOICE_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a small fish"], "gold": 0},
    {"question": "Two plus two equals", "choices": [" four", " five", " twenty two"], "gold": 0},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Fahrenheit"], "gold": 0},
    {"question": "The opposite of hot is ", "choices": ["cold", "warm"], "gold": 0},  # a trailing space moves
]
GENERATE_DOCS = [
    {"question": "Q: What colour is the sky?\nA:", "answer": " blue"},
    {"question": "Q: Name a fruit.\nA:", "answer": " apple"},
    {"question": "List three animals:", "answer": " cat"},
]
MAX_GEN_TOKS = 12
UNTIL = ["\n", "."]
SEED = 1234  # what lm-eval's local-completions sends


def write_tasks(directory: Path, choice_docs: list[dict], generate_docs: list[dict],
                prefix: str = "splitserve") -> list[str]:
    """Two lm-eval task YAMLs reading JSON-lines files beside them ({prefix}_choice: the docs' question, choices and
    gold, lm-eval putting a space between question and choice; {prefix}_generate: question and answer, exact
    match ignoring spaces); returns the task names."""
    names = [f"{prefix}_choice", f"{prefix}_generate"]
    for name, docs in zip(names, (choice_docs, generate_docs)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{question}}\"\n"
    (directory / f"{names[0]}.yaml").write_text(
        f"task: {names[0]}\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / (names[0] + '.jsonl')}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: gold\nmetric_list:\n"
        "  - metric: acc\n")
    (directory / f"{names[1]}.yaml").write_text(
        f"task: {names[1]}\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / (names[1] + '.jsonl')}\n"
        "output_type: generate_until\ndoc_to_target: answer\n"
        f"generation_kwargs:\n  until: {json.dumps(UNTIL)}\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n    regexes_to_ignore: [\" \"]\n")
    return names


def run_lm_eval(python: str, base_url: str, model: str, tasks: list[str], task_dir: Path, out_dir: Path) -> None:
    model_args = (f"base_url={base_url}/v1/completions,model={model},tokenizer_backend=remote,"
                  "tokenized_requests=True,num_concurrent=1,max_retries=1")
    command = [python, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
               "--include_path", str(task_dir), "--tasks", ",".join(tasks), "--batch_size", "1",
               "--log_samples", "--output_path", str(out_dir)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(command, check=True, env=env)


def logged_samples(out_dir: Path, task: str) -> list[dict]:
    paths = glob.glob(str(out_dir / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    if len(paths) != 1:
        raise SystemExit(f"expected one samples file of {task} under {out_dir}, found {paths}")
    return [json.loads(line) for line in Path(paths[0]).read_text().splitlines()]


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a loglikelihood request (``TemplateLM._encode_pair``): the context's trailing spaces move to
    the continuation, the whole is tokenized, and the continuation is what follows the context's tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


def offline_loglikelihood(llm: LLM, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation's logprob given the context, and whether greedy decoding would produce it."""
    context_ids, continuation_ids = encode_pair(llm.tokenizer, context, continuation)
    scored = llm.generate(context_ids + continuation_ids,
                          SamplingParams(max_tokens=0, prompt_logprobs=1, temperature=0.0))[0]
    entries = scored.prompt_logprobs[len(context_ids):]
    return sum(entry.logprob for entry in entries), all(entry.rank == 1 for entry in entries)


def offline_generation(llm: LLM, context: str, until: list[str], max_tokens: int = MAX_GEN_TOKS) -> str:
    prompt = llm.tokenizer.encode(context, add_special_tokens=False)
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=until, seed=SEED))[0].text


def compare(llm: LLM, out_dir: Path, tasks: tuple[str, ...] = ("splitserve_choice", "splitserve_generate"),
            exact_generation: bool = True, memo: dict | None = None) -> dict:
    """Every logged request of ``tasks`` (a ``*_choice`` one: loglikelihoods; a ``*_generate`` one: generations)
    against the offline engine; the differences, if any. ``exact_generation`` False (a lossy KV codec: the decode pod
    reads KV the prefill pod did not compute) checks only a generation's first token, sampled on the prefill pod
    from its own KV. ``memo``: offline answers kept across calls with the same ``llm``."""
    memo = {} if memo is None else memo
    results = {"loglikelihood": 0, "generate_until": 0, "differences": []}
    for task in tasks:
        for sample in logged_samples(out_dir, task) if task.endswith("_choice") else ():
            for arguments, response in zip(sample["arguments"].values(), sample["resps"]):
                context, continuation = arguments["arg_0"], arguments["arg_1"]
                served = (float(response[0][0]), response[0][1] in (True, "True"))
                key = ("loglikelihood", context, continuation)
                if key not in memo:
                    memo[key] = offline_loglikelihood(llm, context, continuation)
                expected = memo[key]
                results["loglikelihood"] += 1
                if served != expected:
                    results["differences"].append({"context": context, "continuation": continuation,
                                                   "router": served, "offline": expected})
        for sample in logged_samples(out_dir, task) if task.endswith("_generate") else ():
            arguments = sample["arguments"]["gen_args_0"]
            context, until = arguments["arg_0"], arguments["arg_1"]["until"]
            max_tokens = MAX_GEN_TOKS if exact_generation else 1
            key = ("generate", context, tuple(until), max_tokens)
            if key not in memo:
                memo[key] = offline_generation(llm, context, until, max_tokens)
            served, expected = sample["resps"][0][0], memo[key]
            results["generate_until"] += 1
            if served != expected if exact_generation else not served.startswith(expected):
                results["differences"].append({"context": context, "router": served, "offline": expected})
    return results


def start_cluster(work: Path, model: str, **settings):
    """A fresh ``splitserve up``: one prefill and one decode pod, every prompt prefilled on P (the pure split),
    with ``settings`` (UpConfig's fields: kv_codec, prefill_compute_dtype, cache_dtype)."""
    from splitserve.launcher import Cluster
    from splitserve.up_config import UpConfig

    cluster = Cluster(UpConfig.on_ports(run_dir=str(work), model=model, prefill=1, decode=1,
                                        scheduling="disaggregated", conditional_prefill_threshold=0,
                                        kv_cache_memory_bytes=256 << 20, prometheus=False, **settings))
    cluster.start()
    try:
        cluster.wait_ready(log=lambda *_: None)
    except BaseException:
        cluster.stop()
        raise
    return cluster
