"""``splitserve bench tp`` end to end on the tiny random model with its smallest options: every engine measured,
both all-reduce transports fitted (where the shared-memory one exists), gloo's all-to-all of the same payloads beside
them (expert parallelism's alternative), and the projection to 8 ranks printed."""

from __future__ import annotations

import json

import pytest

from splitserve.bench import tp as tp_bench
from splitserve.engine.parallel import shm_all_reduce


@pytest.mark.e2e
def test_tp_bench_measures_tp1_and_tp2_and_projects_to_8_ranks(tmp_path, capsys):
    out, png = tmp_path / "tp.json", tmp_path / "tp.png"
    tp_bench.main(["--model", "tiny-random", "--rounds", "1", "--steps", "2", "--context", "16", "--prompt-len", "32",
                   "--batches", "1,2", "--tp1-threads", "1", "--json", str(out), "--plot", str(png)])
    figures = json.loads(out.read_text())
    assert list(figures["runs"]) == ["tp1-1t", "tp2"]
    tp2 = figures["runs"]["tp2"]
    layers = tp2["shape"]["num_layers"]
    for per_step in tp2["collectives_per_step"].values():
        assert per_step["calls"] == 2 * layers + 2  # two per layer, the embedding's, the logits' gather
        assert per_step["bytes"] > 0 and per_step["seconds"] > 0
    transports = ["shm", "gloo"] if shm_all_reduce.available() else ["gloo"]
    assert list(tp2["comm_model"]) == transports
    assert list(figures["projection"]) == transports
    assert all(list(by_size) == ["2", "4", "8"] for by_size in figures["projection"].values())
    assert all(run["kv_handoff_ms"][way]["median"] > 0 for run in figures["runs"].values() for way in ("read", "write"))
    assert [(size, seconds > 0) for size, seconds in tp2["expert_dispatch"]] == [
        (size * 2, True) for size, _ in tp2["comm_model"][transports[0]]["points"]]  # the same rows from each rank
    assert png.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "projected TP 8" in printed and "gloo all-to-all of" in printed
