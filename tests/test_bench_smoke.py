"""The codec and transfer benchmarks run end to end on the tiny random model with their smallest options, and their JSON
figures have the structure docs/PERFORMANCE.md's tables are made from. The lossless codec is the exact baseline: full
agreement and no perplexity change, by construction, not within a tolerance.
"""

from __future__ import annotations

import json

import pytest

from splitserve.bench import codecs as codecs_bench
from splitserve.bench import engine as engine_bench
from splitserve.bench import transfer as transfer_bench
from splitserve.kvtransfer.codecs import available_codecs


def test_codecs_bench_measures_every_codec_against_the_lossless_one_per_cache_dtype(tmp_path, capsys):
    out, png, table = tmp_path / "codecs.json", tmp_path / "codecs.png", tmp_path / "quality.json"
    codecs_bench.main(["--model", "tiny-random", "--prompts", "2", "--tokens", "4", "--windows", "1", "--repeat",
                       "1", "--json", str(out), "--plot", str(png), "--quality-table", str(table)])
    results = json.loads(out.read_text())
    assert list(results["cache_dtypes"]) == ["float16", "float32"]
    for dtype, run in results["cache_dtypes"].items():
        figures = run["codecs"]
        assert list(figures) == available_codecs()
        for name, f in figures.items():
            assert f["ratio_to_bf16"] > 0 and f["encode_mb_s"] > 0 and f["decode_mb_s"] > 0, name
            assert 0 <= f["agreement"] <= 1 and 0 <= f["identical"] <= 2 and f["perplexity"] > 0, name
            assert 0 <= f["top1_agreement"] <= 1 and f["mean_kl"] >= -1e-6, name
        # The transfer path (reserve, write, admit) with the lossless codec is the reference run, token for token.
        none = figures["none"]
        assert (none["agreement"], none["identical"], none["ppl_change_pct"], none["max_abs_error"]) == (
            1.0, 2, 0.0, 0.0)
        assert (none["top1_agreement"], none["mean_kl"]) == (1.0, 0.0)  # teacher-forced, every position
        assert figures["kivi2"]["mean_kl"] > 0  # 2 bits moves the next-token distributions, if not their argmax
        assert none["ratio_to_bf16"] == (1.0 if dtype == "float16" else 0.5)  # 2 or 4 bytes per element
        for name in ("int8", "kivi2"):  # zstd is lossless: the same quality, its own size
            plain, zstd = figures[name], figures[name + "+zstd"]
            assert [zstd[k] for k in ("agreement", "perplexity", "top1_agreement", "mean_kl")] == [
                plain[k] for k in ("agreement", "perplexity", "top1_agreement", "mean_kl")]
            assert zstd["ratio_to_bf16"] != plain["ratio_to_bf16"]
        assert [t["codec"] for t in run["targets"]] == ["int8", "kivi8", "int4", "kivi4", "kivi2"]
    quality = json.loads(table.read_text())
    assert quality["cache_dtypes"]["float16"]["none"]["agreement"] == 1.0
    assert quality["cache_dtypes"]["float16"]["none"]["top1_agreement"] == 1.0
    assert set(quality["cache_dtypes"]["float32"]) == set(available_codecs())
    assert png.stat().st_size > 0
    assert "== targets, float16 cache ==" in capsys.readouterr().out


@pytest.mark.e2e
def test_codecs_bench_through_up_compares_each_codec_cluster_with_the_lossless_one(tmp_path):
    out, in_process = tmp_path / "served.json", tmp_path / "in-process.json"
    small = ["--model", "tiny-random", "--codecs", "none,kivi2", "--prompts", "2", "--tokens", "8"]
    codecs_bench.main(["--through-up", *small, "--json", str(out)])
    served = json.loads(out.read_text())
    figures = served["codecs"]
    assert list(figures) == ["none", "kivi2"]
    # The lossless path through the pods gives the benchmark's in-process reference, token for token.
    assert (figures["none"]["agreement"], figures["none"]["identical"]) == (1.0, 2)
    assert figures["kivi2"]["against"] == "none through splitserve up"
    # kivi2 through the pods is the benchmark's own round trip of the same prompts on the pods' cache dtype, token
    # for token, and 2 bits make the tiny model's greedy answers diverge.
    codecs_bench.main([*small, "--cache-dtypes", served["cache_dtype"], "--windows", "1", "--repeat", "1", "--json",
                       str(in_process)])
    benchmark = json.loads(in_process.read_text())["cache_dtypes"][served["cache_dtype"]]["codecs"]["kivi2"]
    kivi2 = figures["kivi2"]
    assert (kivi2["agreement"], kivi2["identical"]) == (benchmark["agreement"], benchmark["identical"])
    assert kivi2["agreement"] < 1 and kivi2["identical"] < 2


