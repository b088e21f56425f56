"""KV transfer benchmark: a prompt's KV pushed from a real prefill pod to a real decode pod over loopback gRPC, with
the layer-by-layer overlap on and off (the baseline, measured in the same run), per codec.

Starts a decode pod and two prefill pods, one with ``--overlap-transfer`` and one with ``--no-overlap-transfer``,
each its own process as in a deployment (``python -m splitserve.prefill_service`` / ``decode_service``) on 127.0.0.1, with
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
Then the ceiling the raw push is held against: grpcio alone over loopback (``grpc_ceiling``), a client stream of
``max_chunk_bytes`` messages of plain bytes (no protobuf, no codec, no KV pool) to a sink in another process, as
many bytes as one prompt's raw KV, best of ``CEILING_REPEAT``; reported beside the raw push throughput of codec
``none`` with the overlap off (where the span is the transfer alone), their ratio, and the 1 GiB/s target.
Target: exposed transfer at most ``MAX_EXPOSED_SHARE`` of TTFT with the overlap on. docs/PERFORMANCE.md holds
measured figures.
"""

from __future__ import annotations

import asyncio
import multiprocessing
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

from splitserve.engine.config import DEFAULT_MODEL, CacheConfig
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.kvtransfer.wire import MAX_CHUNK_BYTES
from splitserve.measure.codec_texts import reference_tokens
from splitserve.measure.figures import FiguresOutput, headless_pyplot, save_figure, save_results
from splitserve.runtime import transport
from splitserve.runtime.config import described, parse_config
from splitserve.runtime.kv_codecs import check_kv_codecs
from splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CODECS = ("none", "int8+zstd", "int4")
BLOCK_SIZE = CacheConfig.block_size
MAX_EXPOSED_SHARE = 0.10  # the target, with the overlap on
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=16)
CALL_TIMEOUT_S = 120.0
CEILING_REPEAT = 5
RAW_PUSH_TARGET_BYTES_S = 1 << 30  # 1 GiB/s with codec none


# ---- the pods, as processes --------------------------------------------------------------------------------------

@dataclass
class PodProcess:
    name: str
    address: str
    popen: subprocess.Popen
    log: Path


def start_pod(name: str, module: str, flags: list[str], log_dir: Path, port: int = 0) -> PodProcess:
    """``python -m module`` on 127.0.0.1:``port`` (0: a free one), its output in ``log_dir``/``name``.log."""
    port = port or _free_port()
    log = log_dir / f"{name}.log"
    with open(log, "ab") as out:  # the child keeps its own descriptor
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


# ---- the grpcio ceiling ----------------------------------------------------------------------------------------

_SINK_METHOD = "/bench.Sink/Push"


def _serve_sink(ports: multiprocessing.Queue) -> None:
    """Child process: a gRPC server whose one client-streaming method counts the bytes it receives."""
    async def serve() -> None:
        async def push(request_iterator, context) -> bytes:
            received = 0
            async for message in request_iterator:
                received += len(message)
            return str(received).encode()

        server = transport.new_server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Sink", {
            "Push": grpc.stream_unary_rpc_method_handler(push)})])
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def grpc_ceiling(total_bytes: int, message_bytes: int = MAX_CHUNK_BYTES, repeat: int = CEILING_REPEAT) -> float:
    """Bytes per second of grpcio alone: ``total_bytes`` as one client stream of ``message_bytes`` messages to a
    sink in another process on loopback, with the pods' channel options; best of ``repeat``."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    sink = context.Process(target=_serve_sink, args=(ports,), daemon=True)
    sink.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=60)}"
        return asyncio.run(_best_stream_rate(address, total_bytes, message_bytes, repeat))
    finally:
        sink.terminate()
        sink.join()


async def _best_stream_rate(address: str, total_bytes: int, message_bytes: int, repeat: int) -> float:
    message = bytes(message_bytes)
    count = -(-total_bytes // message_bytes)
    async with grpc.aio.insecure_channel(address, options=transport.CHANNEL_OPTIONS) as channel:
        push = channel.stream_unary(_SINK_METHOD)
        await push(iter([b"warm-up"]))
        best = 0.0
        for _ in range(repeat):
            start = time.perf_counter()
            received = int(await push(iter([message] * count)))
            best = max(best, received / (time.perf_counter() - start))
    return best


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
        decode = start_pod("decode", "splitserve.decode_service", [*flags, "--num-threads", "1"], Path(log_dir))
        prefills = {overlap: start_pod(f"prefill-{'overlap' if overlap else 'serial'}", "splitserve.prefill_service",
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
    raw_bytes = int(max(row.raw_mb for row in rows) * 1e6)
    log(f"grpcio ceiling: {raw_bytes / 1e6:.1f} MB in {MAX_CHUNK_BYTES}-byte messages, best of {CEILING_REPEAT}")
    ceiling = grpc_ceiling(raw_bytes)
    return {"model": model, "prompt_tokens": prompt_tokens, "requests": requests,
            "rows": [asdict(row) for row in rows], "targets": targets(rows),
            "push": push_figures(rows, ceiling)}


def push_figures(rows: list[ConfigFigures], ceiling_bytes_s: float) -> dict:
    """The raw push of codec none, overlap off (the transfer alone), against grpcio's ceiling and the target."""
    serial = [row for row in rows if row.codec == "none" and not row.overlap]
    raw = serial[0].raw_mb_s * 1e6 if serial else 0.0
    return {"raw_push_mb_s": raw / 1e6, "grpc_ceiling_mb_s": ceiling_bytes_s / 1e6,
            "ratio_to_ceiling": raw / ceiling_bytes_s, "target_mb_s": RAW_PUSH_TARGET_BYTES_S / 1e6,
            "passed": raw >= RAW_PUSH_TARGET_BYTES_S}


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
    push = results["push"]
    log(f"\n== raw push, codec none, overlap off: {push['raw_push_mb_s']:.0f} MB/s; grpcio alone, same messages: "
        f"{push['grpc_ceiling_mb_s']:.0f} MB/s; ratio {push['ratio_to_ceiling']:.2f} ==")
    log("\n== targets ==")
    log(f"raw push {push['raw_push_mb_s']:.0f} MB/s (target >= {push['target_mb_s']:.0f} MB/s, 1 GiB/s): "
        f"{'PASS' if push['passed'] else 'FAIL'}")
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
