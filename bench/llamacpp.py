"""``splitserve bench llamacpp``: splitserve's engine beside llama.cpp, the CPU peer, on the same GGUF file.

llama.cpp comes from ``llama-cpp-python``, an optional extra built from its source distribution (cmake compiles
llama.cpp: minutes): ``pip install --no-binary llama-cpp-python '.[llamacpp]'``. Without it the llama.cpp column
says absent and splitserve's figures still print.

For each thread count (``--threads 1,2``) and each of ``--repeats`` rounds, one process per side and setting, each
pinned with ``taskset`` to the same CPUs (the first ``threads`` of ``--cpus``) and given the same thread count:

  llama.cpp    the GGUF file through llama.cpp's C API (one ``llama_batch`` per step, greedy argmax): ms per token
               decoding one sequence, and tokens/s with ``--parallel`` sequences decoding together
  splitserve   ``LLM(model, quantization=Q)`` for each weight format the engine names
               (``splitserve.engine.config.QUANTIZATIONS``; a format the engine refuses for this model is reported
               with its reason), the same prompts, measured the same way (decode steps only: the prompt's prefill is
               not counted); and for each format of ``--int8-activations`` also ``LLM(model, quantization=Q,
               int8_activations=True)`` ("Q int8-act")

Each decodes ``--max-tokens`` greedy tokens per sequence, past EOS. Then prompt lookup (issue 22), at one thread:
the input-grounded prompts of ``bench spec`` at batch 1, each side with and without its own prompt-lookup decoding
(llama-cpp-python's ``LlamaPromptLookupDecoding`` draft model; splitserve's ``ngram`` speculation), both proposing
up to ``--num-speculative-tokens`` tokens, stopping at EOS: decode tokens/s.

The table gives the median over the rounds with [min-max], and each splitserve figure over llama.cpp's ("x
llama.cpp": for ms/token below 1 is faster, for tokens/s above 1 is). A shared machine moves the figures; the
"fastest step" column (each round's quickest batch-1 decode step, measured alike on both sides) is the figure that
other processes' time slices inflate least.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.bench.spec import BatchRun, grounded_prompts, open_ended_prompts
from splitserve.engine.config import DEFAULT_MODEL, QUANTIZATIONS, SpeculativeConfig
from splitserve.engine.text.tokenizer_files import resolve_model_name
from splitserve.measure.figures import save_results
from splitserve.runtime.config import described, parse_config
from splitserve.runtime.cpus import allowed_cpus

REPO = Path(__file__).resolve().parents[1]
ABSENT = "absent"


# ---- the two sides, each run in its own pinned process (``worker``) ----------------------------------------------

def splitserve_decode(job: dict) -> dict:
    """ms per token at batch 1 (mean, and the fastest step) and tokens/s with ``parallel`` sequences, through
    splitserve's engine."""
    llm = _splitserve_engine(job, speculative=None)
    prompts = open_ended_prompts(job["parallel"])
    figures, steps = {}, []
    for key, batch in (("batch1_ms", prompts[:1]), ("parallel_tok_s", prompts)):
        run = BatchRun(llm, batch, job["max_tokens"], key, ignore_eos=True)
        while not run.finished:
            start = time.perf_counter()
            run.step()
            if key == "batch1_ms" and run.engine.last_step.num_prefill_tokens == 0:
                steps.append(time.perf_counter() - start)
        tok_s = run.figures()["tok_s"]
        figures[key] = 1e3 / tok_s if key == "batch1_ms" else tok_s
    return {**figures, "batch1_best_ms": 1e3 * min(steps)}


def splitserve_lookup(job: dict) -> dict:
    """Decode tokens/s over the input-grounded prompts at batch 1, with ngram speculation or without."""
    speculative = {"method": "ngram", "num_speculative_tokens": job["k"]} if job["lookup"] else None
    llm = _splitserve_engine(job, speculative)
    seconds, tokens = 0.0, 0
    for i, prompt in enumerate(grounded_prompts(job["prompts"])):
        run = BatchRun(llm, [prompt], job["max_tokens"], f"lookup-{i}")
        while not run.finished:
            run.step()
        seconds, tokens = seconds + run.decode_seconds, tokens + run.decode_tokens
    return {"tok_s": tokens / seconds, "tokens": tokens}


