"""KV transfer benchmark: a prompt's KV pushed from a real prefill pod to a real decode pod on one host, through
shared memory and over loopback gRPC side by side, with the layer-by-layer overlap on and off (the baseline), per
prompt length and codec, all in one run.

Starts a decode pod (its ``--kv-shm-dir`` a fresh directory under /dev/shm) and four prefill pods, one per
(transport, overlap): ``--kv-transport auto`` (shared memory, the pods being on one host) or ``grpc``, with
``--overlap-transfer`` or ``--no-overlap-transfer``; each its own process as in a deployment
(``python -m splitserve.prefill_service`` / ``decode_service``) on 127.0.0.1, with prefix caching off so that every
call computes its whole prompt. For each prompt length, codec and prefill pod: one warm-up Prefill call (handshake,
first-use costs, the arena's first pages), then ``--requests`` calls one after another, each a prompt cut from GPL-3's
text (the same prompts for every configuration). After each call the benchmark aborts the request on the decode pod,
which frees the KV it holds. Every call's KVTransferStats says which transport its KV took; a row whose calls did not
all take the row's transport fails the run.

Per (prompt length, codec, transport, overlap), over the measured calls:
  - TTFT: the Prefill call's wall time at the caller (what the router sees), mean;
  - queue and prefill seconds as the prefill pod reports them (arrival -> first step -> first token), means;
  - exposed transfer: from the end of the last layer's compute to the decode pod's acknowledgement, and its share
    of TTFT, means;
  - hand-off throughput: raw bytes (the cache dtype) and wire bytes (after the codec) over the transfer's span, first
    chunk written -> the decode pod's acknowledgement, which comes once every chunk is checked and in its paged cache:
    the KV ready on the decode pod. Median, min and max over the calls. With the overlap on, that span includes
    waiting for layers still computing, so it measures the pipeline; the overlap-off rows measure the hand-off.
Then the ceiling the gRPC push is held against: grpcio alone over loopback (``grpc_ceiling``), a client stream of
``max_chunk_bytes`` messages of plain bytes to a sink in another process, as many bytes as the longest prompt's raw
KV, best of ``CEILING_REPEAT``.
Targets: the same-host hand-off (codec none, overlap off) at least ``SHM_TARGET_BYTES_S`` at every prompt length;
exposed transfer at most ``MAX_EXPOSED_SHARE`` of TTFT with the overlap on. docs/PERFORMANCE.md holds measured
figures.
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
from statistics import mean, median

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.engine.config import CACHE_DTYPES, DEFAULT_MODEL, CacheConfig
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.kvtransfer.shm import TRANSPORT_GRPC, TRANSPORT_SHM
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
SHM_TARGET_BYTES_S = 5e9  # 5 GB/s, the same-host hand-off of codec none (issue 37)
TRANSPORTS = (TRANSPORT_SHM, TRANSPORT_GRPC)
PREFILL_FLAGS = {TRANSPORT_SHM: "auto", TRANSPORT_GRPC: "grpc"}  # --kv-transport of each row's prefill pod


# ---- the pods, as processes --------------------------------------------------------------------------------------

@dataclass
class PodProcess:
    name: str
    address: str
    popen: subprocess.Popen
    log: Path


def start_pod(name: str, module: str, flags: list[str], log_dir: Path, port: int = 0,
              env: dict[str, str] | None = None) -> PodProcess:
    """``python -m module`` on 127.0.0.1:``port`` (0: a free one), its output in ``log_dir``/``name``.log, with
    ``env`` added to this process's environment."""
    port = port or _free_port()
    log = log_dir / f"{name}.log"
    with open(log, "ab") as out:  # the child keeps its own descriptor
        popen = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
                                  "--metrics-port", "0", *flags], cwd=REPO_ROOT, stdout=out,
                                 stderr=subprocess.STDOUT,
                                 env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO_ROOT)})
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


