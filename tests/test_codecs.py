"""KV codecs: round trips, per-codec error bounds, exact sizes, zstd, errors, and lazy loading of codec modules."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from splitserve.kvtransfer import EncodedKV, KVSpan, available_codecs, get_codec
from splitserve.kvtransfer.codecs.kivi import Kivi4Codec

REPO_ROOT = Path(__file__).resolve().parents[1]
HEADS, HEAD_DIM = 3, 64  # SmolLM2-135M's KV layout
TOKEN_COUNTS = (1, 17, 100)  # one token, a partial key group, three full groups and a tail
DTYPES = (torch.float32, torch.bfloat16)
BASE_CODECS = ("none", "bf16", "fp8", "int8", "int4", "kivi8", "kivi4", "kivi2")
ALL_CODECS = BASE_CODECS + tuple(name + "+zstd" for name in BASE_CODECS)
KEY_GROUP = 32


def kv_like(tokens: int, kind: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """A [T, 3, 64] tensor shaped like real KV: keys carry outlier channels with large offsets, values do not."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator)
    if kind == "k":
        outlier_offset = torch.zeros(HEADS, HEAD_DIM)
        outlier_offset[:, ::16] = 12.0  # 4 channels per head sit far from zero, as in Llama-family keys
        x = x * 1.5 + outlier_offset
    return x.to(dtype)


def output_rounding(decoded: torch.Tensor) -> torch.Tensor:
    """Per-element bound on the final cast to the cache dtype plus float32 arithmetic (half an ulp, with margin)."""
    relative = 2.0**-8 if decoded.dtype == torch.bfloat16 else 2.0**-22
    return decoded.float().abs() * relative


def float16_scales(enc: EncodedKV) -> torch.Tensor:
    """A per-row or per-group codec's scales [T, H, G] (G = 1: per row) as float32."""
    tokens, heads, _ = enc.shape
    return torch.frombuffer(bytearray(enc.scales), dtype=torch.float16).float().reshape(tokens, heads, -1)


# --- registry ----------------------------------------------------------------------------------------------------


def test_available_codecs_lists_every_name_with_and_without_zstd():
    assert available_codecs() == list(ALL_CODECS)


def test_unknown_codec_name_error_lists_known_names():
    with pytest.raises(ValueError, match="unknown KV codec 'int3'") as err:
        get_codec("int3")
    for name in ALL_CODECS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="unknown KV codec 'zstd'"):
        get_codec("zstd")
    with pytest.raises(ValueError, match="unknown KV codec 'int8\\+zstd\\+zstd'"):
        get_codec("int8+zstd+zstd")


def test_codec_names_match_registry_names():
    for name in ALL_CODECS:
        assert get_codec(name).name == name


