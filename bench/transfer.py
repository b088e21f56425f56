"""KV transfer benchmark: a prompt's KV pushed from a real prefill pod to a real decode pod over loopback gRPC, with
the layer-by-layer overlap on and off (the baseline, measured in the same run), per codec.

Starts a decode pod and two prefill pods, one with ``--overlap-transfer`` and one with ``--no-overlap-transfer``,
each its own process as in a deployment (``python -m prefill_service`` / ``decode_service``) on 127.0.0.1, with
prefix caching off so that every call computes its whole prompt. For each codec and each prefill pod: one warm-up
Prefill call (handshake, first-use costs), then ``--requests`` calls one after another, each a ``--prompt-tokens``
prompt cut from GPL-3's text (the same prompts for every configuration). After each call the benchmark aborts the
request on the decode pod, which frees the KV it holds.

Per (codec, overlap), means over the measured calls:
  - TTFT: the Prefill call's wall time at the caller (what the router sees);
  - queue and prefill seconds as the prefill pod reports them (arrival -> first step -> first token);
  - exposed transfer: from the end of the last layer's compute to the decode pod's acknowledgement, and its share
    of TTFT;
  - push throughput: wire bytes (after the codec) and raw bytes (the cache dtype) over the transfer's span (first
    chunk written -> acknowledgement). With the overlap on, that span includes waiting for layers still computing,
    so it measures the pipeline, not the link.
Target: exposed transfer at most ``MAX_EXPOSED_SHARE`` of TTFT with the overlap on. The README holds measured figures.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import mean

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench import FiguresOutput, headless_pyplot, save_figure, save_results
from bench.codecs import reference_tokens
from engine.config import DEFAULT_MODEL, CacheConfig
from engine.tokenizer_files import load_tokenizer
from protos.splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from runtime.config import described, parse_config
from runtime.kv_codecs import check_kv_codecs

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CODECS = ("none", "int8+zstd", "int4")
BLOCK_SIZE = CacheConfig.block_size
MAX_EXPOSED_SHARE = 0.10  # the target, with the overlap on
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=16)
CALL_TIMEOUT_S = 120.0


# ---- the pods, as processes --------------------------------------------------------------------------------------

@dataclass
class PodProcess:
    name: str
    address: str
    popen: subprocess.Popen
    log: Path


def start_pod(name: str, module: str, flags: list[str], log_dir: Path) -> PodProcess:
    port = _free_port()
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:  # the child keeps its own descriptor
        popen = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
                                  "--metrics-port", "0", *flags], cwd=REPO_ROOT, stdout=out,
                                 stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    return PodProcess(name, f"127.0.0.1:{port}", popen, log)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_serving(pod: PodProcess, timeout_s: float) -> None:
    """Until the pod answers SERVING on gRPC health (it has loaded its model); fails early if it died."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(pod.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            if pod.popen.poll() is not None:
                raise RuntimeError(f"{pod.name} pod exited with {pod.popen.returncode}; its log:\n{_tail(pod.log)}")
            try:
                answer = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"{pod.name} pod not SERVING after {timeout_s:.0f} s; its log:\n{_tail(pod.log)}")
            time.sleep(0.2)


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def stop_pods(pods: list[PodProcess]) -> None:
    for pod in pods:
        if pod.popen.poll() is None:
            pod.popen.send_signal(signal.SIGTERM)
    for pod in pods:
        try:
            pod.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pod.popen.kill()
            pod.popen.wait()


def pod_flags(model: str, prompt_tokens: int) -> list[str]:
    # Room for two prompts' KV: the one arriving, and the previous one while its release is on its way.
    num_blocks = 2 * -(-prompt_tokens // BLOCK_SIZE)
    # float32 caches: codec "none" then moves 4 bytes per element, the baseline the codecs' sizes compare with.
    return ["--model", model, "--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks),
            "--cache-dtype", "float32", "--no-enable-prefix-caching"]


# ---- the calls ---------------------------------------------------------------------------------------------------

@dataclass
class CallFigures:
    """One Prefill call: seconds, and the transfer's bytes."""

    ttft_s: float
    queue_s: float
    prefill_s: float
    exposed_s: float
    transfer_s: float
    bytes_sent: int
    raw_bytes: int


def prefill_call(prefill: prefill_pb2_grpc.PrefillStub, decode: decode_pb2_grpc.DecodeStub, request_id: str,
                 prompt: list[int], codec: str, decode_address: str) -> CallFigures:
    request = prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=GREEDY,
                                         decode_address=decode_address, kv_codec=codec)
    start = time.perf_counter()
    response = prefill.Prefill(request, timeout=CALL_TIMEOUT_S)
    ttft_s = time.perf_counter() - start
    decode.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=10)  # frees the KV under its lease
    stats = response.kv_transfer
    return CallFigures(ttft_s, response.queue_seconds, response.prefill_seconds, stats.exposed_transfer_seconds,
                       stats.transfer_seconds, stats.bytes_sent, stats.raw_bytes)


