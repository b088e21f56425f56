"""``splitserve bench moe`` on small shapes: both models' prefill and decode timed in every round, the MoE's experts
really routed (its checkpoint is a Mixtral the engine loads as one), and the figures' JSON."""

from __future__ import annotations

import json

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


def test_the_benchmarks_checkpoints_are_a_mixture_and_a_dense_model_of_the_same_active_width(tmp_path):
    paths = moe_bench.checkpoints(tmp_path, hidden=64, layers=2, experts=4, top_k=2, width=32, seed=0)
    moe, dense = (LLM(model=str(paths[name]), num_blocks=16).engine.model_config for name in ("moe", "dense"))
    assert (moe.architecture, moe.num_experts, moe.num_experts_per_tok, moe.moe_layers) == ("mixtral", 4, 2, [0, 1])
    assert (dense.architecture, dense.num_experts, dense.intermediate_size) == ("mistral", 0, 2 * 32)
