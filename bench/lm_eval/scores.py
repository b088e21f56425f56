"""``bench lm_eval``'s side-by-side mode: lm-eval task scores with their standard errors, one fresh cluster per
setting, for issue 34 (prefill compute format: bf16's score within its standard error of float32's), issue 37
(KV codec: an 8-bit codec within one standard error of lossless, a >= 3.5x one within two) and issue 46 (KV pool
dtype: int8 within one standard error of float16).

Each flag is a sweep whose first value is its reference, run under the other sweeps' references (or the pods'
defaults: ``auto`` prefill format, named as what it is on this CPU; the lossless codec ``none``; float16 pools):
``--prefill-compute-dtype float32 bfloat16`` runs each format on both recall tasks of recall_tasks.py (the
multiple-choice one is scored by the prefill pod alone, the generate one reads the transferred KV from its second
token on); ``--kv-codecs none int8 ...`` runs each codec under ``--codec-prefill-compute-dtype`` on the generate task
only (a loglikelihood request never reads transferred KV); ``--cache-dtypes float16 int8`` gives both pods' pools
each dtype, on both tasks: the prefill pod's attention reads its own pool's rows as they are stored, this chunk's
too (engine/model/attention.py: ``_prefill`` reads a narrower cache back, the native and bf16 prefill attend over
the pool), so the prefill pod's loglikelihoods see the pool dtype, and so do the decode pod's tokens. A setting is
labelled prefill format/codec/pool dtype (``bfloat16/none/int8``); one that two sweeps share runs once. Printed per
sweep, task and setting: score +- lm-eval's standard error, the difference to the reference in the reference's
standard errors, and how many documents went right (+) and wrong (-) against the reference.

The check (unless ``--no-check``), per setting, against an offline engine of the setting's prefill format and pool
dtype: loglikelihoods to the bit (they come from the prefill pod, whatever the codec), and generations in full under
a lossless codec (between int8 pools ``none`` carries the rows as they lie, so the decode pod holds the prefill pod's
rows bit for bit); under a lossy one only each generation's first token (sampled on the prefill pod from its own KV;
every later token reads the codec's KV, so no bitwise answer exists for it).
"""

from __future__ import annotations

import glob
import json
import os
import tempfile
import time
from pathlib import Path

from splitserve.bench.lm_eval.check import compare, logged_samples, run_lm_eval, start_cluster, write_tasks
from splitserve.bench.lm_eval.recall_tasks import FILLER_PATH, KEYS_PER_DOC, build_docs, filler_fingerprint
from splitserve.engine import LLM
from splitserve.engine.kernels.cpu_features import prefill_compute_dtype
from splitserve.engine.text.tokenizer_files import load_tokenizer

LOSSLESS_CODECS = ("none", "none+zstd")
METRICS = {"recall_choice": "acc", "recall_generate": "exact_match"}


# Each sweep: the field it varies, the tasks that can see that field, and the value the other sweeps run under when
# this one is not asked for (the pods' defaults: the router's lossless codec, the engine's float16 pool).
SWEPT = {"prefill_compute_dtype": (("recall_choice", "recall_generate"), "auto"),
         "kv_codec": (("recall_generate",), "none"),
         "cache_dtype": (("recall_choice", "recall_generate"), "float16")}


def sweeps(prefill_dtypes: list[str], kv_codecs: list[str], codec_prefill_dtype: str,
           cache_dtypes: list[str] = ()) -> list[dict]:
    """Each sweep's varied field, its settings (reference first) and the tasks that can see what it varies. A sweep
    runs under the other sweeps' references (or the pods' defaults); the codec sweep under ``codec_prefill_dtype``."""
    values = {"prefill_compute_dtype": list(prefill_dtypes), "kv_codec": list(kv_codecs),
              "cache_dtype": list(cache_dtypes)}
    base = {name: values[name][0] if values[name] else default for name, (_, default) in SWEPT.items()}
    result = []
    for name, (tasks, _) in SWEPT.items():
        if not values[name]:
            continue
        under = {**base, "prefill_compute_dtype": codec_prefill_dtype} if name == "kv_codec" else base
        settings = [{**under, name: value} for value in values[name]]
        for setting in settings:  # "auto" named as what it is on this CPU, where the pods run (labels, offline engine)
            setting["prefill_compute_dtype"] = prefill_compute_dtype(setting["prefill_compute_dtype"])
        result.append({"varies": name, "tasks": list(tasks), "settings": settings})
    return result


def label(setting: dict) -> str:
    """prefill format/codec/pool dtype, e.g. ``bfloat16/none/int8``."""
    return f"{setting['prefill_compute_dtype']}/{setting['kv_codec']}/{setting['cache_dtype']}"


def settings_to_run(plan: list[dict]) -> dict[str, tuple[dict, list[str]]]:
    """Each distinct setting of the sweeps once, by label, with the tasks any of its sweeps scores."""
    needs: dict[str, tuple[dict, set]] = {}
    for sweep in plan:
        for setting in sweep["settings"]:
            needs.setdefault(label(setting), (setting, set()))[1].update(sweep["tasks"])
    return {name: (setting, sorted(tasks)) for name, (setting, tasks) in needs.items()}


