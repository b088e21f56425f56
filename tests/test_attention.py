"""Paged attention against a dense reference, the per-step metadata it plans from, and the KV cache's sizing.

Each scenario gives every sequence a cached prefix (written into the cache beforehand) and a number of new tokens;
``paged_attention`` must write the new K/V at the right slots and return what dense causal attention over the
whole sequence returns for the new tokens.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import CacheConfig, ModelConfig
from splitserve.engine.kv_cache import PagedKVCache, bytes_per_block, num_blocks_for_budget
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.model.attention import AttentionMetadata, paged_attention

BLOCK_SIZE = 4
NUM_BLOCKS = 40
HEAD_DIM = 8


def _dense_reference(q, keys, values, prefix: int, scale: float) -> torch.Tensor:
    """q: [n, Hq, D] at positions prefix..prefix+n-1; keys, values: [prefix + n, Hkv, D]. Float64 loops."""
    n, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r in range(n):
        for h in range(num_heads):
            k = keys[: prefix + r + 1, h // group].double()  # [ctx, D]
            v = values[: prefix + r + 1, h // group].double()
            probs = torch.softmax(k @ q[r, h].double() * scale, dim=0)
            out[r, h] = probs @ v
    return out


def _run_scenario(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, seed: int = 0,
                  cache_dtype: torch.dtype = torch.float32, meta: AttentionMetadata | None = None, kernels=None):
    """seqs: (cached prefix length, new tokens) per sequence; the seed draws q/k/v, the block layout is fixed.
    ``kernels``: the native CPU kernels, or None for the PyTorch path.
    Returns (output, reference, caches, new k and v, meta)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(99)).tolist()  # shuffled block ids
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, kv_rows.row_width(cache_dtype, HEAD_DIM))
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    tables, full_k, full_v = [], [], []
    for prefix, n in seqs:
        total = prefix + n
        tables.append([pool.pop() for _ in range(-(-total // BLOCK_SIZE))])
        full_k.append(torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen))
        full_v.append(torch.randn(total, num_kv_heads, HEAD_DIM, generator=gen))
        for p in range(prefix):  # the cached prefix, as earlier steps left it
            block, offset = tables[-1][p // BLOCK_SIZE], p % BLOCK_SIZE
            k_cache[block, offset] = kv_rows.store(full_k[-1][p], cache_dtype)
            v_cache[block, offset] = kv_rows.store(full_v[-1][p], cache_dtype)
    q = torch.randn(sum(n for _, n in seqs), num_heads, HEAD_DIM, generator=gen)
    k_new = torch.cat([k[prefix:] for k, (prefix, _) in zip(full_k, seqs)])
    v_new = torch.cat([v[prefix:] for v, (prefix, _) in zip(full_v, seqs)])
    meta = meta or AttentionMetadata.build([n for _, n in seqs], [p + n for p, n in seqs], tables, BLOCK_SIZE)
    scale = HEAD_DIM**-0.5
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale, kernels)
    refs, start = [], 0
    for (prefix, n), k, v in zip(seqs, full_k, full_v):
        k, v = (kv_rows.load(kv_rows.store(x, cache_dtype), torch.float32) for x in (k, v))  # as the cache holds them
        refs.append(_dense_reference(q[start : start + n], k, v, prefix, scale))
        start += n
    return out, torch.cat(refs), (k_cache, v_cache), (k_new, v_new), meta


SCENARIOS = {
    "decode_one_seq": [(9, 1)],
    "decode_one_seq_block_aligned": [(7, 1)],
    "decode_batch_ragged": [(2, 1), (12, 1), (5, 1), (7, 1)],
    "decode_batch_equal_lengths": [(11, 1), (11, 1)],
    "prefill_fresh": [(0, 7)],
    "prefill_fresh_batch": [(0, 5), (0, 9), (0, 2)],
    "prefill_after_cached_prefix": [(8, 5)],
    "prefill_chunk_mid_block": [(6, 7)],
    "single_token_prompt": [(0, 1), (0, 6)],
    "mixed": [(0, 6), (10, 1), (5, 4), (3, 1), (0, 3)],
}


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 1), (2, 2)])
def test_matches_dense_reference(name, num_heads, num_kv_heads, attention_kernels):
    out, ref, _, _, _ = _run_scenario(SCENARIOS[name], num_heads, num_kv_heads, kernels=attention_kernels)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert (out.double() - ref).abs().max().item() <= 1e-5