@pytest.mark.e2e
def test_transfer_bench_measures_shm_and_grpc_overlap_on_and_off_per_codec(tmp_path):
    out, png = tmp_path / "transfer.json", tmp_path / "transfer.png"
    transfer_bench.main(["--model", "tiny-random", "--codecs", "none,int8+zstd", "--prompt-tokens", "64",
                         "--requests", "1", "--cache-dtypes", "float32,int8", "--json", str(out), "--plot", str(png)])
    results = json.loads(out.read_text())
    assert [(r["cache_dtype"], r["codec"], r["transport"], r["overlap"]) for r in results["rows"]] == [
        (pool, codec, transport, overlap) for pool in ("float32", "int8") for codec in ("none", "int8+zstd")
        for transport in ("shm", "grpc") for overlap in (True, False)]
    for row in results["rows"]:
        assert row["ttft_s"] > 0 and row["prefill_s"] > 0 and 0 <= row["exposed_s"] < row["ttft_s"], row
        assert row["raw_gb_s_min"] <= row["raw_gb_s"] <= row["raw_gb_s_max"] and row["wire_gb_s"] > 0, row
        assert 0 < row["wire_mb"] <= row["raw_mb"], row
    none_row = results["rows"][0]
    assert none_row["wire_mb"] == none_row["raw_mb"] == 64 * 4 * 2 * (2 * 16 * 4) / 1e6  # tokens x layers x K/V x bytes
    # From an int8 pool, none carries the rows as they lie: head_dim codes and a float16 scale per 16 of them.
    int8_none = results["rows"][8]
    assert int8_none["wire_mb"] == int8_none["raw_mb"] == 64 * 2 * 2 * 4 * (16 + 2) / 1e6
    assert len(results["targets"]) == 8  # the overlap-on rows
    hand_off, int8_hand_off = results["hand_off"]  # codec none, overlap off, per pool, against the 5 GB/s target
    assert int8_hand_off["cache_dtype"] == "int8" and int8_hand_off["shm_ms"] > 0
    assert hand_off["shm_gb_s"][0] == results["rows"][1]["raw_gb_s"] and hand_off["grpc_ceiling_gb_s"] > 0
    assert hand_off["shm_over_grpc"] == pytest.approx(hand_off["shm_gb_s"][0] / hand_off["grpc_gb_s"][0])
    assert png.stat().st_size > 0


def test_engine_bench_measures_ours_and_transformers_side_by_side(tmp_path, capsys):
    out, png = tmp_path / "engine.json", tmp_path / "engine.png"
    engine_bench.main(["--model", "tiny-random", "--steps", "4", "--repeat", "1", "--rounds", "2",
                       "--machine-rounds", "1", "--cache-dtypes", "float16,float32", "--json", str(out),
                       "--plot", str(png)])
    results = json.loads(out.read_text())
    assert [int(n) for n in results["prefill"]] == list(engine_bench.PROMPT_LENS)
    machine = results["machine"]
    assert machine["matmul_gflops"] > 0 and machine["read_gbps"] > 0
    for r in results["prefill"].values():
        assert r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["peak_gflops"] > 0
        assert r["share_of_peak"] == pytest.approx(r["gflops"] / r["peak_gflops"])
    assert [int(b) for b in results["hf_decode_ms"]] == list(engine_bench.DECODE_BATCHES)
    assert all(ms > 0 for ms in results["hf_decode_ms"].values())
    assert list(results["decode"]) == ["float16", "float32"]
    for cache_dtype, elem_bytes in (("float16", 2), ("float32", 4)):
        rows = results["decode"][cache_dtype]
        assert [int(b) for b in rows] == list(engine_bench.DECODE_BATCHES)
        assert all(r["ours_ms"] > 0 for r in rows.values())
        # Each floor is the bytes a step reads over its round's bandwidth; the KV part of those bytes grows with
        # the batch at the cache's element size: K and V x layers x KV heads x head_dim elements per cached token
        # (tiny-random: 4 layers, 2 KV heads of 16).
        assert all(r["read_gbps"] > 0 for r in rows.values())
        floor_bytes = {int(b): r["floor_ms"] * r["read_gbps"] * 1e6 for b, r in rows.items()}
        kv_bytes_per_seq = 2 * 4 * 2 * 16 * elem_bytes * engine_bench.DECODE_CONTEXT
        assert (floor_bytes[32] - floor_bytes[8]) / 24 == pytest.approx(kv_bytes_per_seq, rel=1e-6)
    printed = capsys.readouterr().out
    assert "== targets (KV cache float16) ==" in printed and "== targets (KV cache float32) ==" in printed
    assert png.stat().st_size > 0


def test_engine_bench_compares_weight_formats_side_by_side(tmp_path, capsys):
    out = tmp_path / "formats.json"
    engine_bench.main(["--model", "tiny-random", "--quantizations", "none,int8,int4", "--threads", "1", "--steps", "2",
                       "--repeat", "1", "--rounds", "1", "--machine-rounds", "1", "--perplexity-windows", "1", "--json",
                       str(out)])
    results = json.loads(out.read_text())
    formats = results["formats"]
    assert list(formats) == ["none", "int8", "int4"]
    assert formats["int4"]["weight_bytes"] < formats["int8"]["weight_bytes"] < formats["none"]["weight_bytes"]
    for f in formats.values():
        assert f["perplexity"] > 1
        decode = f["threads"]["1"]["decode"]
        assert [int(b) for b in decode] == list(engine_bench.DECODE_BATCHES)
        # The tiny model's weights sit in the caches, so its steps may beat a floor computed from DRAM's bandwidth.
        assert all(d["floor_ms"] > 0 and d["ms"] > 0 for d in decode.values())
        assert list(f["threads"]["1"]["prefill_tok_s"]) == ["512"]  # 2048 is past tiny-random's context
    printed = capsys.readouterr().out
    assert "== weight formats" in printed and "int4: batch-1" in printed
