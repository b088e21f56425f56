"""lm-eval against the router, checked request by request against the offline engine.

    splitserve bench lm_eval [--model tiny-random] [--lm-eval-python PATH] [--json out.json]

lm-eval (the ``eval`` extra: ``pip install '.[eval]'``, or any Python that has ``lm_eval``, ``--lm-eval-python``)
runs its ``local-completions`` model against a ``splitserve up`` cluster (a prefill pod and a decode pod; every
prompt prefilled on P) on two tasks built from local files (no hub here): a multiple-choice task (loglikelihood
requests: ``echo``, ``logprobs: 1``, ``max_tokens: 1``) and a ``generate_until`` task (greedy, stopping at a
newline). lm-eval tokenizes through the router (``/tokenizer_info``, ``/tokenize``: its remote tokenizer) and logs
every request's answer (``--log_samples``). Each answer is then computed by the offline engine the way lm-eval
asked for it (the context's and the continuation's tokens as lm-eval splits them; the generation's prompt tokens
and stop strings) and must be equal: the loglikelihood to the bit (the same float32 logprobs, summed in the same
order), its is-greedy flag, and the generated text. Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.text.tokenizer import Tokenizer

CHOICE_DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " a small fish"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " five", " twenty two"], "answer": 0},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Fahrenheit"], "answer": 0},
    {"question": "The opposite of hot is ", "choices": ["cold", "warm"], "answer": 0},  # a trailing space moves
]
GENERATE_DOCS = [
    {"question": "Q: What colour is the sky?\nA:", "answer": " blue"},
    {"question": "Q: Name a fruit.\nA:", "answer": " apple"},
    {"question": "List three animals:", "answer": " cat"},
]
MAX_GEN_TOKS = 12
SEED = 1234  # what lm-eval's local-completions sends


def write_tasks(directory: Path) -> list[str]:
    """Two lm-eval task YAMLs reading JSON-lines files beside them; returns the task names."""
    for name, docs in (("choice", CHOICE_DOCS), ("generate", GENERATE_DOCS)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: \"{{question}}\"\n"
    (directory / "splitserve_choice.yaml").write_text(
        f"task: splitserve_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    (directory / "splitserve_generate.yaml").write_text(
        f"task: splitserve_generate\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'generate.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: answer\n"
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "  temperature: 0\nmetric_list:\n  - metric: exact_match\n")
    return ["splitserve_choice", "splitserve_generate"]


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


def offline_generation(llm: LLM, context: str, until: list[str]) -> str:
    prompt = llm.tokenizer.encode(context, add_special_tokens=False)
    return llm.generate(prompt, SamplingParams(max_tokens=MAX_GEN_TOKS, temperature=0.0, stop=until, seed=SEED))[0].text


def compare(llm: LLM, out_dir: Path) -> dict:
    """Every logged request against the offline engine; the differences, if any."""
    results = {"loglikelihood": 0, "generate_until": 0, "differences": []}
    for sample in logged_samples(out_dir, "splitserve_choice"):
        for arguments, response in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            served = (float(response[0][0]), response[0][1] in (True, "True"))
            expected = offline_loglikelihood(llm, context, continuation)
            results["loglikelihood"] += 1
            if served != expected:
                results["differences"].append({"context": context, "continuation": continuation,
                                               "router": served, "offline": expected})
    for sample in logged_samples(out_dir, "splitserve_generate"):
        arguments = sample["arguments"]["gen_args_0"]
        context, until = arguments["arg_0"], arguments["arg_1"]["until"]
        served, expected = sample["resps"][0][0], offline_generation(llm, context, until)
        results["generate_until"] += 1
        if served != expected:
            results["differences"].append({"context": context, "router": served, "offline": expected})
    return results


def main(argv: list[str] | None = None) -> None:
    from splitserve.launcher import Cluster
    from splitserve.up_config import UpConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--lm-eval-python", default=sys.executable,
                        help="a Python with lm_eval installed (default: this one, with the eval extra)")
    parser.add_argument("--json", help="write the comparison here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as work:
        work = Path(work)
        (work / "tasks").mkdir()
        tasks = write_tasks(work / "tasks")
        cluster = Cluster(UpConfig.on_ports(run_dir=str(work / "cluster"), model=args.model, prefill=1, decode=1,
                                            kv_codec="none", scheduling="disaggregated",
                                            conditional_prefill_threshold=0,
                                            kv_cache_memory_bytes=64 << 20, prometheus=False))
        try:
            cluster.start()
            cluster.wait_ready(log=lambda *_: None)
            started = time.perf_counter()
            run_lm_eval(args.lm_eval_python, f"http://{cluster.config.host}:{cluster.config.http_port}",
                        args.model, tasks, work / "tasks", work / "out")
            seconds = time.perf_counter() - started
        finally:
            cluster.stop()
        results = {"model": args.model, "lm_eval_seconds": round(seconds, 1),
                   **compare(LLM(model=args.model, kv_cache_memory_bytes=64 << 20), work / "out")}
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if results["differences"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
