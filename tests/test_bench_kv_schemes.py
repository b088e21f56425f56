"""``bench phases --kv-schemes``: the simulation's attention is the engine's (checked against the real float16 and
int8 pools), its windows read what they say, and the command's table carries each scheme's figures."""

import dataclasses
import json

import pytest
import torch

from splitserve.bench.phases import command as phases
from splitserve.bench.phases import kv_schemes
from splitserve.bench.phases.prefill_quality import sequence_logits
from splitserve.engine import LLM

TOKENS = list(range(3, 83))  # 80 tokens: five blocks


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-random", quantization="none", cpu_kernels=False, prefill_compute_dtype="float32",
               kv_cache_memory_bytes=4 << 20)


# The int8 pool: its rows, each query's own block of keys in float16 (engine/kv_formats/open_keys.py).
@pytest.mark.parametrize("scheme, pool", [("float16", "float16"), ("int8-g16-block", "int8")])
def test_the_simulation_answers_as_the_engine_over_that_pool(llm, scheme, pool):
    simulated = kv_schemes._logits(llm, TOKENS, kv_schemes.SCHEMES[scheme])
    torch.testing.assert_close(simulated, sequence_logits(llm, TOKENS, pool), rtol=1e-4, atol=1e-4)


def test_a_window_over_the_whole_sequence_is_float16(llm):
    wide = dataclasses.replace(kv_schemes.SCHEMES["int4-kivi-64"], window=len(TOKENS))
    assert torch.equal(kv_schemes._logits(llm, TOKENS, wide),
                       kv_schemes._logits(llm, TOKENS, kv_schemes.SCHEMES["float16"]))
    narrow = dataclasses.replace(wide, window=8)
    assert not torch.equal(kv_schemes._logits(llm, TOKENS, narrow), kv_schemes._logits(llm, TOKENS, wide))


def test_the_block_window_reads_a_query_s_own_block_in_float16(llm):
    """Keys quantized to zero outside the window: the first block's queries see only their own block's keys, as in
    float16; every later query reads the zeroed older blocks."""
    zeroed = kv_schemes.Scheme(torch.zeros_like, None, 1, 2, "block")
    logits = kv_schemes._logits(llm, TOKENS, zeroed)
    float16 = kv_schemes._logits(llm, TOKENS, kv_schemes.SCHEMES["float16"])
    assert torch.equal(logits[:16], float16[:16])
    assert not torch.allclose(logits[16:], float16[16:])


def test_a_block_window_reads_whole_blocks_in_float16(llm):
    """Two blocks of K and V in float16: queries of the first two blocks read float16 alone; a query of the third
    block reads the first block zeroed, its own and the one before in float16 (not the last 32 tokens: whole blocks)."""
    two = kv_schemes.Scheme(torch.zeros_like, torch.zeros_like, 1, 1, "2 blocks")
    logits = kv_schemes._logits(llm, TOKENS, two)
    float16 = kv_schemes._logits(llm, TOKENS, kv_schemes.SCHEMES["float16"])
    assert torch.equal(logits[:32], float16[:32])
    assert not torch.allclose(logits[32:], float16[32:])
    tokens_32 = kv_schemes.Scheme(torch.zeros_like, torch.zeros_like, 1, 1, 32)
    assert not torch.equal(kv_schemes._logits(llm, TOKENS, tokens_32)[32:48], logits[32:48])
    assert kv_schemes.capacity_ratio(two) == kv_schemes.capacity_ratio(tokens_32)


def test_key_channels_are_scaled_per_block():
    x = torch.randn(40, 2, 8)
    quantized = kv_schemes._per_channel(kv_schemes._symmetric, 8)(x)
    louder = x.clone()
    louder[16:] *= 100  # the later blocks' scales grow; the first block's codes must not move
    assert torch.equal(kv_schemes._per_channel(kv_schemes._symmetric, 8)(louder)[:16], quantized[:16])
    assert (quantized - x).abs().max() <= x.abs().max() / 127


def test_the_command_prints_each_scheme_against_float16(tmp_path, capsys):
    out = tmp_path / "schemes.json"
    phases.main(["--model", "tiny-random", "--kv-schemes", "int8-row,int4-kivi-128", "--json", str(out)])
    schemes = json.loads(out.read_text())["schemes"]
    assert list(schemes) == ["float16", "int8-row", "int4-kivi-128"]
    assert schemes["float16"]["top1_agreement"] == 1.0 and schemes["float16"]["capacity_vs_float16"] == 1.0
    assert schemes["int8-row"]["capacity_vs_float16"] == pytest.approx(2 / (1 + 2 / 64))
    assert schemes["int4-kivi-128"]["capacity_vs_float16"] == pytest.approx(16384 / (1.5 * 3968 + 4 * 128))
    assert 0 < schemes["int4-kivi-128"]["top1_agreement"] <= 1
    assert "simulated KV schemes against the float16 pool" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown KV schemes"):
        phases.main(["--model", "tiny-random", "--kv-schemes", "int3"])


def test_grouped_key_scales_keep_a_loud_channel_to_its_group():
    x = torch.randn(4, 2, 64)
    loud = x.clone()
    loud[..., 0] *= 1000  # an outlier channel: one row scale coarsens every channel, a group scale its 16
    for grouped in (kv_schemes.SCHEMES["int8-key-g16"].keys, kv_schemes.SCHEMES["int8-g16-block"].keys):
        assert torch.equal(grouped(loud)[..., 16:], grouped(x)[..., 16:])
    assert not torch.equal(kv_schemes._int8_rows(loud)[..., 16:], kv_schemes._int8_rows(x)[..., 16:])
