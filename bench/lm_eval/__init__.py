"""lm-eval against the router: each answer checked against the offline engine, and scores side by side per setting.

    splitserve bench lm_eval [--model tiny-random] [--lm-eval-python PATH] [--json out.json]
    splitserve bench lm_eval --model smollm2-135m --prefill-compute-dtype float32 bfloat16 \\
        --kv-codecs none int8 kivi8 int4 kivi4 [--codec-prefill-compute-dtype bfloat16] [--docs 60] [--no-check]
    splitserve bench lm_eval --model smollm2-135m --cache-dtypes float16 int8 [--docs 60] [--choice-docs 15]

lm-eval (the ``eval`` extra: ``pip install '.[eval]'``, or any Python that has ``lm_eval``, ``--lm-eval-python``)
runs its ``local-completions`` model against a ``splitserve up`` cluster (a prefill pod and a decode pod; every
prompt prefilled on P) on tasks built from local files (no hub here): a multiple-choice task (loglikelihood
requests: ``echo``, ``logprobs: 1``, ``max_tokens: 1``) and a ``generate_until`` task (greedy, stopping at a
newline or a full stop). lm-eval tokenizes through the router (``/tokenizer_info``, ``/tokenize``: its remote
tokenizer) and logs every request's answer (``--log_samples``). Each answer is then computed by the offline engine
the way lm-eval asked for it (the context's and the continuation's tokens as lm-eval splits them; the generation's
prompt tokens and stop strings) and must be equal: the loglikelihood to the bit (the same logprobs, summed in the
same order), its is-greedy flag, and the generated text. Exits 1 on any difference.

- ``check.py``: the task files, the lm-eval run, the offline answers and the comparison;
- ``scores.py``: with ``--prefill-compute-dtype``, ``--kv-codecs`` and/or ``--cache-dtypes`` (the KV pool dtype of
  both pods), settings scored side by side (a fresh cluster each; score +- standard error per task and setting, the
  difference to the reference in its standard errors) on ``recall_tasks.py``'s long-context recall documents.
  Without those flags the tasks are a few short hand-written questions and the pods run at their defaults with the
  lossless codec.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from splitserve.bench.lm_eval import scores
from splitserve.bench.lm_eval.check import CHOICE_DOCS, GENERATE_DOCS, compare, run_lm_eval, start_cluster, write_tasks
from splitserve.engine import LLM


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--lm-eval-python", default=sys.executable,
                        help="a Python with lm_eval installed (default: this one, with the eval extra)")
    parser.add_argument("--json", help="write the comparison here")
    parser.add_argument("--prefill-compute-dtype", nargs="+", default=[],
                        help="score these prefill formats side by side (the first is the reference)")
    parser.add_argument("--kv-codecs", nargs="+", default=[],
                        help="score these KV codecs side by side (the first is the reference)")
    parser.add_argument("--cache-dtypes", nargs="+", default=[],
                        help="score these KV pool dtypes side by side, both pods' pools in each (the first is the "
                             "reference)")
    parser.add_argument("--codec-prefill-compute-dtype", default="auto",
                        help="the prefill format the --kv-codecs sweep runs under")
    parser.add_argument("--docs", type=int, default=100, help="documents of the recall generate task")
    parser.add_argument("--choice-docs", type=int, default=30,
                        help="documents of the recall multiple-choice task (one prefill per key: 6 per document)")
    parser.add_argument("--seed", type=int, default=0, help="the recall documents' seed (side-by-side scores)")
    parser.add_argument("--no-check", action="store_true",
                        help="side-by-side scores without the offline engine's check (half the time)")
    args = parser.parse_args(argv)
    if args.prefill_compute_dtype or args.kv_codecs or args.cache_dtypes:
        results = scores.run(args)
    else:
        results = check_short_tasks(args.model, args.lm_eval_python)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if results["differences"]:
        sys.exit(1)


def check_short_tasks(model: str, lm_eval_python: str) -> dict:
    """The exact check on the short hand-written tasks, the pods at their defaults and the lossless codec."""
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as work:
        work = Path(work)
        (work / "tasks").mkdir()
        tasks = write_tasks(work / "tasks", CHOICE_DOCS, GENERATE_DOCS)
        cluster = start_cluster(work / "cluster", model, kv_codec="none")
        try:
            started = time.perf_counter()
            run_lm_eval(lm_eval_python, f"http://{cluster.config.host}:{cluster.config.http_port}", model, tasks,
                        work / "tasks", work / "out")
            seconds = time.perf_counter() - started
        finally:
            cluster.stop()
        return {"model": model, "lm_eval_seconds": round(seconds, 1),
                **compare(LLM(model=model, kv_cache_memory_bytes=64 << 20), work / "out")}


if __name__ == "__main__":
    main()
