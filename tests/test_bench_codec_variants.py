"""The codec variants bench codecs measures (bench/codec_variants.py): ``X@kc`` scales keys per channel within
e4m3's bound and keeps values as X; ``X@prerope`` un-rotates exactly the engine's rotation at the tensor's
positions; both run end to end in ``bench codecs`` without reaching the quality table the pods read."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.bench import codecs as codecs_bench
from splitserve.bench.codec_variants import PreRopeKeys, named_codec
from splitserve.engine.config import ModelConfig
from splitserve.engine.model.rotary import RotaryEmbedding
from splitserve.kvtransfer.codecs import KVSpan, get_codec

CONFIG = ModelConfig(vocab_size=32, hidden_size=192, intermediate_size=64, num_layers=1, num_heads=3,
                     num_kv_heads=3, head_dim=64, max_position_embeddings=512, rope_theta=100000.0)


def pre_rope_keys(tokens: int, seed: int = 0) -> torch.Tensor:
    """[T, 3, 64] keys before RoPE with outlier channels, as Llama-family keys have."""
    x = torch.randn(tokens, 3, 64, generator=torch.Generator().manual_seed(seed))
    x[..., 5] += 20.0
    x[..., 40] -= 12.0
    return x


def engine_rotated(x: torch.Tensor, start: int) -> torch.Tensor:
    rotary = RotaryEmbedding(CONFIG, torch.float32, torch.device("cpu"))
    return rotary.for_step(torch.arange(start, start + len(x))).apply(x)


@pytest.mark.parametrize("start", [0, 100])
def test_the_round_trip_through_a_lossless_codec_gives_back_the_engines_rotated_keys(start):
    pre = pre_rope_keys(64)
    cached = engine_rotated(pre, start)
    codec = named_codec("none@prerope", CONFIG)
    span = KVSpan(start, start + 200)
    assert (codec._rotate(cached, span, inverse=True) - pre).abs().max() < 1e-4  # the pre-RoPE keys themselves
    encoded = codec.encode(cached, "k", span)
    assert (encoded.codec, encoded.dtype) == ("none@prerope", "float32")
    assert (codec.decode(encoded) - cached).abs().max() < 1e-4


def test_values_go_through_the_inner_codec_untouched():
    x = pre_rope_keys(40, seed=1)
    inner, wrapped = get_codec("kivi4"), named_codec("kivi4@prerope", CONFIG)
    assert isinstance(wrapped, PreRopeKeys)
    assert torch.equal(wrapped.decode(wrapped.encode(x, "v")), inner.decode(inner.encode(x, "v")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_kc_keys_error_is_within_e4m3_rounding_of_each_channels_scale(dtype):
    codec = named_codec("fp8@kc", CONFIG)
    for tokens in (1, 17, 100):
        x = pre_rope_keys(tokens, seed=tokens).to(dtype)
        enc = codec.encode(x, "k")
        assert enc.codec == "fp8@kc" and len(enc.scales) == 3 * 64 * 2  # one float16 per (head, channel)
        scale = torch.frombuffer(bytearray(enc.scales), dtype=torch.float16).float().reshape(1, 3, 64)
        amax = x.float().abs().amax(dim=0, keepdim=True)  # per (head, channel), over the tokens
        # Rounded up to float16: one ulp, 2^-10 of the value or, for a tiny channel's subnormal scale, 2^-24.
        assert (scale >= amax / 448).all() and (scale <= amax / 448 * (1 + 2.0**-10) + 2.0**-24).all()
        decoded = codec.decode(enc)
        rounding = decoded.float().abs() * (2.0**-8 if dtype == torch.bfloat16 else 2.0**-22)
        bound = torch.maximum(x.float().abs() / 16, scale / 1024) + rounding
        assert ((decoded.float() - x.float()).abs() <= bound).all()


def test_int8_kc_keys_error_is_within_half_a_step_of_each_channel():
    x = pre_rope_keys(100, seed=4)
    codec = named_codec("int8@kc", CONFIG)
    enc = codec.encode(x, "k")
    scale = torch.frombuffer(bytearray(enc.scales), dtype=torch.float16).float().reshape(1, 3, 64)
    error = (codec.decode(enc) - x).abs()
    assert (error <= scale / 2 + x.abs() * 2.0**-22).all()
    assert error[..., 5].max() > 4 * error[..., 6].max()  # the outlier channel on its own, coarser grid


def test_kc_keeps_a_small_channel_beside_an_outlier_channel_that_per_token_fp8_flushes_to_zero():
    """A row spanning more than e4m3's dynamic range: per-token scaling sends its small channels below the smallest
    subnormal; a scale per channel keeps each within e4m3's relative rounding."""
    x = torch.full((40, 1, 8), 1e-3) * torch.linspace(1, 2, 40).view(40, 1, 1)
    x[:, :, 0] = 1e3  # the outlier channel
    small = x[:, :, 1:]
    fp8, fp8_kc = get_codec("fp8"), named_codec("fp8@kc", CONFIG)
    assert torch.equal(fp8.decode(fp8.encode(x, "k"))[:, :, 1:], torch.zeros_like(small))
    assert ((fp8_kc.decode(fp8_kc.encode(x, "k"))[:, :, 1:] - small).abs() <= small / 16).all()


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_kc_values_are_the_codecs_own_bytes_and_the_codec_itself_is_left_alone(name):
    x = pre_rope_keys(17, seed=3)
    variant = named_codec(name + "@kc", CONFIG)
    plain, varied = get_codec(name).encode(x, "v"), variant.encode(x, "v")
    assert (bytes(varied.payload), varied.scales) == (bytes(plain.payload), plain.scales)
    groups = 4 if name == "int8" else 1  # int8: a scale per 16 channels; fp8: per row
    assert len(get_codec(name).encode(x, "k").scales) == 17 * 3 * groups * 2  # the registered codec: per token still
    with pytest.raises(ValueError, match="only fp8 and int8"):
        named_codec("kivi4@kc", CONFIG)


