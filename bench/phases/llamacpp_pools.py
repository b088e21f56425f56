"""llama.cpp's decode over its own quantized KV caches, beside ``--kv-pools``' formats (``--llamacpp-kv-types``): the
CPU peer a user would hold an int8 pool against, on the same GGUF file, the same pinned CPU and one thread.

For each KV type (``f16``, ``q8_0``, ``q4_0``: llama.cpp's ``type_k`` and ``type_v``, with flash attention, which its
quantized V cache needs) and each context, one process pinned with ``taskset`` to the CPU the engines ran on: the
context's tokens (random ids, seeded) prefilled once into sequence 0's cache, then, for each batch in ascending
order, sequence 0's cache copied into the new sequences' (``llama_memory_seq_cp`` between the streams of a
non-unified cache: a real copy, every cell written), and decode steps of the whole batch, one token per sequence in
one ``llama_batch`` (as the engine's steps): ``WARMUP_STEPS``, then ``repeat`` rounds of ``steps`` steps, each
round's median. Needs ``llama-cpp-python`` (the ``llamacpp`` extra); without it the column says why.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

from splitserve.bench.llamacpp import REPO, llamacpp_absence
from splitserve.engine.text.tokenizer_files import resolve_model_name

KV_TYPES = ("f16", "q8_0", "q4_0")
WARMUP_STEPS = 2
PREFILL_CHUNK = 512  # tokens per llama_decode call of the prefill


def absence(model: str) -> str | None:
    """None where llama.cpp can run ``model`` here, else why not (one line)."""
    kind, _ = resolve_model_name(model)
    if kind != "gguf":
        return f"{model} is not a GGUF file"
    return llamacpp_absence()


def run(model: str, kv_types: list[str], batches: list[int], contexts: list[int], steps: int, repeat: int,
        cpu: int, seed: int, log=print) -> dict:
    """{kv type: {"BxC": [ms per round]}} (a failed process: {kv type: {"error": ...}})."""
    _, path = resolve_model_name(model)
    results: dict = {}
    for kv_type in kv_types:
        results[kv_type] = {}
        for context in contexts:
            log(f"llama.cpp, {kv_type} KV, context {context}: prefill once, then batches {batches} ...")
            job = {"model_path": str(path), "kv_type": kv_type, "batches": sorted(batches), "context": context,
                   "steps": steps, "repeat": repeat, "seed": seed}
            figures = _run_pinned(job, cpu)
            if "error" in figures:
                log(f"  llama.cpp {kv_type}: {figures['error']}")
                results[kv_type] = {"error": figures["error"]}
                break
            results[kv_type].update({f"{b}x{context}": ms for b, ms in figures["ms"].items()})
    return results


def _run_pinned(job: dict, cpu: int) -> dict:
    command = [sys.executable, "-c", "import splitserve.bench.phases.llamacpp_pools as m; m.worker()"]
    if shutil.which("taskset"):
        command = ["taskset", "-c", str(cpu), *command]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(command, input=json.dumps(job), capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}


def worker() -> None:
    """A pinned process's entry: one job (JSON on stdin), {"ms": {batch: [ms per round]}} (JSON, the last line)."""
    job = json.load(sys.stdin)
    try:
        result = {"ms": decode_rounds(job)}
    except Exception as exc:  # noqa: BLE001 - reported by the parent, beside the engine's figures
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)


def decode_rounds(job: dict) -> dict[int, list[float]]:
    import llama_cpp as lc

    batches, context = job["batches"], job["context"]
    steps_total = WARMUP_STEPS + job["repeat"] * job["steps"]
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(job["model_path"].encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {job['model_path']}")
    params = lc.llama_context_default_params()
    params.n_seq_max, params.kv_unified = max(batches), False  # a stream per sequence, each its own cells
    params.n_ctx = max(batches) * (context + steps_total + 16)
    params.n_batch = params.n_ubatch = max(PREFILL_CHUNK, max(batches))
    params.n_threads = params.n_threads_batch = 1
    params.type_k = params.type_v = getattr(lc, f"GGML_TYPE_{job['kv_type'].upper()}")
    params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError(f"llama.cpp refused a context with {job['kv_type']} KV")
    batch = lc.llama_batch_init(params.n_batch, 0, 1)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    rng = random.Random(job["seed"])

    def decode(entries: list[tuple[int, int, int]], logits: bool) -> float:
        for i, (token, pos, seq) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        start = time.perf_counter()
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - start

    try:
        prompt = [rng.randrange(n_vocab) for _ in range(context)]
        for s in range(0, context, PREFILL_CHUNK):
            decode([(t, s + i, 0) for i, t in enumerate(prompt[s:s + PREFILL_CHUNK])], logits=False)
        memory = lc.llama_get_memory(ctx)
        figures, filled = {}, 1
        for size in batches:
            for seq in range(filled, size):
                lc.llama_memory_seq_cp(memory, 0, seq, -1, -1)
            filled = max(filled, size)
            for seq in range(size):  # back to the context alone: every batch decodes at the same length
                lc.llama_memory_seq_rm(memory, seq, context, -1)
            times = [decode([(rng.randrange(n_vocab), context + k, seq) for seq in range(size)], logits=True)
                     for k in range(steps_total)]
            rounds = [times[WARMUP_STEPS + r * job["steps"]:WARMUP_STEPS + (r + 1) * job["steps"]]
                      for r in range(job["repeat"])]
            figures[size] = [statistics.median(r) * 1e3 for r in rounds]
        return figures
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