@dataclass
class ConfigFigures:
    """Means over one (codec, overlap) configuration's measured calls."""

    codec: str
    overlap: bool
    ttft_s: float
    queue_s: float
    prefill_s: float
    exposed_s: float
    exposed_share: float  # exposed / TTFT
    transfer_s: float
    wire_mb_s: float
    raw_mb_s: float
    wire_mb: float  # per call
    raw_mb: float

    @classmethod
    def of(cls, codec: str, overlap: bool, calls: list[CallFigures]) -> "ConfigFigures":
        ttft, exposed, transfer = (mean(getattr(c, f) for c in calls) for f in ("ttft_s", "exposed_s", "transfer_s"))
        sent, raw = mean(c.bytes_sent for c in calls), mean(c.raw_bytes for c in calls)
        return cls(codec, overlap, ttft, mean(c.queue_s for c in calls), mean(c.prefill_s for c in calls), exposed,
                   exposed / ttft, transfer, sent / transfer / 1e6, raw / transfer / 1e6, sent / 1e6, raw / 1e6)


def measure(prefill_address: str, decode_address: str, codec: str, overlap: bool, prompts: list[list[int]],
            log) -> ConfigFigures:
    """A warm-up call with ``prompts[0]``, then one measured call per remaining prompt."""
    label = f"{codec}-{'overlap' if overlap else 'serial'}"
    with grpc.insecure_channel(prefill_address) as p, grpc.insecure_channel(decode_address) as d:
        prefill, decode = prefill_pb2_grpc.PrefillStub(p), decode_pb2_grpc.DecodeStub(d)
        prefill_call(prefill, decode, f"{label}-warmup", prompts[0], codec, decode_address)
        calls = []
        for i, prompt in enumerate(prompts[1:]):
            calls.append(prefill_call(prefill, decode, f"{label}-{i}", prompt, codec, decode_address))
            c = calls[-1]
            log(f"  {label} call {i + 1}/{len(prompts) - 1}: TTFT {c.ttft_s * 1e3:.0f} ms, prefill "
                f"{c.prefill_s * 1e3:.0f} ms, exposed transfer {c.exposed_s * 1e3:.1f} ms")
    return ConfigFigures.of(codec, overlap, calls)


# ---- the run -----------------------------------------------------------------------------------------------------