def test_per_channel_keys_quantized_before_rope_keep_the_outlier_channels_apart():
    """What the measurement is for: rotation mixes an outlier channel into its pair's along the tokens, so a
    per-channel quantizer on the rotated keys errs more than on the un-rotated ones (int4 keys, 128 tokens)."""
    pre = pre_rope_keys(128, seed=2)
    cached = engine_rotated(pre, 0)
    after, before = get_codec("int4"), named_codec("int4@prerope", CONFIG)
    error_after = (after.decode(after.encode(cached, "k")) - cached).abs().mean()
    error_before = (before.decode(before.encode(cached, "k")) - cached).abs().mean()
    assert error_before < error_after


def test_bench_codecs_measures_prerope_codecs_but_leaves_them_out_of_the_quality_table(tmp_path, capsys):
    out, table = tmp_path / "codecs.json", tmp_path / "quality.json"
    codecs_bench.main(["--model", "tiny-random", "--codecs", "none,kivi2,kivi2@prerope", "--cache-dtypes",
                       "float16", "--prompts", "1", "--tokens", "2", "--windows", "1", "--repeat", "1", "--json",
                       str(out), "--quality-table", str(table)])
    figures = json.loads(out.read_text())["cache_dtypes"]["float16"]["codecs"]
    assert list(figures) == ["none", "kivi2", "kivi2@prerope"]
    assert figures["kivi2@prerope"]["ratio_to_bf16"] == figures["kivi2"]["ratio_to_bf16"]  # the same bytes
    assert figures["kivi2@prerope"]["mean_kl"] > 0
    assert list(json.loads(table.read_text())["cache_dtypes"]["float16"]) == ["none", "kivi2"]
    with pytest.raises(SystemExit):
        codecs_bench.main(["--codecs", "int3@prerope"])
    assert "codecs must name some of" in capsys.readouterr().err