def _splitserve_engine(job: dict, speculative: dict | None):
    from splitserve.engine import LLM
    from splitserve.runtime.torch_threads import apply_cpu_set

    apply_cpu_set("", job["threads"])  # taskset pinned the process; this sizes torch and the native kernels
    return LLM(model=job["model"], quantization=job["quantization"], max_num_seqs=max(8, job.get("parallel", 1)),
               kv_cache_memory_bytes=256 << 20, speculative_config=speculative,
               int8_activations=job.get("int8_activations", False))


def llamacpp_decode(job: dict) -> dict:
    """The same two figures through llama.cpp's C API: every running sequence's next token in one batch."""
    import llama_cpp as lc
    import numpy as np

    prompts = open_ended_prompts(job["parallel"])
    model, ctx, vocab, batch = _llamacpp_context(job, prompts)
    n_vocab = lc.llama_vocab_n_tokens(vocab)

    def step(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode (token, position, sequence, wants logits) entries; the argmax of each row that wants logits."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                for i, entry in enumerate(entries) if entry[3]]

    def decode(ids: list[list[int]]) -> tuple[float, float]:
        """Seconds per decode step (all sequences' tokens in one batch) after the prompts' prefill: the mean, and
        the fastest step."""
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        nexts = step([(t, pos, s, pos == len(p) - 1) for s, p in enumerate(ids) for pos, t in enumerate(p)])
        times = []
        for k in range(job["max_tokens"] - 1):
            start = time.perf_counter()
            nexts = step([(nexts[s], len(p) + k, s, True) for s, p in enumerate(ids)])
            times.append(time.perf_counter() - start)
        return sum(times) / len(times), min(times)

    try:
        ids = [_llamacpp_tokens(vocab, p) for p in prompts]
        one, best = decode(ids[:1])
        together, _ = decode(ids)
        return {"batch1_ms": one * 1e3, "batch1_best_ms": best * 1e3, "parallel_tok_s": len(ids) / together}
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)


def _llamacpp_context(job: dict, prompts: list[str]):
    import llama_cpp as lc

    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(job["model_path"].encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {job['model_path']}")
    vocab = lc.llama_model_get_vocab(model)
    longest = max(len(_llamacpp_tokens(vocab, p)) for p in prompts)
    params = lc.llama_context_default_params()
    # One KV cache the sequences share (as llama-server's parallel slots do): a step's tokens of every sequence then
    # go through the model together, where separate per-sequence caches split the batch by sequence.
    params.n_seq_max, params.kv_unified = len(prompts), True
    params.n_ctx = len(prompts) * (longest + job["max_tokens"] + 32)
    params.n_batch = params.n_ubatch = max(512, len(prompts) * longest)
    params.n_threads = params.n_threads_batch = job["threads"]
    ctx = lc.llama_init_from_model(model, params)
    return model, ctx, vocab, lc.llama_batch_init(params.n_batch, 0, 1)


def _llamacpp_tokens(vocab, text: str) -> list[int]:
    import llama_cpp as lc

    data = text.encode()
    buffer = (lc.llama_token * (len(data) + 8))()
    count = lc.llama_tokenize(vocab, data, len(data), buffer, len(buffer), True, True)
    return list(buffer[:count])


def llamacpp_lookup(job: dict) -> dict:
    """Decode tokens/s over the input-grounded prompts at batch 1 through llama-cpp-python's ``Llama.generate``,
    with its prompt-lookup draft model or without."""
    import llama_cpp as lc
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = (LlamaPromptLookupDecoding(max_ngram_size=SpeculativeConfig.prompt_lookup_max,
                                       num_pred_tokens=job["k"]) if job["lookup"] else None)
    # A draft model needs every position's logits; llama-cpp-python sizes its logits buffer for that only when told
    # logits_all as well (else a verification overflows it).
    llm = lc.Llama(model_path=job["model_path"], n_ctx=4096, n_batch=512, n_threads=job["threads"],
                   n_threads_batch=job["threads"], draft_model=draft, logits_all=draft is not None, verbose=False)
    vocab = lc.llama_model_get_vocab(llm._model.model)
    seconds, tokens = 0.0, 0
    for prompt in grounded_prompts(job["prompts"]):
        made, start = 0, 0.0
        for token in llm.generate(llm.tokenize(prompt.encode(), special=True), temp=0.0, reset=True):
            made += 1
            if made == 1:
                start = time.perf_counter()  # the first token came with the prompt's prefill
            if made == job["max_tokens"] or lc.llama_vocab_is_eog(vocab, token):
                break
        seconds, tokens = seconds + time.perf_counter() - start, tokens + made - 1
    return {"tok_s": tokens / seconds, "tokens": tokens}


TASKS = {("splitserve", "decode"): splitserve_decode, ("splitserve", "lookup"): splitserve_lookup,
         ("llamacpp", "decode"): llamacpp_decode, ("llamacpp", "lookup"): llamacpp_lookup}


def worker() -> None:
    """A pinned process's entry: one job (JSON on stdin), its figures (JSON, the last line of stdout)."""
    job = json.load(sys.stdin)
    try:
        result = TASKS[job["side"], job["task"]](job)
    except Exception as exc:  # noqa: BLE001 - reported by the parent, beside the other side's figures
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)


