"""Where should the router run when prefill has CPU 0 and decode CPU 1? A measurement behind the default CPU plan
(splitserve/cpu_plan.py, ROUTER_FLOATS; docs/architecture.md, "CPU plan").

    .venv/bin/python scripts/router_placement.py [--rounds 8] [--segment-s 30]

Brings up 1 prefill pod (CPU 0) and 1 decode pod (CPU 1) serving SmolLM2-135M through ``Cluster``, and keeps the
same processes for the whole run: only the router's affinity changes, between {1} (next to the decode pod) and
{0,1} (floating), segment by segment, the order alternating by round, so that the machine's drift hits both
alike. Four clients stream requests meanwhile (~130-token prompts, so that they prefill on the prefill pod;
32 output tokens, EOS ignored). Per segment: the client-side TPOT and TTFT of the requests that ran entirely
inside it, and the CPU time the router, the decode and the prefill pod used per generated token (/proc).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

import grpc

from splitserve.launcher import Cluster
from splitserve.runtime.logs import configure_logging
from splitserve.up_config import UpConfig
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

PLACEMENTS = {"router with decode {1}": {1}, "router floating {0,1}": {0, 1}}
WORDS = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
CLIENTS = 4


def pin(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            pass


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def client(address: str, stop: threading.Event, results: list, seed: int) -> None:
    rng = random.Random(seed)
    params = common_pb2.SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        while not stop.is_set():
            prompt = " ".join(rng.choice(WORDS) for _ in range(130))
            sent, first, last, tokens = time.perf_counter(), None, None, 0
            for reply in stub.Generate(generate_pb2.GenerateRequest(text=prompt, sampling_params=params), timeout=300):
                if reply.WhichOneof("response") == "chunk":
                    last = time.perf_counter()
                    first = first or last
                    tokens += len(reply.chunk.token_ids)
            if tokens > 1:
                results.append((sent, first - sent, (last - first) / (tokens - 1), last, tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--segment-s", type=float, default=30.0)
    parser.add_argument("--base-port", type=int, default=33100)
    args = parser.parse_args()
    configure_logging()
    base = args.base_port
    cluster = Cluster(UpConfig(prefill_cpus="0", decode_cpus="1", grpc_port=base,
                               http_port=base + 1, base_pod_port=base + 2, base_metrics_port=base + 6,
                               prometheus=False, kv_cache_memory_bytes=256 << 20))
    cluster.start()
    try:
        cluster.wait_ready()
        pids = {name: cluster.pid(name) for name in ("router", "decode-0", "prefill-0")}
        stop, results = threading.Event(), []
        clients = [threading.Thread(target=client, args=(f"127.0.0.1:{base}", stop, results, i))
                   for i in range(CLIENTS)]
        for thread in clients:
            thread.start()
        time.sleep(15)  # warm-up
        rows = []
        for round_ in range(args.rounds):
            for name in (list(PLACEMENTS) if round_ % 2 == 0 else list(reversed(PLACEMENTS))):
                pin(pids["router"], PLACEMENTS[name])
                time.sleep(3)  # requests started under the previous placement drain out of the window
                cpu_before = {n: cpu_seconds(p) for n, p in pids.items()}
                start = time.perf_counter()
                time.sleep(args.segment_s)
                end = time.perf_counter()
                cpu = {n: cpu_seconds(p) - cpu_before[n] for n, p in pids.items()}
                inside = [r for r in results if r[0] >= start and r[3] <= end]
                tokens = sum(r[4] for r in results if start <= r[3] <= end) or 1
                row = dict(round=round_, placement=name, n=len(inside),
                           tpot_ms=statistics.mean(r[2] for r in inside) * 1e3 if inside else float("nan"),
                           ttft_ms=statistics.mean(r[1] for r in inside) * 1e3 if inside else float("nan"),
                           **{f"{n}_cpu_ms_per_token": cpu[n] * 1e3 / tokens for n in cpu})
                rows.append(row)
                print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
        stop.set()
        for thread in clients:
            thread.join()
        print("\nmean over rounds (paired: the same round's two segments)")
        for name in PLACEMENTS:
            mine = [r for r in rows if r["placement"] == name]
            print(f"{name:<24} TPOT {statistics.mean(r['tpot_ms'] for r in mine):6.1f} ms   "
                  f"TTFT {statistics.mean(r['ttft_ms'] for r in mine):6.0f} ms   "
                  f"requests {sum(r['n'] for r in mine)}   "
                  f"CPU ms/token: router {statistics.mean(r['router_cpu_ms_per_token'] for r in mine):.2f}, "
                  f"decode {statistics.mean(r['decode-0_cpu_ms_per_token'] for r in mine):.2f}, "
                  f"prefill {statistics.mean(r['prefill-0_cpu_ms_per_token'] for r in mine):.2f}")
        pinned, floating = ([r for r in rows if r["placement"] == name] for name in PLACEMENTS)
        ratios = [a["tpot_ms"] / b["tpot_ms"] for a, b in zip(pinned, floating)]
        print(f"TPOT with decode / floating, per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
              f"median {statistics.median(ratios):.2f}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