def pod_flags(model: str, prompt_tokens: int, cache_dtype: str) -> list[str]:
    # Room for two prompts' KV: the one arriving, and the previous one while its release is on its way.
    num_blocks = 2 * -(-prompt_tokens // BLOCK_SIZE)
    return ["--model", model, "--block-size", str(BLOCK_SIZE), "--num-blocks", str(num_blocks),
            "--cache-dtype", cache_dtype, "--no-enable-prefix-caching"]


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
    """One Prefill call: seconds, the transfer's bytes, and the transport its KV took."""

    ttft_s: float
    queue_s: float
    prefill_s: float
    exposed_s: float
    transfer_s: float
    bytes_sent: int
    raw_bytes: int
    transport: str


def prefill_call(prefill: prefill_pb2_grpc.PrefillStub, decode: decode_pb2_grpc.DecodeStub, request_id: str,
                 prompt: list[int], codec: str, decode_pod: PodProcess) -> CallFigures:
    request = prefill_pb2.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=GREEDY,
                                         decode_address=decode_pod.address, kv_codec=codec)
    start = time.perf_counter()
    response = prefill.Prefill(request, timeout=CALL_TIMEOUT_S)
    ttft_s = time.perf_counter() - start
    decode.Abort(common_pb2.AbortRequest(request_id=request_id), timeout=10)  # frees the KV under its lease
    stats = response.kv_transfer
    return CallFigures(ttft_s, response.queue_seconds, response.prefill_seconds, stats.exposed_transfer_seconds,
                       stats.transfer_seconds, stats.bytes_sent, stats.raw_bytes, stats.transport)


@dataclass
class ConfigFigures:
    """One (pools' cache dtype, prompt length, codec, transport, overlap) configuration's measured calls: means, and
    the hand-off's throughput per call summarized as median, min and max."""

    cache_dtype: str
    prompt_tokens: int
    codec: str
    transport: str
    overlap: bool
    ttft_s: float
    queue_s: float
    prefill_s: float
    exposed_s: float
    exposed_share: float  # exposed / TTFT
    transfer_s: float
    wire_mb: float  # per call
    raw_mb: float
    raw_gb_s: float  # median over the calls
    raw_gb_s_min: float
    raw_gb_s_max: float
    wire_gb_s: float  # median

    @classmethod
    def of(cls, cache_dtype: str, prompt_tokens: int, codec: str, transport: str, overlap: bool,
           calls: list[CallFigures]) -> "ConfigFigures":
        took = {c.transport for c in calls}
        if took != {transport}:
            raise RuntimeError(f"{transport} rows' KV went by {sorted(took)}: the pods did not take the expected link")
        ttft, exposed, transfer = (mean(getattr(c, f) for c in calls) for f in ("ttft_s", "exposed_s", "transfer_s"))
        raw_rates = [c.raw_bytes / c.transfer_s / 1e9 for c in calls]
        return cls(cache_dtype, prompt_tokens, codec, transport, overlap, ttft, mean(c.queue_s for c in calls),
                   mean(c.prefill_s for c in calls), exposed, exposed / ttft, transfer,
                   mean(c.bytes_sent for c in calls) / 1e6, mean(c.raw_bytes for c in calls) / 1e6,
                   median(raw_rates), min(raw_rates), max(raw_rates),
                   median(c.bytes_sent / c.transfer_s / 1e9 for c in calls))