def test_one_plan_serves_every_layer(attention_kernels):
    # A step's metadata (and its gather buffers) is shared by all layers: layer 1 must not see layer 0's context.
    seqs = SCENARIOS["mixed"]
    out0, ref0, _, _, meta = _run_scenario(seqs, 4, 2, seed=1, kernels=attention_kernels)
    out1, ref1, _, _, _ = _run_scenario(seqs, 4, 2, seed=2, meta=meta, kernels=attention_kernels)
    assert (out0.double() - ref0).abs().max().item() <= 1e-5
    assert (out1.double() - ref1).abs().max().item() <= 1e-5
    assert (ref0 - ref1).abs().max().item() > 0.1


def test_new_kv_lands_in_its_slots_and_nothing_else_changes(attention_kernels):
    seqs = [(5, 3), (9, 1)]
    _, _, (k_cache, v_cache), (k_new, v_new), meta = _run_scenario(seqs, 4, 2, kernels=attention_kernels)
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    torch.testing.assert_close(flat_k[meta.slot_mapping], k_new, rtol=0, atol=0)
    torch.testing.assert_close(flat_v[meta.slot_mapping], v_new, rtol=0, atol=0)
    # Only the sequences' own positions (prefix written by the test, new tokens by paged_attention) are set.
    assert int((flat_k.abs().sum((1, 2)) > 0).sum()) == sum(p + n for p, n in seqs)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.int8])
def test_a_narrower_cache_stores_rounded_kv_and_attends_in_float32(cache_dtype, attention_kernels):
    out, ref, (k_cache, _), (k_new, _), meta = _run_scenario([(6, 1), (4, 3), (9, 1)], 4, 2, cache_dtype=cache_dtype,
                                                             kernels=attention_kernels)
    assert k_cache.dtype == cache_dtype and out.dtype == torch.float32
    assert torch.equal(k_cache.flatten(0, 1)[meta.slot_mapping], kv_rows.store(k_new, cache_dtype))
    assert (out.double() - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_native_cache_write_rounds_as_torch_does(cache_dtype, native_kernels):
    # The native layer input (norm, QKV product, rotary, cache write) with a zero QKV weight and everything at
    # position 0 (rotation by 0) leaves qkv = its bias, so the cache must hold exactly kv_rows.store(bias): ties
    # rounded to even (1 + 2^-8 and 1 + 3 * 2^-8 for bfloat16, 1 + 2^-11 and 1 + 3 * 2^-11 for float16),
    # subnormals, overflow to inf, signs, an int8 row's scale and codes, and every slot where the slot mapping puts
    # it.
    from splitserve.engine.kernels.weight_formats import packed_shape

    num_heads, num_kv_heads, head_dim, hidden, tokens = 2, 2, 8, 16, 3
    kv_width = num_kv_heads * head_dim
    width = (num_heads + 2 * num_kv_heads) * head_dim
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-8), 1e-40, 7e4, -1e5])
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(width, generator=gen) * 10
    bias[num_heads * head_dim : num_heads * head_dim + 8] = special  # k of the first KV head
    bias[-8:] = special.flip(0)  # v of the last KV head
    shape = (4, 4, num_kv_heads, kv_rows.row_width(cache_dtype, head_dim))
    k_cache, v_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    slots = torch.tensor([13, 2, 7])
    qkv = native_kernels.attention_input(
        torch.randn(tokens, hidden, generator=gen), torch.ones(hidden), 1e-6,
        torch.zeros(packed_shape(width, hidden)), bias, torch.zeros(tokens, dtype=torch.long),
        torch.ones(1, head_dim), torch.zeros(1, head_dim), num_heads, num_kv_heads, k_cache, v_cache, slots,
    )
    assert torch.equal(qkv, bias.expand(tokens, width))
    k_new = kv_rows.store(bias[num_heads * head_dim : -kv_width].view(num_kv_heads, head_dim), cache_dtype)
    v_new = kv_rows.store(bias[-kv_width:].view(num_kv_heads, head_dim), cache_dtype)
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    for slot in range(16):
        written = slot in slots.tolist()
        for got, new in ((flat_k[slot], k_new), (flat_v[slot], v_new)):
            assert torch.equal(got.view(torch.uint8), (new if written else torch.zeros_like(new)).view(torch.uint8))


def test_build_slot_mapping_and_padding():
    meta = AttentionMetadata.build(query_lens=[3, 1], seq_lens=[6, 9], block_tables=[[7, 2], [4, 0, 5]], block_size=4)
    # seq 0: positions 3, 4, 5 -> block 7 offset 3, block 2 offsets 0 and 1; seq 1: position 8 -> block 5 offset 0.
    assert meta.slot_mapping.tolist() == [31, 8, 9, 20]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 5]]
    assert meta.is_decode_only is False


