"""The scoring of ``bench compare --slo-map`` (bench/compare/slo_map.py) on made-up request records: attainment and
goodput per SLO pair, their bootstrap intervals, the regimes' targets, and when a ratio counts as a win."""

import pytest

from splitserve.bench.compare.plan import Topology
from splitserve.bench.compare.slo_map import (
    MapConfig,
    TopologyRuns,
    goodput,
    goodput_interval,
    score,
    topologies,
    verdicts,
)
from splitserve.bench.serve.run import ServeBenchConfig
from splitserve.measure.serve_metrics import SLO, RequestRecord
from splitserve.measure.slo_regimes import REGIMES


def record(i: int, ttft: float, tpot: float, status: str = "ok", tokens: int = 11) -> RequestRecord:
    chunks = [ttft + k * tpot for k in range(tokens)]
    return RequestRecord(i, 100, tokens, 0.0, status=status, sent_s=0.0, chunk_s=chunks, end_s=chunks[-1],
                         output_tokens=tokens)


def run(ttft: float, tpot: float, count: int = 60, slow: int = 0) -> list[RequestRecord]:
    """``count`` requests, the last ``slow`` of them 10x slower in both."""
    return [record(i, ttft * (10 if i >= count - slow else 1), tpot * (10 if i >= count - slow else 1))
            for i in range(count)]


def map_config(**fields) -> MapConfig:
    return MapConfig(serve=ServeBenchConfig(), rates=[0.2, 0.3], cpus=frozenset({0, 1}), model="tiny-random",
                     kv_cache_memory_bytes=1 << 20, ready_timeout_s=10.0, reference_rate=0.2, **fields)


def test_attainment_counts_failed_requests_as_misses():
    records = run(1.0, 0.05, count=9) + [record(9, 1.0, 0.05, status="failed")]
    assert SLO(ttft=2.0, tpot=0.1).attained_by(records) == pytest.approx(0.9)
    assert SLO(ttft=0.5, tpot=0.1).attained_by(records) == 0.0


def test_goodput_is_the_highest_rate_met_with_every_lower_rate_met_too():
    slo = SLO(ttft=2.0, tpot=0.1)
    by_rate = {0.2: run(1.0, 0.05), 0.3: run(1.0, 0.05, slow=30), 0.4: run(1.0, 0.05)}
    assert goodput(by_rate, slo, 0.9) == 0.2  # 0.4 met again, but after a miss at 0.3
    assert goodput({0.2: run(3.0, 0.05)}, slo, 0.9) == 0.0


def test_the_interval_is_tight_when_every_request_is_far_from_the_line_and_wide_near_it():
    slo = SLO(ttft=2.0, tpot=0.1)
    assert goodput_interval({0.2: run(1.0, 0.05), 0.3: run(1.0, 0.05)}, slo, 0.9) == (0.3, 0.3)
    low, high = goodput_interval({0.2: run(1.0, 0.05), 0.3: run(1.0, 0.05, slow=6)}, slo, 0.9)  # exactly 90%
    assert (low, high) == (0.2, 0.3)


def test_regimes_are_multiples_of_the_single_request_latencies_and_get_their_own_hybrid():
    plans = topologies(map_config(), ttft0=1.0, tpot0=0.04)
    hybrid = {t.name: t.fields for t in plans if t.kind == "hybrid"}
    assert set(hybrid) == {f"hybrid-{r.name}" for r in REGIMES}
    assert (hybrid["hybrid-tight-ttft"]["slo_ttft_s"], hybrid["hybrid-tight-ttft"]["slo_tpot_s"]) == (2.0, 0.2)
    assert (hybrid["hybrid-tight-tpot"]["slo_ttft_s"], hybrid["hybrid-tight-tpot"]["slo_tpot_s"]) == (12.0, 0.06)
    assert [t.kind for t in plans[:2]] == ["colocated", "disaggregated"]
    only_balanced = topologies(map_config(hybrid_regimes=("balanced",)), 1.0, 0.04)
    assert [t.name for t in only_balanced if t.kind == "hybrid"] == ["hybrid-balanced"]


def test_a_ratio_is_a_win_only_when_the_intervals_do_not_overlap():
    def runs(name, kind, ttft, slow=0):
        return TopologyRuns(Topology(name, kind, {}), {0.2: run(ttft, 0.02), 0.3: run(ttft, 0.02, slow=slow)})

    results = [runs("colocated-x", "colocated", 1.0, slow=20), runs("disagg-1:1", "disaggregated", 1.0, slow=7),
               runs("hybrid-balanced", "hybrid", 1.0)]
    result = score(results, map_config(), ttft0=1.0, tpot0=0.02)
    balanced = result["regimes"]["balanced"]
    assert balanced["topologies"]["hybrid-balanced"]["goodput"] == 0.3
    assert verdicts(balanced, "balanced") == ["hybrid / colocated-x: 1.50x (win)",
                                              "hybrid / disagg-1:1: 1.50x (intervals overlap)"]  # 88%: near
    # The regimes without a hybrid of their own are scored on the balanced one.
    assert verdicts(result["regimes"]["tight-ttft"], "tight-ttft")[0].startswith("hybrid / colocated-x")


def test_vllm_is_one_more_topology_only_when_its_interpreter_is_given():
    assert "vllm-cpu" not in [t.name for t in topologies(map_config(), 1.0, 0.04)]
    plans = topologies(map_config(vllm_python="/opt/vllm/bin/python"), 1.0, 0.04)
    assert plans[-1].name == "vllm-cpu" and plans[-1].kind == "vllm"


def test_vllm_runs_pinned_to_the_topologies_cpus_with_the_pods_kv_budget(tmp_path):
    from splitserve.bench.compare.vllm_server import VLLMServer

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    server = VLLMServer(str(python), "/models/x", "smollm2-135m", frozenset({0, 1}), 3 << 30, 18011,
                        tmp_path / "vllm.log")
    command = server.command()
    assert command[:4] == ["taskset", "-c", "0-1", str(python)]
    assert command[command.index("--served-model-name") + 1] == "smollm2-135m"
    assert command[command.index("--port") + 1] == "18011" and server.http_url == "http://127.0.0.1:18011"
    assert command[command.index("--dtype") + 1] == "bfloat16"  # as a user runs it on a CPU with bf16 products
    env = server.environment()
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"]) == ("0-1", "3")
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")


def test_the_export_vllm_loads_is_the_same_model_and_tokenizer(tmp_path):
    """The directory holds the float32 weights and a tokenizer that encodes as the model's own; it is reused."""
    import torch
    from safetensors.torch import load_file

    from splitserve.bench.compare.vllm_server import export_model
    from splitserve.engine.text.tokenizer import Tokenizer
    from splitserve.engine.weights.model_files import load_model_files

    directory = export_model("tiny-random", tmp_path / "tiny")
    loaded = load_model_files("tiny-random")
    weights = load_file(directory / "model.safetensors")
    assert weights["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(weights["model.embed_tokens.weight"], loaded.state_dict["embed_tokens.weight"])
    text = "Hello, world: 12 apples"
    assert Tokenizer.from_hf_dir(directory).encode(text) == loaded.tokenizer.encode(text)
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert export_model("tiny-random", directory) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp  # not written twice