def measure(prefill_address: str, decode_pod: PodProcess, label: str, codec: str, prompts: list[list[int]],
            log) -> list[CallFigures]:
    """A warm-up call with ``prompts[0]``, then one measured call per remaining prompt."""
    with grpc.insecure_channel(prefill_address) as p, grpc.insecure_channel(decode_pod.address) as d:
        prefill, decode = prefill_pb2_grpc.PrefillStub(p), decode_pb2_grpc.DecodeStub(d)
        prefill_call(prefill, decode, f"{label}-warmup", prompts[0], codec, decode_pod)
        calls = []
        for i, prompt in enumerate(prompts[1:]):
            calls.append(prefill_call(prefill, decode, f"{label}-{i}", prompt, codec, decode_pod))
            c = calls[-1]
            log(f"  {label} call {i + 1}/{len(prompts) - 1}: TTFT {c.ttft_s * 1e3:.0f} ms, transfer "
                f"{c.transfer_s * 1e3:.1f} ms ({c.raw_bytes / c.transfer_s / 1e9:.2f} GB/s raw), exposed "
                f"{c.exposed_s * 1e3:.1f} ms")
    return calls


# ---- the run -----------------------------------------------------------------------------------------------------

def prompts_of(text: list[int], length: int, count: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, consecutive windows of the text repeated as often as needed (the pods
    cache no prefixes, so windows that overlap cost the same as any others)."""
    tiled = text * -(-(count * length) // len(text))
    return [tiled[i * length:(i + 1) * length] for i in range(count)]


def run(model: str, codecs: list[str], prompt_lengths: list[int], requests: int, ready_timeout_s: float,
        cache_dtypes: list[str], log=print) -> dict:
    text = reference_tokens(load_tokenizer(model))
    rows = []
    for cache_dtype in cache_dtypes:
        rows += run_pools(model, cache_dtype, codecs, prompt_lengths, requests, ready_timeout_s, text, log)
    raw_bytes = int(max(row.raw_mb for row in rows) * 1e6)
    log(f"grpcio ceiling: {raw_bytes / 1e6:.1f} MB in {MAX_CHUNK_BYTES}-byte messages, best of {CEILING_REPEAT}")
    ceiling = grpc_ceiling(raw_bytes)
    return {"model": model, "prompt_tokens": prompt_lengths, "requests": requests, "cache_dtypes": cache_dtypes,
            "rows": [asdict(row) for row in rows], "targets": targets(rows),
            "hand_off": hand_off_figures(rows, ceiling)}


def run_pools(model: str, cache_dtype: str, codecs: list[str], prompt_lengths: list[int], requests: int,
              ready_timeout_s: float, text: list[int], log) -> list[ConfigFigures]:
    """Every configuration's calls between pods whose pools hold ``cache_dtype``."""
    flags = pod_flags(model, max(prompt_lengths), cache_dtype)
    rows = []
    with tempfile.TemporaryDirectory(prefix="splitserve-bench-transfer-") as log_dir, \
            tempfile.TemporaryDirectory(prefix="splitserve-bench-shm-", dir="/dev/shm") as shm_dir:
        log(f"starting a decode pod and four prefill pods ({model}, {cache_dtype} pools) ...")
        # The decode pod only receives here: one torch thread leaves the cores to the prefill pod's compute.
        decode = start_pod("decode", "splitserve.decode_service",
                           [*flags, "--num-threads", "1", "--kv-shm-dir", shm_dir], Path(log_dir))
        prefills = {(transport, overlap): start_pod(
            f"prefill-{transport}-{'overlap' if overlap else 'serial'}", "splitserve.prefill_service",
            [*flags, "--overlap-transfer" if overlap else "--no-overlap-transfer",
             "--kv-transport", PREFILL_FLAGS[transport]], Path(log_dir))
            for transport in TRANSPORTS for overlap in (True, False)}
        pods = [decode, *prefills.values()]
        try:
            for pod in pods:
                wait_serving(pod, ready_timeout_s)
            for length in prompt_lengths:
                prompts = prompts_of(text, length, requests + 1)
                for codec in codecs:
                    for (transport, overlap), pod in prefills.items():
                        label = f"{cache_dtype}-{length}-{codec}-{transport}-{'overlap' if overlap else 'serial'}"
                        log(f"{label}: {requests} calls")
                        calls = measure(pod.address, decode, label, codec, prompts, log)
                        rows.append(ConfigFigures.of(cache_dtype, length, codec, transport, overlap, calls))
        finally:
            stop_pods(pods)
    return rows


def hand_off_figures(rows: list[ConfigFigures], ceiling_bytes_s: float) -> list[dict]:
    """Per pool dtype and prompt length, the hand-off of codec none with the overlap off (the transfer alone), each
    transport's median GB/s and spread and its milliseconds, against the same-host target and grpcio alone. ``none``
    from an int8 pool carries its rows as they lie (no pass over the values on either side), so its GB/s are the
    pool's bytes, and its milliseconds compare with a float pool's for the same prompt."""
    figures = []
    for cache_dtype, length in dict.fromkeys((row.cache_dtype, row.prompt_tokens) for row in rows):
        serial = {row.transport: row for row in rows if (row.cache_dtype, row.prompt_tokens) == (cache_dtype, length)
                  and row.codec == "none" and not row.overlap}
        if not serial:
            continue
        shm, grpc_row = serial.get(TRANSPORT_SHM), serial.get(TRANSPORT_GRPC)
        figures.append({
            "cache_dtype": cache_dtype, "prompt_tokens": length, "raw_mb": next(iter(serial.values())).raw_mb,
            **{f"{name}_ms": row.transfer_s * 1e3 for name, row in serial.items()},
            **{f"{name}_gb_s": [row.raw_gb_s, row.raw_gb_s_min, row.raw_gb_s_max]
               for name, row in serial.items()},
            "shm_over_grpc": shm.raw_gb_s / grpc_row.raw_gb_s if shm and grpc_row else None,
            "grpc_ceiling_gb_s": ceiling_bytes_s / 1e9, "target_gb_s": SHM_TARGET_BYTES_S / 1e9,
            "passed": shm is not None and shm.raw_gb_s * 1e9 >= SHM_TARGET_BYTES_S})
    return figures


def targets(rows: list[ConfigFigures]) -> list[dict]:
    return [{"cache_dtype": row.cache_dtype, "prompt_tokens": row.prompt_tokens, "codec": row.codec,
             "transport": row.transport,
             "exposed_share": row.exposed_share, "max_exposed_share": MAX_EXPOSED_SHARE,
             "passed": row.exposed_share <= MAX_EXPOSED_SHARE} for row in rows if row.overlap]


def report(results: dict, log=print) -> None:
    log(f"\n== KV hand-off on {results['model']}, one host: median (min-max) of {results['requests']} calls ==")
    log(f"{'pool':<8} {'tokens':>6} {'codec':<10} {'link':<5} {'overlap':>7} {'TTFT ms':>8} {'prefill ms':>11} "
        f"{'exposed ms':>11} {'exp/TTFT':>9} {'wire MB':>8} {'raw GB/s (min-max)':>22} {'wire GB/s':>10}")
    for r in results["rows"]:
        spread = f"{r['raw_gb_s']:.2f} ({r['raw_gb_s_min']:.2f}-{r['raw_gb_s_max']:.2f})"
        overlap = "on" if r["overlap"] else "off"
        log(f"{r['cache_dtype']:<8} {r['prompt_tokens']:>6} {r['codec']:<10} {r['transport']:<5} {overlap:>7} "
            f"{r['ttft_s'] * 1e3:>8.0f} {r['prefill_s'] * 1e3:>11.0f} {r['exposed_s'] * 1e3:>11.1f} "
            f"{r['exposed_share']:>9.1%} {r['wire_mb']:>8.1f} {spread:>22} {r['wire_gb_s']:>10.2f}")
    log("\n== targets ==")
    for h in results["hand_off"]:
        shm, grpc_gb_s = h.get("shm_gb_s"), h.get("grpc_gb_s", [float("nan")])[0]
        log(f"{h['cache_dtype']} pools, {h['prompt_tokens']} tokens ({h['raw_mb']:.1f} MB raw): same-host hand-off "
            f"{shm[0] if shm else float('nan'):.2f} GB/s in {h.get('shm_ms', float('nan')):.1f} ms, "
            f"gRPC {grpc_gb_s:.2f} GB/s "
            f"(grpcio alone {h['grpc_ceiling_gb_s']:.2f}); target >= {h['target_gb_s']:.0f} GB/s: "
            f"{'PASS' if h['passed'] else 'FAIL'}")
    for t in results["targets"]:
        log(f"{t['cache_dtype']} pools, {t['prompt_tokens']} tokens, {t['codec']}, {t['transport']}: exposed transfer "
            f"{t['exposed_share']:.1%} of TTFT with overlap "
            f"(target <= {t['max_exposed_share']:.0%}): {'PASS' if t['passed'] else 'FAIL'}")


def plot(results: dict, path: str) -> None:
    """The hand-off's raw GB/s (codec none, overlap off) per pool dtype, prompt length and transport: median, min-max
    bars."""
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    figures = results["hand_off"]
    lengths = [f"{h['cache_dtype']}, {h['prompt_tokens']} tokens" for h in figures]
    for i, link in enumerate(TRANSPORTS):
        spread = [h.get(f"{link}_gb_s") or [0.0, 0.0, 0.0] for h in figures]
        ax.bar([x + 0.4 * i for x in range(len(lengths))], [m for m, _, _ in spread], width=0.4, label=link,
               yerr=[[m - lo for m, lo, _ in spread], [hi - m for m, _, hi in spread]], capsize=4)
    ax.axhline(SHM_TARGET_BYTES_S / 1e9, color="k", linestyle="--", label="shm target")
    ax.set_xticks([x + 0.2 for x in range(len(lengths))], lengths)
    ax.set_ylabel("raw KV GB/s, first chunk -> KV ready on D")
    ax.set_title(f"KV hand-off on one host, {results['model']}, codec none, overlap off")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


@dataclass
class TransferBenchConfig(FiguresOutput):
    """KV transfer benchmark: a prompt's KV handed between real pods on one host, shared memory and gRPC, layer-by-layer
    overlap on and off, per prompt length and codec."""

    model: str = field(default=DEFAULT_MODEL, metadata=described("Model the pods serve (tiny-random for a quick run)."))
    codecs: list[str] = field(default_factory=lambda: list(DEFAULT_CODECS), metadata=described("Codecs to measure."))
    prompt_tokens: list[int] = field(default_factory=lambda: [1024, 2048, 4096], metadata=described(
        "Prompt lengths to push (comma-separated)."))
    requests: int = field(default=3, metadata=described("Measured calls per configuration."))
    cache_dtypes: list[str] = field(default_factory=lambda: ["float32"], metadata=described(
        "The pods' KV pool formats, a set of pods each (float32: codec none moves 4 bytes per element, the baseline "
        "the codecs' sizes compare with; int8: none carries the pool's rows as they lie)."))
    ready_timeout_s: float = field(default=300.0, metadata=described("How long the pods may take to load."))

    def __post_init__(self) -> None:
        check_kv_codecs("codecs", self.codecs)
        unknown = set(self.cache_dtypes) - set(CACHE_DTYPES)
        if unknown or not self.cache_dtypes:
            raise ValueError(f"cache_dtypes: {sorted(unknown) or 'none given'}; choose from {', '.join(CACHE_DTYPES)}")
        if not self.prompt_tokens or min(*self.prompt_tokens, self.requests) < 1 or self.ready_timeout_s <= 0:
            raise ValueError("prompt_tokens (at least one), requests and ready_timeout_s must be > 0")


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(TransferBenchConfig, argv, prog="splitserve bench transfer")
    results = run(config.model, config.codecs, config.prompt_tokens, config.requests, config.ready_timeout_s,
                  config.cache_dtypes)
    report(results)
    save_results(results, config.json, config.plot, plot)
    return results