def test_plan_decode_only_step():
    meta = AttentionMetadata.build([1, 1], [6, 3], [[7, 2], [4]], block_size=4)
    assert meta.is_decode_only and meta.prefills == []
    group = meta.decode
    assert group.token_index is None and group.num_seqs == 2 and group.context_len == 6
    assert group.tables.tolist() == [[7, 2], [4, 0]]  # two blocks per sequence, padding included
    assert group.seq_lens.tolist() == [6, 3]
    assert group.key_mask.shape == (2, 1, 1, 6)
    assert group.key_mask[:, 0, 0].tolist() == [[True] * 6, [True] * 3 + [False] * 3]


def test_plan_single_sequence_decode_needs_no_mask():
    meta = AttentionMetadata.build([1], [10], [[3, 1, 8]], block_size=4)
    assert meta.decode.key_mask is None and meta.decode.context_len == 10


def test_plan_mixed_step():
    meta = AttentionMetadata.build([4, 1, 3], [4, 7, 9], [[1], [2, 3], [4, 5, 6]], block_size=4)
    assert meta.decode.token_index.tolist() == [4] and meta.decode.tables.tolist() == [[2, 3]]
    fresh, chunk = meta.prefills
    assert (fresh.start, fresh.end, fresh.prefix, fresh.blocks.tolist(), fresh.causal_mask) == (0, 4, 0, [1], None)
    assert (chunk.start, chunk.end, chunk.prefix, chunk.context_len) == (5, 8, 6, 9)
    assert chunk.blocks.tolist() == [4, 5, 6]
    # Prefix of 6: query r (position 6 + r) sees keys 0..6 + r.
    assert chunk.causal_mask.tolist() == [[k <= 6 + r for k in range(9)] for r in range(3)]


CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2)


def test_kv_cache_shapes():
    cache = PagedKVCache(CONFIG, num_blocks=10, block_size=8, dtype=torch.float32)
    assert len(cache.k_blocks) == len(cache.v_blocks) == 3
    assert all(t.shape == (10, 8, 2, 16) and t.dtype == torch.float32 for t in cache.k_blocks + cache.v_blocks)
    assert all(t.abs().sum() == 0 for t in cache.k_blocks + cache.v_blocks)
    # K and V, 3 layers, 8 slots, 2 heads of 16 floats.
    assert cache.bytes_per_block() == 2 * 3 * 8 * 2 * 16 * 4 == 6144
    assert cache.memory_bytes() == 61440


def test_kv_cache_sized_from_budget_or_override():
    budget = CacheConfig(block_size=8, kv_cache_memory_bytes=6144 * 7 + 100, cache_dtype="float32")
    assert PagedKVCache.from_config(CONFIG, budget).num_blocks == 7
    default = PagedKVCache.from_config(CONFIG, CacheConfig(block_size=8, kv_cache_memory_bytes=6144 * 7 + 100))
    assert default.k_blocks[0].dtype == torch.float16 and default.num_blocks == 14  # the default: 2 bytes per element
    assert PagedKVCache.from_config(CONFIG, CacheConfig(block_size=8, num_blocks=3)).num_blocks == 3
    half = PagedKVCache.from_config(CONFIG, CacheConfig(block_size=8, num_blocks=2, cache_dtype="bfloat16"))
    assert half.k_blocks[0].dtype == torch.bfloat16 and half.bytes_per_block() == 3072
    assert bytes_per_block(2, 16, 3, 8, torch.float32) == 6144
    with pytest.raises(ValueError, match="less than one block"):
        num_blocks_for_budget(CONFIG, 8, torch.float32, 6143)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (7, 1, 40)])
