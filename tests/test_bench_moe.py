"""``splitserve bench moe`` on small shapes: both models' prefill and decode timed in every round, the MoE's experts
really routed (its checkpoint is a Mixtral the engine loads as one), and the figures' JSON."""

from __future__ import annotations

import json
import os

import pytest

from splitserve.bench import moe as moe_bench
from splitserve.engine import LLM


def test_the_moe_and_its_dense_twin_are_timed_side_by_side(tmp_path, capsys):
    out = tmp_path / "moe.json"
    moe_bench.main(["--hidden", "64", "--layers", "2", "--experts", "4", "--expert-width", "32",
                    "--prompt-tokens", "48", "--decode-steps", "3", "--repeat", "2", "--json", str(out)])
    results = json.loads(out.read_text())
    assert set(results["models"]) == {"moe", "dense"}
    for figures in results["models"].values():
        assert len(figures["prefill_s"]) == len(figures["decode_ms"]) == 2
        assert min(figures["prefill_s"]) > 0 and min(figures["decode_ms"]) > 0
    assert "moe / dense: prefill" in capsys.readouterr().out


@pytest.mark.e2e
def test_with_dispatch_the_moe_runs_over_two_ranks_with_each_dispatch(tmp_path, capsys):
    """One tensor-parallel engine after the other, each stopped before the next: this process's CPU mask comes back
    (two at once left it pinned to one CPU, and later modules' clusters planned over that one)."""
    out, mask = tmp_path / "moe.json", os.sched_getaffinity(0)
    moe_bench.main(["--hidden", "64", "--layers", "2", "--experts", "4", "--expert-width", "64",
                    "--prompt-tokens", "48", "--decode-steps", "3", "--repeat", "1", "--dispatch", "--json", str(out)])
    dispatch = json.loads(out.read_text())["dispatch"]
    assert set(dispatch) == {"all_reduce", "all_to_all"}
    assert all(min(f["prefill_s"]) > 0 and min(f["decode_ms"]) > 0 for f in dispatch.values())
    assert "all_to_all / all_reduce: prefill" in capsys.readouterr().out
    assert os.sched_getaffinity(0) == mask  # the engines' ranks stopped: the later tests plan over every CPU again


def test_the_benchmarks_checkpoints_are_a_mixture_and_a_dense_model_of_the_same_active_width(tmp_path):
    paths = moe_bench.checkpoints(tmp_path, hidden=64, layers=2, experts=4, top_k=2, width=32, seed=0)
    moe, dense = (LLM(model=str(paths[name]), num_blocks=16).engine.model_config for name in ("moe", "dense"))
    assert (moe.architecture, moe.num_experts, moe.num_experts_per_tok, moe.moe_layers) == ("mixtral", 4, 2, [0, 1])
    assert (dense.architecture, dense.num_experts, dense.intermediate_size) == ("mistral", 0, 2 * 32)