def task_scores(out_dir: Path, task: str) -> dict:
    """lm-eval's score and standard error of ``task``, and each document's own score (by doc_id)."""
    metric = METRICS[task]
    paths = glob.glob(str(out_dir / "**" / "results_*.json"), recursive=True)
    if len(paths) != 1:
        raise SystemExit(f"expected one results file under {out_dir}, found {paths}")
    figures = json.loads(Path(paths[0]).read_text())["results"][task]
    return {"score": figures[f"{metric},none"], "stderr": figures[f"{metric}_stderr,none"],
            "per_doc": {s["doc_id"]: s[metric] for s in logged_samples(out_dir, task)}}


def run_setting(work: Path, args, setting: dict, tasks: list[str]) -> dict:
    """One fresh cluster of ``setting``, lm-eval on ``tasks``; the scores and the seconds lm-eval took."""
    cluster = start_cluster(work / label(setting).replace("/", "-") / "cluster", args.model, **setting)
    out_dir = work / label(setting).replace("/", "-") / "out"
    try:
        started = time.perf_counter()
        run_lm_eval(args.lm_eval_python, f"http://{cluster.config.host}:{cluster.config.http_port}", args.model,
                    tasks, work / "tasks", out_dir)
        seconds = time.perf_counter() - started
    finally:
        cluster.stop()
    return {"out_dir": out_dir, "seconds": round(seconds, 1), "tasks": {t: task_scores(out_dir, t) for t in tasks}}


def against_reference(reference: dict, scored: dict) -> dict:
    """The difference in the reference's standard errors (None where that is 0) and the documents that changed."""
    stderr = reference["stderr"]
    difference = scored["score"] - reference["score"]
    pairs = [(reference["per_doc"][d], scored["per_doc"][d]) for d in reference["per_doc"]]
    return {"difference": round(difference, 4),
            "in_reference_stderr": round(difference / stderr, 2) if stderr else None,
            "docs_gained": sum(s > r for r, s in pairs), "docs_lost": sum(s < r for r, s in pairs)}


def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    return f"{model}, {len(os.sched_getaffinity(0))} CPUs in this process's affinity"


def run(args) -> dict:
    text = FILLER_PATH.read_text()  # read once: the docs may be edited while this runs
    filler = filler_fingerprint(text)
    docs = build_docs(load_tokenizer(args.model), max(args.docs, args.choice_docs), args.seed, text)
    plan = sweeps(args.prefill_compute_dtype, args.kv_codecs, args.codec_prefill_compute_dtype, args.cache_dtypes)
    runs, differences, checked, offline = {}, [], {}, {}
    with tempfile.TemporaryDirectory(prefix="lm-eval-scores-") as work:
        work = Path(work)
        (work / "tasks").mkdir()
        write_tasks(work / "tasks", docs[:args.choice_docs], docs[:args.docs], prefix="recall")
        for name, (setting, tasks) in settings_to_run(plan).items():
            runs[name] = run_setting(work, args, setting, tasks)
            print(f"{name}: " + ", ".join(f"{t} {s['score']:.3f} +- {s['stderr']:.3f}"
                                          for t, s in runs[name]["tasks"].items()) + f" ({runs[name]['seconds']} s)",
                  flush=True)
            if args.no_check:
                continue
            formats = (setting["prefill_compute_dtype"], setting["cache_dtype"])
            if formats not in offline:
                offline[formats] = (LLM(model=args.model, kv_cache_memory_bytes=256 << 20,
                                        prefill_compute_dtype=formats[0], cache_dtype=formats[1]), {})
            llm, memo = offline[formats]
            result = compare(llm, runs[name]["out_dir"], tuple(tasks),
                             exact_generation=setting["kv_codec"] in LOSSLESS_CODECS, memo=memo)
            checked[name] = {"loglikelihood": result["loglikelihood"], "generate_until": result["generate_until"],
                             "generations": "exact" if setting["kv_codec"] in LOSSLESS_CODECS else "first token",
                             "differences": len(result["differences"])}
            differences += [{"setting": name, **d} for d in result["differences"]]
    tables = []
    for sweep in plan:
        reference = label(sweep["settings"][0])
        for task in sweep["tasks"]:
            rows = []
            for setting in sweep["settings"]:
                scored = runs[label(setting)]["tasks"][task]
                rows.append({"setting": label(setting), "score": round(scored["score"], 4),
                             "stderr": round(scored["stderr"], 4), "seconds": runs[label(setting)]["seconds"],
                             **against_reference(runs[reference]["tasks"][task], scored)})
            tables.append({"varies": sweep["varies"], "task": task, "reference": reference,
                           "docs": len(runs[reference]["tasks"][task]["per_doc"]), "rows": rows})
    print_tables(tables)
    return {"model": args.model, "seed": args.seed, "keys_per_doc": KEYS_PER_DOC,
            "filler": f"{FILLER_PATH.name} sha256:{filler}",
            "cpu": cpu_line(), "tables": tables, "checked": checked, "differences": differences[:20],
            "difference_count": len(differences)}


def print_tables(tables: list[dict]) -> None:
    for table in tables:
        print(f"\n{table['task']} ({table['docs']} docs), {table['varies']} against {table['reference']}:")
        print(f"{'setting':<28}{'score +- stderr':>18}{'diff':>9}{'in ref SE':>11}{'+docs':>7}{'-docs':>7}"
              f"{'seconds':>9}")
        for row in table["rows"]:
            in_se = "n/a" if row["in_reference_stderr"] is None else f"{row['in_reference_stderr']:+.2f}"
            print(f"{row['setting']:<28}{row['score']:>10.3f} +- {row['stderr']:.3f}{row['difference']:>+9.3f}"
                  f"{in_se:>11}{row['docs_gained']:>7}{row['docs_lost']:>7}{row['seconds']:>9}")