def test_codec_modules_load_only_when_requested():
    script = textwrap.dedent(
        """
        import sys
        import splitserve.kvtransfer
        lazy = ("splitserve.kvtransfer.codecs.kivi", "splitserve.kvtransfer.codecs.zstd",
                "splitserve.kvtransfer.codecs.symmetric", "zstandard")
        assert not [m for m in lazy if m in sys.modules], [m for m in lazy if m in sys.modules]
        splitserve.kvtransfer.get_codec("int4")
        assert "splitserve.kvtransfer.codecs.kivi" in sys.modules
        assert "splitserve.kvtransfer.codecs.zstd" not in sys.modules and "zstandard" not in sys.modules
        splitserve.kvtransfer.get_codec("int8+zstd")
        assert "splitserve.kvtransfer.codecs.zstd" in sys.modules and "zstandard" in sys.modules
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_decoding_a_received_message_in_place_warns_nothing():
    """A decode pod reads a message's bytes as a tensor without copying them (tensor_from_bytes): its log stays free of
    torch's warning that those bytes are not writable, in a fresh process, where torch would give it once."""
    script = textwrap.dedent(
        """
        import dataclasses
        import torch
        from splitserve.kvtransfer import get_codec
        codec = get_codec("int8")
        enc = codec.encode(torch.randn(4, 3, 64), "k")
        received = dataclasses.replace(enc, payload=bytes(enc.payload), scales=bytes(enc.scales))
        print(float((codec.decode(received, torch.device("cpu")) != 0).float().mean()) > 0.5)
        """
    )
    result = subprocess.run([sys.executable, "-W", "default", "-c", script], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
    assert "not writable" not in result.stderr, result.stderr


# --- round trips -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["k", "v"])
def test_round_trip_keeps_shape_dtype_and_metadata(name, tokens, dtype, kind):
    codec = get_codec(name)
    x = kv_like(tokens, kind, dtype)
    enc = codec.encode(x, kind)
    assert (enc.codec, enc.kind, enc.dtype, enc.shape) == (name, kind, str(dtype)[6:], (tokens, HEADS, HEAD_DIM))
    decoded = codec.decode(enc, device="cpu")
    assert decoded.dtype == dtype and decoded.shape == x.shape and decoded.device.type == "cpu"


@pytest.mark.parametrize("name", ["none", "none+zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_none_is_lossless(name, dtype):
    codec = get_codec(name)
    for tokens in TOKEN_COUNTS:
        for kind in "kv":
            x = kv_like(tokens, kind, dtype)
            assert torch.equal(codec.decode(codec.encode(x, kind)), x)


@pytest.mark.parametrize("name", ["bf16", "bf16+zstd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bf16_is_exact_to_bfloat16_rounding(name, dtype):
    codec = get_codec(name)
    for tokens in TOKEN_COUNTS:
        x = kv_like(tokens, "k", dtype)
        assert torch.equal(codec.decode(codec.encode(x, "k")), x.to(torch.bfloat16).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["k", "v"])
def test_int8_error_is_at_most_half_the_stored_scale(dtype, kind):
    codec = get_codec("int8")
    for tokens in TOKEN_COUNTS:
        x = kv_like(tokens, kind, dtype, seed=tokens)
        enc = codec.encode(x, kind)
        scale = float16_scales(enc).repeat_interleave(16, dim=-1)  # [T, H, D]: each channel's group's scale
        amax = x.float().abs().view(*x.shape[:2], -1, 16).amax(dim=-1).repeat_interleave(16, dim=-1)
        # A scale per 16 channels: their amax / 127 rounded up to float16, never smaller, at most one float16 ulp
        # (2^-10) larger.
        assert (scale >= amax / 127).all()
        assert (scale <= amax / 127 * (1 + 2.0**-10)).all()
        decoded = codec.decode(enc)
        error = (decoded.float() - x.float()).abs()
        assert (error <= scale / 2 + output_rounding(decoded)).all()
        assert error.max() > 0.4 * scale.min()  # the bound is tight, not vacuous


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["k", "v"])
def test_fp8_error_is_within_e4m3_rounding_of_the_scaled_value(dtype, kind):
    codec = get_codec("fp8")
    for tokens in TOKEN_COUNTS:
        x = kv_like(tokens, kind, dtype, seed=tokens)
        enc = codec.encode(x, kind)
        scale = float16_scales(enc)
        amax = x.float().abs().amax(dim=-1, keepdim=True)
        assert (scale >= amax / 448).all() and (scale <= amax / 448 * (1 + 2.0**-10)).all()
        decoded = codec.decode(enc)
        # e4m3: 3 mantissa bits, so half an ulp is <= 2^-4 of the value; subnormals (|x/s| < 2^-6) are 2^-9 apart.
        bound = torch.maximum(x.float().abs() / 16, scale / 1024)
        assert ((decoded.float() - x.float()).abs() <= bound + output_rounding(decoded)).all()


def test_fp8_decode_reads_every_finite_e4m3_code_as_torch_does():
    finite_codes = bytes(code for code in range(256) if code & 0x7F != 0x7F)  # 0x7F and 0xFF are NaN
    unit_scale = torch.ones(1, dtype=torch.float16).numpy().tobytes()
    enc = EncodedKV("fp8", "v", "float32", (1, 1, 254), finite_codes, unit_scale)
    expected = torch.frombuffer(bytearray(finite_codes), dtype=torch.float8_e4m3fn).float().reshape(1, 1, 254)
    assert torch.equal(get_codec("fp8").decode(enc), expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_values_error_is_within_half_a_step_of_each_row(dtype):
    codec = get_codec("int4")
    for tokens in TOKEN_COUNTS:
        x = kv_like(tokens, "v", dtype, seed=tokens)
        decoded = codec.decode(codec.encode(x, "v"))
        x32 = x.float()
        row_lo, row_hi = x32.amin(-1, keepdim=True), x32.amax(-1, keepdim=True)
        # Row ends are stored as float16 rounded outward: the range widens by at most one ulp (2^-10) at each end.
        coded_range = row_hi - row_lo + 2.0**-10 * (row_lo.abs() + row_hi.abs())
        error = (decoded.float() - x32).abs()
        assert (error <= coded_range / 30 + output_rounding(decoded)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("key_group", [KEY_GROUP, 16, 5])  # int4's default, then KIVI's key_group setting
def test_int4_keys_error_is_within_half_a_step_of_each_channel_group(dtype, key_group):
    codec = get_codec("int4") if key_group == KEY_GROUP else Kivi4Codec(sinks=0, window=0, key_group=key_group)
    for tokens in TOKEN_COUNTS:
        x = kv_like(tokens, "k", dtype, seed=tokens)
        encoded = codec.encode(x, "k")
        assert encoded.nbytes == sum(codec.encoded_nbytes(tuple(x.shape), "k", encoded.dtype))
        decoded = codec.decode(encoded)
        x32 = x.float()
        for start in range(0, tokens, key_group):  # groups of key_group tokens, the last one shorter
            group, group_decoded = x32[start : start + key_group], decoded[start : start + key_group]
            channel_lo, channel_hi = group.amin(0), group.amax(0)  # [H, D]
            head_lo, head_hi = channel_lo.amin(-1, keepdim=True), channel_hi.amax(-1, keepdim=True)  # [H, 1]
            head_range = head_hi - head_lo + 2.0**-10 * (head_lo.abs() + head_hi.abs())  # float16, outward
            # Channel ends are uint8 codes on the head range's 255-step grid, rounded outward: +2 steps at most.
            coded_range = channel_hi - channel_lo + 2 * head_range / 255
            error = (group_decoded.float() - group).abs()
            assert (error <= coded_range / 30 + output_rounding(group_decoded)).all()


def test_int4_keys_are_quantized_per_channel_not_per_token():
    """Ordinary channels keep a small error next to an outlier channel, which per-token scaling would not allow."""
    x = kv_like(64, "k")
    error = (get_codec("int4").decode(get_codec("int4").encode(x, "k")) - x).abs()
    ordinary = torch.ones(HEAD_DIM, dtype=torch.bool)
    ordinary[::16] = False
    per_token_step = (x.amax(-1) - x.amin(-1)).min() / 15  # the finest step per-token quantization could use
    assert error[..., ordinary].max() < per_token_step / 2


@pytest.mark.parametrize("name", ALL_CODECS)
def test_zero_tensors_and_zero_rows_decode_exactly(name):
    codec = get_codec(name)
    zeros = torch.zeros(17, HEADS, HEAD_DIM)
    partly_zero = kv_like(17, "v")
    partly_zero[3, 1] = 0.0  # one (token, head) row of zeros: scale 0 must not divide by zero
    for kind in "kv":
        assert torch.equal(codec.decode(codec.encode(zeros, kind)), zeros)
        decoded = codec.decode(codec.encode(partly_zero, kind))
        assert torch.isfinite(decoded).all()
        if kind == "v":  # values are quantized per row, so the zero row comes back exactly
            assert torch.equal(decoded[3, 1], torch.zeros(HEAD_DIM))


@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_odd_shapes_round_trip(name):
    codec = get_codec(name)
    x = torch.randn(5, 1, 3)  # 15 elements: int4 pads the last byte's high nibble
    for kind in "kv":
        decoded = codec.decode(codec.encode(x, kind))
        assert decoded.shape == x.shape
        assert (decoded - x).abs().max() < 0.5


# --- sizes -------------------------------------------------------------------------------------------------------


def test_bytes_per_element_formulas_and_size_targets():
    def bpe(name, dtype=torch.float32):
        return get_codec(name).bytes_per_element(HEAD_DIM, dtype)

    assert bpe("none") == 4.0 and bpe("none", torch.bfloat16) == 2.0 and bpe("bf16") == 2.0
    assert bpe("int8") == 1 + 2 / 16 and bpe("fp8") == 1 + 2 / 64  # a scale per 16 channels, per row
    assert bpe("int4") == ((0.5 + (4 + 2 * 64) / (32 * 64)) + (0.5 + 4 / 64)) / 2
    assert bpe("bf16") / bpe("int8") >= 1.75 and bpe("bf16") / bpe("fp8") >= 1.9
    assert bpe("bf16") / bpe("int4") >= 3.5
    for name in BASE_CODECS:
        assert bpe(name + "+zstd") == bpe(name)


@pytest.mark.parametrize("name", BASE_CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sizes_are_exactly_as_bytes_per_element_predicts(name, dtype):
    codec = get_codec(name)
    tokens = 2 * KEY_GROUP  # full key groups: the steady state bytes_per_element describes
    mid_prompt = KVSpan(100, 1000)  # clear of the tokens KIVI keeps at the prompt's ends
    encoded = [codec.encode(kv_like(tokens, kind, dtype), kind, mid_prompt) for kind in "kv"]
    numel = tokens * HEADS * HEAD_DIM
    assert sum(enc.nbytes for enc in encoded) == 2 * numel * codec.bytes_per_element(HEAD_DIM, dtype)


@pytest.mark.parametrize(
    "name, kind, tokens, expected",
    [
        ("none", "k", 17, (17 * 3 * 64 * 4, 0)),
        ("bf16", "v", 17, (17 * 3 * 64 * 2, 0)),
        ("int8", "k", 17, (17 * 3 * 64, 17 * 3 * 4 * 2)),
        ("fp8", "v", 1, (3 * 64, 3 * 2)),
        ("int4", "v", 17, (17 * 3 * 32, 17 * 3 * 4)),
        ("int4", "k", 17, (17 * 3 * 32, 1 * 3 * (4 + 2 * 64))),
        ("int4", "k", 100, (100 * 3 * 32, 4 * 3 * (4 + 2 * 64))),
    ],
)
def test_encoded_sizes_for_ragged_token_counts(name, kind, tokens, expected):
    codec = get_codec(name)
    enc = codec.encode(kv_like(tokens, kind), kind)
    assert (len(enc.payload), len(enc.scales)) == expected
    assert codec.encoded_nbytes(enc.shape, kind, enc.dtype) == expected


def test_int4_pads_an_odd_element_count_to_whole_bytes():
    enc = get_codec("int4").encode(torch.randn(1, 1, 3), "v")
    assert (len(enc.payload), len(enc.scales)) == (2, 4)


# --- zstd --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BASE_CODECS)
def test_zstd_compresses_zeros_and_decodes_identically(name):
    zeros = torch.zeros(100, HEADS, HEAD_DIM)
    plain, zstd = get_codec(name), get_codec(name + "+zstd")
    for kind in "kv":
        enc = zstd.encode(zeros, kind)
        assert enc.nbytes < plain.encode(zeros, kind).nbytes / 20
        assert torch.equal(zstd.decode(enc), zeros)


@pytest.mark.parametrize("name", BASE_CODECS)
def test_zstd_is_lossless_over_its_inner_codec(name):
    plain, zstd = get_codec(name), get_codec(name + "+zstd")
    for kind in "kv":
        x = kv_like(100, kind, torch.bfloat16)
        assert torch.equal(zstd.decode(zstd.encode(x, kind)), plain.decode(plain.encode(x, kind)))


def test_zstd_level_is_configurable_and_checked():
    codec = get_codec("int8+zstd", zstd_level=19)
    assert codec.level == 19 and get_codec("int8+zstd").level == 3
    x = kv_like(17, "k")
    int8 = get_codec("int8")
    assert torch.equal(codec.decode(codec.encode(x, "k")), int8.decode(int8.encode(x, "k")))
    with pytest.raises(ValueError, match="zstd level must be in 1..22, got 23"):
        get_codec("int8+zstd", zstd_level=23)


def test_zstd_rejects_a_corrupt_frame():
    codec = get_codec("int8+zstd")
    enc = codec.encode(kv_like(17, "k"), "k")
    with pytest.raises(ValueError, match="corrupt zstd frame"):
        codec.decode(dataclasses.replace(enc, payload=b"not a zstd frame"))
    frame_of_wrong_size = get_codec("int8+zstd").encode(kv_like(16, "k"), "k").payload
    with pytest.raises(ValueError, match="zstd frame declares 3072 bytes, the shape needs 3264"):
        codec.decode(dataclasses.replace(enc, payload=frame_of_wrong_size))


# --- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(name, bad):
    x = kv_like(17, "k")
    x[5, 2, 7] = bad
    with pytest.raises(ValueError, match="inf or nan"):
        get_codec(name).encode(x, "k")


def test_finite_input_whose_sum_overflows_is_accepted():
    x = torch.full((2, 1, 2), 3e38)  # finite, but its float32 sum is inf
    assert torch.equal(get_codec("none").decode(get_codec("none").encode(x, "k")), x)


def test_values_beyond_float16_scales_are_refused():
    with pytest.raises(ValueError, match="too large for float16 scales"):
        get_codec("int8").encode(torch.full((1, 1, 4), 1e7), "k")  # scale 1e7 / 127 > 65504


def test_bad_inputs_are_refused():
    codec = get_codec("int8")
    with pytest.raises(ValueError, match="kind must be one of"):
        codec.encode(kv_like(1, "k"), "q")
    with pytest.raises(ValueError, match="must be \\[T, H, D\\]"):
        codec.encode(torch.randn(4, 64), "k")
    with pytest.raises(ValueError, match="must be \\[T, H, D\\]"):
        codec.encode(torch.randn(0, 3, 64), "k")
    with pytest.raises(ValueError, match="unsupported KV dtype torch.float64"):
        codec.encode(torch.randn(1, 3, 64, dtype=torch.float64), "k")


def test_bad_encodings_are_refused():
    enc = get_codec("int8").encode(kv_like(17, "k"), "k")
    with pytest.raises(ValueError, match="codec 'int4' cannot decode a tensor encoded with 'int8'"):
        get_codec("int4").decode(enc)
    with pytest.raises(ValueError, match="needs \\(payload, scales\\) of \\(3264, 408\\) bytes, got \\(3263, 408\\)"):
        get_codec("int8").decode(dataclasses.replace(enc, payload=enc.payload[:-1]))
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        get_codec("int8").decode(dataclasses.replace(enc, dtype="float64"))
    with pytest.raises(ValueError, match="kind must be one of"):
        get_codec("int8").decode(dataclasses.replace(enc, kind="x"))


# --- devices -----------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ALL_CODECS)
def test_cuda_encoding_matches_cpu_and_decodes_on_either_device(name):
    codec = get_codec(name)
    for kind in "kv":
        x = kv_like(100, kind, torch.bfloat16)
        on_cpu, on_cuda = codec.encode(x, kind), codec.encode(x.cuda(), kind)
        assert on_cuda == on_cpu  # same bytes: every step is exactly rounded elementwise math
        decoded = codec.decode(on_cuda, device="cuda")
        assert decoded.device.type == "cuda"
        assert torch.equal(decoded.cpu(), codec.decode(on_cpu))


# --- KIVI: kept tokens, bit widths -------------------------------------------------------------------------------

KIVI_BITS = {"kivi8": 8, "kivi4": 4, "kivi2": 2, "int4": 4}


@pytest.mark.parametrize(
    "span, tokens, expected",
    [
        (None, 100, (4, 32)),  # a whole prompt: its sinks and its window
        (None, 30, (4, 26)),  # shorter than sinks + window: every token kept
        (KVSpan(0, 1000), 100, (4, 0)),  # the prompt's start
        (KVSpan(2, 1000), 100, (2, 0)),  # two of the four sinks
        (KVSpan(500, 1000), 100, (0, 0)),  # the middle: nothing kept
        (KVSpan(900, 1000), 100, (0, 32)),  # the prompt's end
        (KVSpan(950, 1000), 40, (0, 22)),  # reaches into the window: the rows from token 968 on
        (KVSpan(970, 1000), 30, (0, 30)),  # inside the window
    ],
)
def test_kivi_keeps_the_prompts_first_and_last_tokens(span, tokens, expected):
    assert get_codec("kivi4").kept_rows(tokens, span) == expected
    assert get_codec("int4").kept_rows(tokens, span) == (0, 0)


@pytest.mark.parametrize("name", ["kivi8", "kivi4", "kivi2"])
@pytest.mark.parametrize("kind", ["k", "v"])
def test_kivi_round_trips_the_kept_tokens_exactly_and_lays_out_its_bytes(name, kind):
    codec = get_codec(name)
    x = kv_like(100, kind, torch.float16)
    for span in (None, KVSpan(0, 1000), KVSpan(880, 1000), KVSpan(400, 1000)):
        enc = codec.encode(x, kind, span)
        head, tail = codec.kept_rows(100, span)
        middle = 100 - head - tail
        packed = -(-middle * HEADS * HEAD_DIM * KIVI_BITS[name] // 8)
        assert len(enc.payload) == packed + (head + tail) * HEADS * HEAD_DIM * 2
        kept = enc.payload[packed:]
        assert kept == torch.cat([x[:head], x[100 - tail:]]).numpy().tobytes()
        decoded = codec.decode(enc)
        assert decoded.dtype == torch.float16 and decoded.shape == x.shape
        assert torch.equal(decoded[:head], x[:head]) and torch.equal(decoded[100 - tail:], x[100 - tail:])
        assert (len(enc.payload), len(enc.scales)) == codec.encoded_nbytes(enc.shape, kind, enc.dtype, span)


@pytest.mark.parametrize("name", ["kivi8", "kivi4", "kivi2"])
def test_kivi_error_bounds_per_bit_width(name):
    """Values within half a step of their row's range, keys of their channel group's coded range, at 2^bits - 1
    steps: the middle tokens of a long prompt, where nothing is kept."""
    codec, levels = get_codec(name), 2 ** KIVI_BITS[name] - 1
    mid_prompt = KVSpan(100, 1000)
    for tokens in TOKEN_COUNTS:
        v = kv_like(tokens, "v", seed=tokens)
        decoded = codec.decode(codec.encode(v, "v", mid_prompt))
        coded_range = v.amax(-1, keepdim=True) - v.amin(-1, keepdim=True) + 2.0**-10 * (
            v.amin(-1, keepdim=True).abs() + v.amax(-1, keepdim=True).abs())
        assert ((decoded - v).abs() <= coded_range / (2 * levels) + output_rounding(decoded)).all()
        k = kv_like(tokens, "k", seed=tokens)
        decoded = codec.decode(codec.encode(k, "k", mid_prompt))
        for start in range(0, tokens, KEY_GROUP):
            group, group_decoded = k[start:start + KEY_GROUP], decoded[start:start + KEY_GROUP]
            channel_lo, channel_hi = group.amin(0), group.amax(0)
            head_lo, head_hi = channel_lo.amin(-1, keepdim=True), channel_hi.amax(-1, keepdim=True)
            head_range = head_hi - head_lo + 2.0**-10 * (head_lo.abs() + head_hi.abs())
            coded_range = channel_hi - channel_lo + 2 * head_range / 255
            error = (group_decoded - group).abs()
            assert (error <= coded_range / (2 * levels) + output_rounding(group_decoded)).all()


def test_kivi_error_shrinks_with_more_bits():
    x = kv_like(100, "k")
    errors = [(get_codec(name).decode(get_codec(name).encode(x, "k", KVSpan(100, 1000))) - x).abs().mean()
              for name in ("kivi2", "kivi4", "kivi8")]
    assert errors[0] > 3 * errors[1] > 9 * errors[2]


def test_a_span_outside_its_prompt_is_refused():
    with pytest.raises(ValueError, match="do not fit a prompt of 50"):
        get_codec("kivi4").encode(kv_like(10, "v"), "v", KVSpan(45, 50))
    enc = get_codec("kivi4").encode(kv_like(10, "v"), "v", KVSpan(40, 50))
    with pytest.raises(ValueError, match="do not fit a prompt of 45"):
        get_codec("kivi4").decode(dataclasses.replace(enc, span=KVSpan(40, 45)))
