"""The int8 KV pool's rows (engine/kv_formats/rows.py): the int8 codec's encoding as they lie, held in the paged
pool, and carried between two int8 pools without a pass over the values.

The native kernels' writes of the same rows are held to ``kv_rows.store`` bit for bit in test_attention.py
(``test_native_cache_write_rounds_as_torch_does``), and their reads in its native-against-PyTorch attention tests.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.parallel.sharded_kv_cache import write_heads
from splitserve.kvtransfer.codecs import get_codec
from splitserve.kvtransfer.handshake import KVLayout
from splitserve.kvtransfer.link_codec import LinkCodecChooser
from splitserve.kvtransfer.wire import ExpectedChunks, decode_chunk, encode_chunks

INT8 = torch.int8


def kv(tokens: int = 37, heads: int = 3, head_dim: int = 64, seed: int = 0) -> torch.Tensor:
    """K/V-like values with the rows a pool meets: outlier channels, an all-zero row, tiny and large rows."""
    x = torch.randn(tokens, heads, head_dim, generator=torch.Generator().manual_seed(seed))
    x[:, :, 5] *= 30  # an outlier channel, as keys have
    x[3, 1] = 0.0
    x[4, 0] *= 1e-6  # scales in float16's subnormal range
    x[5, 2] *= 1e4
    return x


# 64: four groups; 40: a last group of 8 (its groups padded to divide and multiply); 16: one group a row
@pytest.mark.parametrize("head_dim, width", [(64, 72), (40, 46), (16, 18)])
def test_a_rows_codes_and_scale_are_the_int8_codecs_payload_and_scales_bit_for_bit(head_dim, width):
    x = kv(head_dim=head_dim)
    rows = kv_rows.store(x, INT8)
    assert rows.shape == (37, 3, width) and rows.dtype == INT8  # the codes, then a float16 scale per group
    codec = get_codec("int8")
    encoded = codec.encode(x, "k")
    codes, scales = kv_rows.split(rows)
    assert bytes(encoded.payload) == codes.contiguous().numpy().tobytes()
    assert encoded.scales == scales.numpy().tobytes()
    assert torch.equal(codec.decode(encoded), kv_rows.load(rows))  # and both read them back alike


@pytest.mark.parametrize("head_dim", [64, 40])
def test_rows_read_back_within_half_a_step_and_the_zero_row_as_zeros(head_dim):
    x = kv(head_dim=head_dim)
    values = kv_rows.load(kv_rows.store(x, INT8))
    assert values.dtype == torch.float32 and values.shape == x.shape and values.is_contiguous()
    _, scales = kv_rows.split(kv_rows.store(x, INT8))
    assert scales.shape == (37, 3, -(-head_dim // 16))  # a scale per 16 channels
    step = scales.float().repeat_interleave(16, -1)[..., :head_dim]
    assert ((values - x).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(values[3, 1], torch.zeros(head_dim))


def test_rows_of_the_pools_own_dtype_pass_unchanged_and_split_and_join_are_inverse():
    rows = kv_rows.store(kv(), INT8)
    assert kv_rows.store(rows, INT8) is rows
    assert torch.equal(kv_rows.join(*kv_rows.split(rows)), rows)
    assert kv_rows.head_dim_of(rows) == 64 and kv_rows.row_width(INT8, 64) == 72
    for head_dim in (8, 16, 72, 80, 128, 256):  # a last group of 8 where head_dim is not a multiple of 16
        width = kv_rows.row_width(INT8, head_dim)
        assert width == head_dim + 2 * -(-head_dim // 16)
        assert kv_rows.head_dim_of(torch.empty(1, width, dtype=INT8)) == head_dim
        assert kv_rows.head_dim_of(kv_rows.store(kv(head_dim=head_dim), INT8)) == head_dim
    with pytest.raises(ValueError, match="holds no whole head_dim"):
        kv_rows.head_dim_of(torch.empty(1, 73, dtype=INT8))
    half = kv_rows.store(kv(), torch.float16)
    assert half.dtype == torch.float16 and kv_rows.head_dim_of(half) == 64


def test_a_value_past_float16s_scales_saturates_instead_of_failing_the_write():
    x = torch.zeros(1, 1, 8)
    x[0, 0, 0] = 1e7  # amax / 127 > 65504
    rows = kv_rows.store(x, INT8)
    codes, scales = kv_rows.split(rows)
    assert scales.tolist() == [[[torch.finfo(torch.float16).max]]] and codes[0, 0, 0].item() == 127


CONFIG = ModelConfig(name="rows", vocab_size=16, hidden_size=96, intermediate_size=32, num_layers=2, num_heads=3,
                     num_kv_heads=3, head_dim=64)


def test_an_int8_pool_holds_178x_the_tokens_of_a_float16_one_and_reads_back_its_values():
    half = PagedKVCache(CONFIG, 8, 16, "float16")
    pool = PagedKVCache(CONFIG, 8, 16, "int8")
    assert half.bytes_per_block() / pool.bytes_per_block() == pytest.approx(128 / 72)
    assert pool.element_size == pytest.approx(72 / 64)
    x = kv(tokens=20)
    slots = pool.slots([5, 2], 0, 20)
    pool.write(1, "v", slots, x)
    assert torch.equal(pool.read_rows(1, "v", slots), kv_rows.store(x, INT8))
    values = pool.read(1, "v", slots)
    assert values.dtype == torch.float32 and torch.equal(values, kv_rows.load(kv_rows.store(x, INT8)))
    copy = pool.slots([7, 0], 0, 20)
    pool.write_rows(1, "v", copy, pool.read_rows(1, "v", slots))
    assert torch.equal(pool.read_rows(1, "v", copy), pool.read_rows(1, "v", slots))
    with pytest.raises(ValueError, match="not this pool's"):
        pool.write_rows(1, "v", copy, x)


def test_a_push_between_int8_pools_carries_the_rows_as_they_lie():
    rows = kv_rows.store(kv(tokens=300), INT8)
    codec = get_codec("int8")
    chunks = encode_chunks("req", 1, "k", 0, 300, rows, codec, 300, max_chunk_bytes=8192)
    assert len(chunks) > 1 and sum(c.nbytes for c in chunks) == 300 * 3 * 72
    expected = ExpectedChunks("req", 2, 3, 64, 300, frozenset({"int8"}))
    got = [decode_chunk(c, expected, pool_dtype=INT8) for c in chunks]
    assert torch.equal(torch.cat([d.tensor for d in got]), rows)
    # A float pool receiving the same push gets the rows' values.
    values = torch.cat([decode_chunk(c, expected, pool_dtype=torch.float16).tensor for c in chunks])
    assert values.dtype == torch.float32 and torch.equal(values, kv_rows.load(rows))


def test_a_lossy_codecs_values_are_quantized_into_an_int8_pool_and_int8_rows_read_back_into_a_float_one():
    x = torch.randn(40, 3, 64, generator=torch.Generator().manual_seed(5))
    expected = ExpectedChunks("req", 2, 3, 64, 40, frozenset({"kivi4", "int8"}))
    pool = PagedKVCache(CONFIG, 8, 16, "int8")
    slots = pool.slots([3, 4, 6], 0, 40)
    for chunk in encode_chunks("req", 0, "k", 0, 40, x, get_codec("kivi4"), 40):
        decoded = decode_chunk(chunk, expected, pool_dtype=INT8)
        assert decoded.tensor.dtype == torch.float32  # values, not rows
        write_heads(pool, 0, "k", slots[decoded.token_start:decoded.token_end], decoded.tensor, decoded.heads)
    assert (pool.read(0, "k", slots) - x).abs().max() < 0.3  # kivi4's step and int8's, well under x's spread
    half = PagedKVCache(CONFIG, 8, 16, "float16")
    rows = pool.read_rows(0, "k", slots)
    for chunk in encode_chunks("req", 0, "k", 0, 40, rows, get_codec("int8"), 40):
        decoded = decode_chunk(chunk, expected, pool_dtype=torch.float16)
        write_heads(half, 0, "k", slots[decoded.token_start:decoded.token_end], decoded.tensor, decoded.heads)
    assert torch.equal(half.read(0, "k", slots), pool.read(0, "k", slots).half())


def test_auto_picks_the_codec_that_carries_an_int8_pools_rows():
    layout = KVLayout("rows", 2, 3, 64, block_size=16, cache_dtype="int8")
    chooser = LinkCodecChooser(layout, None, 0.99)
    accepted = ["none", "none+zstd", "int8", "kivi4"]
    assert chooser.choose("decode:1", 512, accepted) == "int8"  # a link not measured yet
    chooser.observe("decode:1", 10_000_000, 0.01)
    assert chooser.choose("decode:1", 512, accepted) == "int8"  # and a fast one: it is also the smallest
    assert chooser.raw_bytes(10) == 2 * 2 * 10 * 3 * 64 * 4  # the pool's values read back as float32
    assert chooser.choose("decode:1", 512, ["none"]) == "none"


def test_none_from_an_int8_pool_carries_its_rows_and_from_a_float_pool_its_values():
    """``none`` asks for the pool's KV without further loss: from an int8 pool that is its rows as they lie (the int8
    codec's bytes, a quarter of their float32 values'), where the decode pod takes them; else the values."""
    int8 = LinkCodecChooser(KVLayout("rows", 2, 3, 64, block_size=16, cache_dtype="int8"), None, 1.0)
    assert int8.lossless(["none", "int8"]) == "int8"
    assert int8.lossless(["none"]) == "none"
    half = LinkCodecChooser(KVLayout("rows", 2, 3, 64, block_size=16, cache_dtype="float16"), None, 1.0)
    assert half.lossless(["none", "int8"]) == "none"