# ---- the parent: pinned processes in turn, then the table ----------------------------------------------------------

def llamacpp_absence() -> str | None:
    """None when llama-cpp-python is installed, else what the llama.cpp column says and how to get it."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (f"{ABSENT}: llama-cpp-python is not installed (pip install --no-binary llama-cpp-python "
                "'.[llamacpp]' builds it from source with cmake)")
    return None


def run_pinned(job: dict, cpus: list[int]) -> dict:
    """``job`` in a new process pinned to ``cpus`` with ``job['threads']`` threads; its figures or its error."""
    threads = str(job["threads"])
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", "import splitserve.bench.llamacpp as bench; bench.worker()"]
    if shutil.which("taskset"):
        command = ["taskset", "-c", ",".join(map(str, cpus)), *command]
    done = subprocess.run(command, input=json.dumps(job), capture_output=True, text=True, env=env, cwd=REPO)
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}


def run(config: "LlamaCppBenchConfig", log=print) -> dict:
    kind, path = resolve_model_name(config.model)
    peer = llamacpp_absence() or (None if kind == "gguf" else f"n/a: {config.model} is not a GGUF file")
    log(f"llama.cpp: {peer or _llamacpp_version()}; model {path or config.model}")
    common = {"model": config.model, "model_path": str(path), "max_tokens": config.max_tokens}
    results: dict = {"model": config.model, "max_tokens": config.max_tokens, "parallel": config.parallel,
                     "repeats": config.repeats, "cpus": config.cpus, "llamacpp": peer or _llamacpp_version(),
                     "decode": [], "lookup": [], "refused": {}}
    sides = ([] if peer else [("llama.cpp", {"side": "llamacpp"})]) + [
        (f"splitserve {q}", {"side": "splitserve", "quantization": q}) for q in config.quantizations] + [
        (f"splitserve {q} int8-act", {"side": "splitserve", "quantization": q, "int8_activations": True})
        for q in config.int8_activations]
    for threads in config.threads:
        cpus = config.cpus[:threads]
        rounds: dict[str, list[dict]] = {name: [] for name, _ in sides}
        for r in range(config.repeats):
            for name, side in sides:
                if name in results["refused"]:
                    continue
                log(f"decode, {threads} thread(s) on CPU {cpus}, round {r + 1}/{config.repeats}: {name} ...")
                figures = run_pinned({**common, **side, "task": "decode", "threads": threads,
                                      "parallel": config.parallel}, cpus)
                if "error" in figures:
                    log(f"  {name}: {figures['error']}")
                    results["refused"][name] = figures["error"]
                else:
                    log(f"  {figures['batch1_ms']:.1f} ms/token at batch 1 (fastest step "
                        f"{figures['batch1_best_ms']:.2f}), {figures['parallel_tok_s']:.1f} tokens/s "
                        f"with {config.parallel} sequences")
                    rounds[name].append(figures)
        for name, figures in rounds.items():
            if figures:
                results["decode"].append({"side": name, "threads": threads,
                                          **{key: _spread([f[key] for f in figures])
                                             for key in ("batch1_ms", "batch1_best_ms", "parallel_tok_s")}})
    if config.lookup_prompts:
        results["lookup"] = _run_lookup(config, common, peer, log)
    return results


def _run_lookup(config: "LlamaCppBenchConfig", common: dict, peer: str | None, log) -> list[dict]:
    cpus, rows = config.cpus[:1], []
    sides = ([] if peer else ["llamacpp"]) + ["splitserve"]
    for side in sides:
        by_lookup: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(config.repeats):
            for lookup in (False, True):
                log(f"prompt lookup {'on' if lookup else 'off'}, 1 thread, round {r + 1}/{config.repeats}: {side} ...")
                figures = run_pinned({**common, "side": side, "task": "lookup", "threads": 1,
                                      "quantization": config.lookup_quantization,
                                      "prompts": config.lookup_prompts, "k": config.num_speculative_tokens,
                                      "lookup": lookup}, cpus)
                if "error" in figures:
                    raise RuntimeError(f"{side}, prompt lookup {'on' if lookup else 'off'}: {figures['error']}")
                log(f"  {figures['tok_s']:.1f} tokens/s ({figures['tokens']} tokens)")
                by_lookup[lookup].append(figures)
        rows.append({"side": "llama.cpp" if side == "llamacpp" else "splitserve ngram",
                     "off_tok_s": _spread([f["tok_s"] for f in by_lookup[False]]),
                     "on_tok_s": _spread([f["tok_s"] for f in by_lookup[True]]),
                     "speedup": _spread([on["tok_s"] / off["tok_s"]
                                         for off, on in zip(by_lookup[False], by_lookup[True])])})
    return rows


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _llamacpp_version() -> str:
    from importlib import metadata

    return f"llama-cpp-python {metadata.version('llama-cpp-python')}"


def report(results: dict, log=print) -> None:
    log(f"\n== {results['model']}: decode, {results['max_tokens']} greedy tokens per sequence; median [min-max] of "
        f"{results['repeats']} round(s); each side its own process on the same CPUs; llama.cpp: "
        f"{results['llamacpp']} ==")
    log(f"{'side':<25} {'threads':>7} {'batch-1 ms/token':>24} {'x llama.cpp':>11} {'fastest step, ms':>22} "
        f"{'x llama.cpp':>11} {'tok/s, ' + str(results['parallel']) + ' sequences':>26} {'x llama.cpp':>11}")
    peer = {row["threads"]: row for row in results["decode"] if row["side"] == "llama.cpp"}
    for row in results["decode"]:
        theirs = peer.get(row["threads"])
        ratios = {key: f"{row[key]['median'] / theirs[key]['median']:.2f}x" if theirs and key in theirs else ABSENT
                  for key in ("batch1_ms", "batch1_best_ms", "parallel_tok_s")}
        best = _format(row["batch1_best_ms"], 2) if "batch1_best_ms" in row else ABSENT
        log(f"{row['side']:<25} {row['threads']:>7} {_format(row['batch1_ms']):>24} {ratios['batch1_ms']:>11} "
            f"{best:>22} {ratios['batch1_best_ms']:>11} {_format(row['parallel_tok_s']):>26} "
            f"{ratios['parallel_tok_s']:>11}")
    if not peer:
        log(f"{'llama.cpp':<22} {'':>7} {results['llamacpp']}")
    for name, reason in results["refused"].items():
        log(f"{name}: not measured: {reason}")
    if results["lookup"]:
        log("\n== prompt lookup, input-grounded prompts of bench spec, batch 1, 1 thread: decode tokens/s ==")
        log(f"{'side':<22} {'without':>22} {'with lookup':>22} {'speedup':>22}")
        for row in results["lookup"]:
            log(f"{row['side']:<22} {_format(row['off_tok_s']):>22} {_format(row['on_tok_s']):>22} "
                f"{_format(row['speedup'], 2):>22}")
        if not any(row["side"] == "llama.cpp" for row in results["lookup"]):
            log(f"{'llama.cpp':<22} {results['llamacpp']}")


def _format(spread: dict, digits: int = 1) -> str:
    return f"{spread['median']:.{digits}f} [{spread['min']:.{digits}f}-{spread['max']:.{digits}f}]"


@dataclass
class LlamaCppBenchConfig:
    """splitserve's engine beside llama.cpp on the same GGUF file, each side in its own process pinned to the same
    CPUs with the same thread count: batch-1 decode ms/token, tokens/s with parallel sequences, and prompt lookup."""

    model: str = field(default=DEFAULT_MODEL, metadata=described(
        "Model both sides load (a GGUF file for llama.cpp; tiny-random runs splitserve's side alone)."))
    quantizations: list[str] = field(default_factory=lambda: list(QUANTIZATIONS), metadata=described(
        "splitserve's weight formats to measure (those the engine refuses for this model are reported)."))
    threads: list[int] = field(default_factory=lambda: [1, 2], metadata=described("Thread counts, each side alike."))
    cpus: list[int] = field(default_factory=lambda: sorted(allowed_cpus(), reverse=True), metadata=described(
        "CPUs to pin to, in order: a run with N threads takes the first N (default: the highest first)."))
    max_tokens: int = field(default=128, metadata=described("Greedy tokens decoded per sequence."))
    parallel: int = field(default=8, metadata=described("Sequences decoding together for the throughput figure."))
    repeats: int = field(default=3, metadata=described("Rounds; the table shows their median and spread."))
    int8_activations: list[str] = field(default_factory=list, metadata=described(
        "Weight formats also measured with int8 activations (EngineConfig.int8_activations), e.g. gguf."))
    lookup_prompts: int = field(default=4, metadata=described(
        "Input-grounded prompts of the prompt-lookup comparison (0: skip it)."))
    num_speculative_tokens: int = field(default=SpeculativeConfig.num_speculative_tokens, metadata=described(
        "Prompt lookup: most tokens proposed per step, both sides."))
    lookup_quantization: str = field(default="none", metadata=described(
        "Prompt lookup: splitserve's weight format."))
    json: str = field(default="", metadata=described("Also write the figures to this JSON file."))

    def __post_init__(self) -> None:
        unknown = [q for q in [*self.quantizations, self.lookup_quantization, *self.int8_activations]
                   if q not in QUANTIZATIONS]
        if not self.quantizations or unknown:
            raise ValueError(f"quantizations must name some of {', '.join(QUANTIZATIONS)}, got {self.quantizations}")
        if not self.threads or min(self.threads) < 1 or max(self.threads) > len(self.cpus):
            raise ValueError(f"threads must be in [1, {len(self.cpus)}] (the CPUs given), got {self.threads}")
        if min(self.max_tokens - 1, self.parallel, self.repeats, self.num_speculative_tokens) < 1:
            raise ValueError("max_tokens must be >= 2, and parallel, repeats, num_speculative_tokens >= 1")
        if self.lookup_prompts < 0:
            raise ValueError(f"lookup_prompts must be >= 0, got {self.lookup_prompts}")


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(LlamaCppBenchConfig, argv, prog="splitserve bench llamacpp")
    results = run(config)
    report(results)
    save_results(results, config.json)
    return results
