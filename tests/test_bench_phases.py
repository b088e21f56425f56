"""``bench phases`` and the step costs it plots: FLOPs and bytes of prefill and decode steps counted by hand on the
tiny model's shape, and the benchmark run end to end on the tiny random model with a small grid.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

from splitserve.bench.phases import command as phases
from splitserve.bench.phases import llamacpp_pools
from splitserve.bench.phases.step_cost import (
    decode_bytes,
    decode_flops,
    kv_bytes_per_token,
    linear_flops_per_token,
    lm_head_flops,
    prefill_bytes,
    prefill_flops,
)
from splitserve.engine.config import DEFAULT_MODEL
from splitserve.engine.weights.model_files import tiny_random_config
from splitserve.measure.phase_profile import PhaseProfile

SHIPPED = Path(__file__).parents[1] / "simulator" / "profiles" / "smollm2-135m-gguf-2thread.json"

# tiny-random: hidden 64, 4 heads of 16 (2 KV heads), MLP 128, 4 layers, 259 tokens.
CFG = tiny_random_config()


def test_step_flops_counted_by_hand():
    # Per token and layer: QKV 2*64*(4+2*2)*16 = 16384, output 2*64*64 = 8192, gate+up 2*64*256 = 32768,
    # down 2*128*64 = 16384.
    assert linear_flops_per_token(CFG) == 16384 + 8192 + 32768 + 16384 == 73728
    assert lm_head_flops(CFG) == 2 * 64 * 259
    # Decode, batch 3 at context 10: each new token attends over 10 tokens (QK^T and PV: 2 * 2 * 4 heads * 16 * 10).
    assert decode_flops(CFG, 3, 10) == 4 * (73728 + 2560) * 3 + 2 * 64 * 259 * 3
    # Prefill of 4 tokens: they attend over 1, 2, 3 and 4 tokens; one lm_head row.
    assert prefill_flops(CFG, 4) == 4 * (73728 * 4 + 256 * (1 + 2 + 3 + 4)) + 2 * 64 * 259


def test_chunked_prefill_computes_what_one_pass_does():
    # 1000 tokens in chunks of 512 and 488: the second chunk attends over the first's 512 too; lm_head once.
    chunks = prefill_flops(CFG, 512) - lm_head_flops(CFG) + prefill_flops(CFG, 488, context_before=512)
    assert chunks == prefill_flops(CFG, 1000)


def test_step_bytes():
    per_token = kv_bytes_per_token(CFG, 2)
    assert per_token == 2 * 4 * 2 * 16 * 2  # K and V x layers x KV heads x head_dim x float16
    assert decode_bytes(CFG, 1000, batch=3, context=10, cache_elem_bytes=2) == 1000 + per_token * 30
    # A chunk reads the weights, attends over cached + new K/V, and writes the new.
    assert prefill_bytes(CFG, 1000, 488, context_before=512, cache_elem_bytes=2) == 1000 + per_token * (1000 + 488)


def test_phases_bench_measures_both_phases_against_the_machine(tmp_path, capsys):
    out, png, profile_path = tmp_path / "phases.json", tmp_path / "phases.png", tmp_path / "profile.json"
    phases.main(["--model", "tiny-random", "--prompt-lens", "64,600", "--batches", "1,4", "--contexts", "32,128",
                 "--steps", "3", "--repeat", "1", "--machine-rounds", "1", "--json", str(out), "--plot", str(png),
                 "--threads", "1", "--profile-out", str(profile_path), "--profile-note", "test",
                 "--prefill-compute-dtype", "bfloat16"])
    results = json.loads(out.read_text())
    assert results["prefill_compute"] == "bfloat16"  # the steps measured, and the profile fitted, are bf16 prefill's
    machine = results["machine"]
    assert machine["matmul_gflops"] > 0 and machine["read_gbps"] > 0
    assert machine["ridge_flop_per_byte"] == pytest.approx(machine["matmul_gflops"] / machine["read_gbps"])
    prefill = results["prefill"]
    assert list(prefill) == ["64", "600"]
    assert prefill["600"]["step_tokens"] == [512, 88]  # chunked as a pod chunks it (long_prefill_token_threshold)
    for n, r in prefill.items():
        assert r["tok_s"] == pytest.approx(int(n) / (r["ttft_ms"] / 1e3))
        assert r["flops_per_step"] * r["steps"] == pytest.approx(prefill_flops(CFG, int(n)))
        assert r["gflops"] == pytest.approx(prefill_flops(CFG, int(n)) / (r["ttft_ms"] / 1e3) / 1e9)
    decode = results["decode"]
    assert list(decode) == ["1x32", "4x32", "1x128", "4x128"]
    weights = results["weight_bytes"]
    for r in decode.values():
        assert r["ms_per_step"] > 0 and r["tok_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_per_step"])
        assert r["bytes_per_step"] == decode_bytes(CFG, weights, r["batch"], r["context"], 2)  # float16 cache
        assert r["flop_per_byte"] == pytest.approx(r["flops_per_step"] / r["bytes_per_step"])
        assert r["floor_ms"] == pytest.approx(r["bytes_per_step"] / machine["read_gbps"] / 1e6)
    printed = capsys.readouterr().out
    assert "== prefill (tiny-random) ==" in printed and "== decode (tiny-random, KV cache float16) ==" in printed
    assert png.stat().st_size > 0
    # The simulator's profile: every prefill step (600 tokens: two chunks) and decode point, fitted.
    profile = PhaseProfile.load(profile_path)
    assert (profile.threads, profile.note, profile.model, profile.prefill_compute) == (1, "test", "tiny-random",
                                                                                      "bfloat16")
    assert len(profile.points["prefill"]) == 3 and len(profile.points["decode"]) == 4
    assert profile.points["prefill"][-1][:2] == [88, 88 * (512 + 88)]  # the second chunk attends over the first
    assert min(profile.prefill.a, profile.prefill.b, profile.prefill.c, profile.decode.a) >= 0


def test_prefill_formats_side_by_side_against_the_bf16_gemm_peak(tmp_path, capsys):
    out = tmp_path / "formats.json"
    phases.main(["--model", "tiny-random", "--prefill-formats", "--prompt-lens", "8,40", "--repeat", "2",
                 "--json", str(out)])
    results = json.loads(out.read_text())
    assert results["cpu"] and results["cpu_features"]
    for by_threads in results["threads"].values():  # "1", and "2" where two CPUs are allowed
        assert set(by_threads["prefill"]) == {"float32", "bfloat16"}
        for figures in by_threads["prefill"]["bfloat16"].values():
            assert figures["min_ms"] <= figures["median_ms"] <= figures["max_ms"]
            assert figures["peak_gflops"] > 0 and figures["share_of_peak"] > 0
    assert "1" in results["threads"]
    assert "prefill by compute format" in capsys.readouterr().out


def test_prefill_quality_against_float32_with_simulated_int8(tmp_path, capsys):
    out = tmp_path / "quality.json"
    phases.main(["--model", "tiny-random", "--prefill-quality", "--json", str(out)])
    results = json.loads(out.read_text())
    formats = results["formats"]
    assert set(formats) == {"bfloat16", "float32-pytorch", "w8a8-token", "w8a8-group32"}
    assert results["positions"] > 3 * 128
    # the simulation's control (the PyTorch path, unquantized) answers as float32 does; int8 moves the answers
    assert formats["float32-pytorch"]["top1_agreement"] >= 0.99
    assert formats["w8a8-token"]["top1_agreement"] < 1 and formats["w8a8-token"]["perplexity"] > 0
    assert "prefill formats' quality against float32" in capsys.readouterr().out


def test_kv_pools_side_by_side_against_each_ones_byte_floor(tmp_path, capsys):
    out = tmp_path / "pools.json"
    phases.main(["--model", "tiny-random", "--kv-pools", "--batches", "1,3", "--contexts", "40", "--steps", "2",
                 "--repeat", "2", "--json", str(out), "--plot", str(tmp_path / "pools.png")])
    results = json.loads(out.read_text())
    assert (tmp_path / "pools.png").read_bytes().startswith(b"\x89PNG")
    assert results["cpu"] and results["read_gbps"] > 0 and results["pool_dtypes"] == ["float16", "int8"]
    assert results["weights"] == "none"  # tiny-random's float weights: no quantized products to take int8 inputs
    assert set(results["points"]) == {"1x40", "3x40"}
    for point in results["points"].values():
        half, int8 = point["float16"], point["int8"]
        assert len(half["ms"]) == len(int8["ms"]) == 2 and min(half["ms"] + int8["ms"]) > 0
        assert int8["bytes_per_step"] < half["bytes_per_step"]  # the rows' bytes, scales included
    # tiny-random: KV heads of 16 (int8 rows of 18 bytes against 32 in float16); a 1 GiB pool, sequences of 4096
    assert results["capacity"]["int8"] > 1.7 * results["capacity"]["float16"]
    assert results["llamacpp"] == {"absent": "tiny-random is not a GGUF file"}  # llama.cpp's column says why
    assert "decode by KV pool format" in capsys.readouterr().out


@pytest.mark.model
def test_kv_pools_decode_with_int8_activations_as_a_pod_would(tmp_path):
    """--int8-activations reaches the engines --kv-pools times (the products then quantize their inputs)."""
    out = tmp_path / "pools.json"
    phases.main(["--kv-pools", "--int8-activations", "--batches", "2", "--contexts", "40", "--steps", "1",
                 "--repeat", "1", "--llamacpp-kv-types", "", "--json", str(out)])
    results = json.loads(out.read_text())
    assert results["weights"] == "gguf+int8-activations" and set(results["points"]) == {"2x40"}
    assert results["llamacpp"] == {}  # none asked


def test_the_attention_probe_times_each_pool_format_scattered_in_order_and_resident(tmp_path, capsys):
    out = tmp_path / "probe.json"
    phases.main(["--model", "tiny-random", "--attention-probe", "--batches", "3", "--contexts", "64", "--repeat", "2",
                 "--json", str(out)])
    results = json.loads(out.read_text())
    assert (results["batch"], results["context"], results["shape"]["layers"]) == (3, 64, CFG.num_layers)
    for layouts in results["formats"].values():
        assert list(layouts) == ["scattered", "in order", "resident"]
        assert all(f["cpu_ms"] > 0 and f["gb_s"] > 0 for f in layouts.values())
    # the K/V bytes a pass reads: the rows' (int8: 16 codes and a 2-byte scale per head), over the CPU seconds
    int8 = results["formats"]["int8"]["resident"]
    assert int8["gb_s"] == pytest.approx(CFG.num_layers * 2 * 3 * 64 * CFG.num_kv_heads * 18 / int8["cpu_ms"] / 1e6)
    assert "decode attention alone, 3 x 64" in capsys.readouterr().out


@pytest.mark.model
def test_llama_cpp_decodes_over_each_of_its_kv_types_at_each_batch():
    """With llama-cpp-python installed (the optional extra), the peer's column: the GGUF file's decode over each KV
    type, a context prefilled once and copied into every sequence of the larger batch."""
    pytest.importorskip("llama_cpp", reason="the optional llamacpp extra is not installed")
    figures = llamacpp_pools.run(DEFAULT_MODEL, list(llamacpp_pools.KV_TYPES), [1, 2], [48], steps=1, repeat=2,
                                 cpu=min(os.sched_getaffinity(0)), seed=0)
    for kv_type in llamacpp_pools.KV_TYPES:
        assert set(figures[kv_type]) == {"1x48", "2x48"}, figures[kv_type]
        assert all(len(ms) == 2 and min(ms) > 0 for ms in figures[kv_type].values())


def test_kv_pool_quality_against_the_float16_pool(tmp_path, capsys):
    out = tmp_path / "pool_quality.json"
    phases.main(["--model", "tiny-random", "--kv-pool-quality", "--pool-dtypes", "float32,int8", "--json", str(out),
                 "--prefill-compute-dtype", "float32"])
    results = json.loads(out.read_text())
    formats = results["formats"]
    assert set(formats) == {"float16", "float32", "int8"} and results["positions"] == 4 * 1024
    assert results["prefill_compute"] == "float32"
    assert formats["float16"]["top1_agreement"] == 1.0 and formats["float16"]["ppl_change_pct"] == 0.0
    assert formats["int8"]["perplexity"] > 0
    assert "KV pool formats' quality against the float16 pool" in capsys.readouterr().out


@pytest.mark.e2e
def test_a_tensor_parallel_profile_records_the_pod_size_it_was_measured_at(tmp_path):
    """The simulator and the planner count a pod of this profile at its ranks and the CPUs they shared."""
    profile_path, cpus = tmp_path / "profile.json", len(os.sched_getaffinity(0))
    phases.main(["--model", "tiny-random", "--prompt-lens", "32", "--batches", "1", "--contexts", "32", "--steps", "2",
                 "--repeat", "1", "--machine-rounds", "1", "--threads", "1", "--tensor-parallel-size", "2",
                 "--profile-out", str(profile_path), "--json", str(tmp_path / "phases.json")])
    gc.collect()  # the engine's ranks stop, and this process gets back the CPUs rank 0 was pinned to
    profile = PhaseProfile.load(profile_path)
    assert profile.tensor_parallel_size == 2
    assert profile.cpus == cpus  # the CPUs the ranks shared out, not rank 0's share
    assert profile.pod_cpus == max(profile.cpus, 2)


def test_an_older_profile_is_one_rank_on_its_threads():
    """Profiles written before the pod size was recorded: one rank, as many CPUs as threads."""
    data = json.loads(SHIPPED.read_text())
    assert "tensor_parallel_size" not in data and "cpus" not in data
    profile = PhaseProfile.from_json(data)
    assert (profile.tensor_parallel_size, profile.pod_cpus) == (1, data["threads"])