def test_native_decode_attention_matches_pytorch_at_model_sizes(block_size, num_heads, num_kv_heads, head_dim,
                                                                 cache_dtype, native_kernels):
    # Model head shapes (SmolLM2's 9 query heads on 3 KV heads of 64; groups of 4 and of 7, which the kernel
    # splits into sets of at most 3 heads; a head of 40, not a multiple of 32) with long, ragged contexts over
    # shuffled blocks: several 256-key chunks per sequence to merge, and (block size 5) chunks that are not a
    # multiple of 8 keys; caches of every dtype the kernels read (16-bit ones widened to float32 on load, int8 rows
    # scaled).
    gen = torch.Generator().manual_seed(7)
    num_blocks, lens = 800, [700, 1, 333, 16, 517]
    k_cache, v_cache = (kv_rows.store(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen),
                                      cache_dtype) for _ in range(2))
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size)
    q, k_new, v_new = (torch.randn(len(lens), h, head_dim, generator=gen) for h in (num_heads, num_kv_heads,
                                                                                      num_kv_heads))
    scale = head_dim**-0.5
    ours = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale, native_kernels)
    theirs = paged_attention(q, k_new, v_new, k_cache, v_cache, meta, scale)
    assert (ours - theirs).abs().max().item() <= 1e-5
    # Each sequence's result is the same alone as in the batch, bit for bit.
    alone = AttentionMetadata.build([1], lens[2:3], tables[2:3], block_size)
    single = paged_attention(q[2:3], k_new[2:3], v_new[2:3], k_cache, v_cache, alone, scale, native_kernels)
    assert torch.equal(single, ours[2:3])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (7, 1, 40)])
def test_native_prefill_attention_matches_pytorch_at_model_sizes(block_size, num_heads, num_kv_heads, head_dim,
                                                                  cache_dtype, native_kernels):
    # Prompts of several 48-row work items over shuffled blocks: a fresh one, one after a cached prefix that ends
    # mid-block, and a 2-token one; heads of 40 (a partial 16-dim panel) and groups of 1 to 7 query heads.
    gen = torch.Generator().manual_seed(3)
    num_blocks, seqs = 300, [(0, 203), (77, 100), (0, 2)]  # (cached prefix, new tokens)
    width = kv_rows.row_width(cache_dtype, head_dim)
    caches = [torch.zeros(num_blocks, block_size, num_kv_heads, width, dtype=cache_dtype) for _ in range(2)]
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(-(-(p + n) // block_size))] for p, n in seqs]
    for (prefix, _), table in zip(seqs, tables):
        for cache in caches:
            flat = cache.view(-1, num_kv_heads, width)
            for p in range(prefix):
                flat[table[p // block_size] * block_size + p % block_size] = kv_rows.store(
                    torch.randn(num_kv_heads, head_dim, generator=gen), cache_dtype)
    total = sum(n for _, n in seqs)
    q, k_new, v_new = (torch.randn(total, h, head_dim, generator=gen) for h in (num_heads, num_kv_heads, num_kv_heads))
    meta = AttentionMetadata.build([n for _, n in seqs], [p + n for p, n in seqs], tables, block_size)
    scale = head_dim**-0.5
    ours = paged_attention(q, k_new, v_new, *caches, meta, scale, native_kernels)
    theirs = paged_attention(q, k_new, v_new, *caches, meta, scale)
    assert (ours - theirs).abs().max().item() <= 1e-5
    # A row's result depends on its own keys only: the second prompt in two chunks gives the same bits.
    start, (prefix, n) = seqs[0][1], seqs[1]
    for lo, hi in ((0, 41), (41, n)):
        chunk = AttentionMetadata.build([hi - lo], [prefix + hi], [tables[1]], block_size)
        rows = slice(start + lo, start + hi)
        alone = paged_attention(q[rows], k_new[rows], v_new[rows], *caches, chunk, scale, native_kernels)
        assert torch.equal(alone, ours[rows])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_the_avx2_and_avx512_builds_attend_to_the_same_bits(cache_dtype, native_kernels):
    """The AVX-512 build's decode attention holds a row's 16 consecutive dimensions per register (a key's for the
    scores, a value's for the sums), and the AVX2 build sums each lane in the same order (the scores' low and high 8
    dimensions of each 16 in two registers, head_dim 40 ending with 8 low ones): the same bits, so a decode pod's
    answers do not depend on its vector width."""
    from splitserve.engine.kernels import cpu_kernels

    if native_kernels.isa != "avx512":
        pytest.skip("this CPU has no AVX-512: the kernels have one build here")
    avx2 = cpu_kernels.build(avx512=False)
    gen = torch.Generator().manual_seed(11)
    shapes = ((9, 3, 64, 16), (8, 2, 128, 5), (7, 1, 40, 16), (6, 3, 64, 16))  # head sets of 3, 2 and 1
    for num_heads, num_kv_heads, head_dim, block_size in shapes:
        lens, num_blocks = torch.tensor([700, 1, 333, 16, 517]), 400
        k_cache, v_cache = (kv_rows.store(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen),
                                          cache_dtype) for _ in range(2))
        need = -(-700 // block_size)
        tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:need] for _ in lens])
        q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
        wide, narrow = (k.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5)
                        for k in (native_kernels, avx2))
        assert torch.equal(wide, narrow)