def run(model: str, codecs: list[str], prompt_tokens: int, requests: int, ready_timeout_s: float, log=print) -> dict:
    text = reference_tokens(load_tokenizer(model))
    if (requests + 1) * prompt_tokens > len(text):
        raise SystemExit(f"the reference text has {len(text)} tokens: not enough for {requests + 1} prompts of "
                         f"{prompt_tokens}")
    prompts = [text[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(requests + 1)]
    flags = pod_flags(model, prompt_tokens)
    with tempfile.TemporaryDirectory(prefix="splitserve-bench-transfer-") as log_dir:
        log(f"starting a decode pod and two prefill pods ({model}) ...")
        # The decode pod only receives here: one torch thread leaves the cores to the prefill pod's compute.
        decode = start_pod("decode", "decode_service", [*flags, "--num-threads", "1"], Path(log_dir))
        prefills = {overlap: start_pod(f"prefill-{'overlap' if overlap else 'serial'}", "prefill_service",
                                       [*flags, "--overlap-transfer" if overlap else "--no-overlap-transfer"],
                                       Path(log_dir)) for overlap in (True, False)}
        pods = [decode, *prefills.values()]
        try:
            for pod in pods:
                wait_serving(pod, ready_timeout_s)
            rows = []
            for codec in codecs:
                for overlap, pod in prefills.items():
                    log(f"{codec}, overlap {'on' if overlap else 'off'}: {requests} calls of {prompt_tokens} tokens")
                    rows.append(measure(pod.address, decode.address, codec, overlap, prompts, log))
        finally:
            stop_pods(pods)
    return {"model": model, "prompt_tokens": prompt_tokens, "requests": requests,
            "rows": [asdict(row) for row in rows], "targets": targets(rows)}


def targets(rows: list[ConfigFigures]) -> list[dict]:
    return [{"codec": row.codec, "exposed_share": row.exposed_share, "max_exposed_share": MAX_EXPOSED_SHARE,
             "passed": row.exposed_share <= MAX_EXPOSED_SHARE} for row in rows if row.overlap]


def report(results: dict, log=print) -> None:
    log(f"\n== KV transfer on {results['model']}: {results['prompt_tokens']}-token prompts, mean of "
        f"{results['requests']} calls, loopback ==")
    log(f"{'codec':<10} {'overlap':>7} {'TTFT ms':>8} {'queue ms':>9} {'prefill ms':>11} {'exposed ms':>11} "
        f"{'exp/TTFT':>9} {'wire MB':>8} {'wire MB/s':>10} {'raw MB/s':>9}")
    for r in results["rows"]:
        log(f"{r['codec']:<10} {'on' if r['overlap'] else 'off':>7} {r['ttft_s'] * 1e3:>8.0f} "
            f"{r['queue_s'] * 1e3:>9.1f} {r['prefill_s'] * 1e3:>11.0f} {r['exposed_s'] * 1e3:>11.1f} "
            f"{r['exposed_share']:>9.1%} {r['wire_mb']:>8.1f} {r['wire_mb_s']:>10.0f} {r['raw_mb_s']:>9.0f}")
    log("\n== targets ==")
    for t in results["targets"]:
        log(f"{t['codec']}: exposed transfer {t['exposed_share']:.1%} of TTFT with overlap "
            f"(target <= {t['max_exposed_share']:.0%}): {'PASS' if t['passed'] else 'FAIL'}")


def plot(results: dict, path: str) -> None:
    plt = headless_pyplot()

    rows = results["rows"]
    labels = [f"{r['codec']}\noverlap {'on' if r['overlap'] else 'off'}" for r in rows]
    parts = {"queue": [r["queue_s"] for r in rows], "prefill": [r["prefill_s"] for r in rows],
             "exposed transfer": [r["exposed_s"] for r in rows]}
    # What the prefill pod's clocks leave out: the gRPC call's own overhead, both ways.
    parts["other"] = [max(0.0, r["ttft_s"] - r["queue_s"] - r["prefill_s"] - r["exposed_s"]) for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 5))
    bottom = [0.0] * len(rows)
    for name, seconds in parts.items():
        ms = [s * 1e3 for s in seconds]
        ax.bar(labels, ms, bottom=bottom, label=name)
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"TTFT of {results['prompt_tokens']}-token prompts on {results['model']}, prefill pod -> decode pod")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


@dataclass
class TransferBenchConfig(FiguresOutput):
    """KV transfer benchmark: a prompt's KV pushed between real pods, layer-by-layer overlap on and off, per codec."""

    model: str = field(default=DEFAULT_MODEL, metadata=described("Model the pods serve (tiny-random for a quick run)."))
    codecs: list[str] = field(default_factory=lambda: list(DEFAULT_CODECS), metadata=described("Codecs to measure."))
    prompt_tokens: int = field(default=1024, metadata=described("Tokens of each prompt pushed."))
    requests: int = field(default=3, metadata=described("Measured calls per configuration."))
    ready_timeout_s: float = field(default=300.0, metadata=described("How long the pods may take to load."))

    def __post_init__(self) -> None:
        check_kv_codecs("codecs", self.codecs)
        if min(self.prompt_tokens, self.requests) < 1 or self.ready_timeout_s <= 0:
            raise ValueError("prompt_tokens, requests and ready_timeout_s must be > 0")


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(TransferBenchConfig, argv, prog="splitserve bench transfer")
    results = run(config.model, config.codecs, config.prompt_tokens, config.requests, config.ready_timeout_s)
    report(results)
    save_results(results, config.json, config.plot, plot)
    return results
