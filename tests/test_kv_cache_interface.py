"""The KV pool's interface for code outside the engine (``PagedKVCache.slots / read / write``), and the check that
nothing outside ``engine/`` reaches past it to the pool tensors."""

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from splitserve.engine.config import ModelConfig
from splitserve.engine.kv_cache import PagedKVCache

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4, num_kv_heads=2)
BLOCK = 4  # block_size of the caches below
POOL_TENSORS = {"k_blocks", "v_blocks"}  # PagedKVCache's attributes holding the pool, one tensor per layer


def cache(dtype=torch.float32, num_blocks: int = 8) -> PagedKVCache:
    return PagedKVCache(CONFIG, num_blocks=num_blocks, block_size=BLOCK, dtype=dtype)


def values(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, CONFIG.num_kv_heads, CONFIG.head_dim, generator=torch.Generator().manual_seed(seed))


def test_slots_follow_the_block_table_across_block_boundaries():
    # Tokens 2..10 of a sequence in blocks 7, 2, 5: the end of block 7, all of block 2, the start of block 5.
    slots = cache().slots([7, 2, 5], 2, 11)
    assert slots.tolist() == [30, 31, 8, 9, 10, 11, 20, 21, 22]
    assert cache().slots([7, 2, 5], 5, 5).tolist() == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_then_read_round_trips_a_range_spanning_blocks_exactly_where_the_engine_reads_it(dtype):
    kv = cache(dtype)
    table = [7, 2, 5]
    k, v = values(9, seed=1).to(dtype), values(9, seed=2).to(dtype)
    slots = kv.slots(table, 2, 11)
    kv.write(1, "k", slots, k)
    kv.write(1, "v", slots, v)
    assert torch.equal(kv.read(1, "k", slots), k) and torch.equal(kv.read(1, "v", slots), v)
    # In the pool, token p sits at [block_table[p // BLOCK], p % BLOCK], where attention gathers it.
    for i, p in enumerate(range(2, 11)):
        assert torch.equal(kv.k_blocks[1][table[p // BLOCK], p % BLOCK], k[i])
        assert torch.equal(kv.v_blocks[1][table[p // BLOCK], p % BLOCK], v[i])
    # Nothing else changed: other layers, other blocks, the slots of block 7 before the range, block 5's tail.
    touched = torch.zeros(kv.num_blocks, BLOCK, dtype=torch.bool)
    touched.view(-1)[slots] = True
    for layer in range(CONFIG.num_layers):
        for pool in (kv.k_blocks[layer], kv.v_blocks[layer]):
            untouched = pool if layer != 1 else pool[~touched]
            assert untouched.abs().sum() == 0


def test_partial_blocks_written_in_pieces_read_back_as_one_range():
    kv = cache()
    table = [3, 6]
    whole = values(7, seed=3)
    for start, end in ((0, 1), (1, 3), (3, 6), (6, 7)):  # pieces ending inside and at the end of a block
        kv.write(0, "k", kv.slots(table, start, end), whole[start:end])
    assert torch.equal(kv.read(0, "k", kv.slots(table, 0, 7)), whole)
    assert torch.equal(kv.read(0, "k", kv.slots(table, 5, 7)), whole[5:7])
    assert kv.read(0, "v", kv.slots(table, 0, 7)).abs().sum() == 0  # V untouched


@pytest.mark.parametrize("table, start, end", [
    ([2, 3, 4, 5], 1, 16),  # three slots of a block, then whole blocks
    ([5, 4, 3, 2], 0, 16),  # whole blocks only, as a freed sequence's blocks come back (tail first)
    ([1, 2, 6, 7], 3, 14),  # a slot, two whole blocks, two slots of the last
    ([6, 0, 3, 1], 1, 15),  # the same, scattered over the pool
    ([4, 5], 6, 7),  # one token: a row
])
def test_write_puts_every_token_where_its_block_table_says_whether_copied_by_blocks_or_by_rows(table, start, end):
    kv = cache()
    k = values(end - start, seed=4)
    slots = kv.slots(table, start, end)
    kv.write(2, "k", slots, k)
    expected = torch.zeros_like(kv.k_blocks[2]).flatten(0, 1).index_copy_(0, slots, k)
    assert torch.equal(kv.k_blocks[2].flatten(0, 1), expected)
    assert all(kv.k_blocks[layer].abs().sum() == 0 for layer in (0, 1))
    assert all(pool.abs().sum() == 0 for pool in kv.v_blocks)


def test_write_stores_the_caches_dtype_and_read_returns_a_copy():
    kv = cache(torch.float16)
    x = values(5, seed=4) * 1000
    slots = kv.slots([0, 1], 0, 5)
    kv.write(2, "v", slots, x)
    got = kv.read(2, "v", slots)
    assert got.dtype == torch.float16 and torch.equal(got, x.to(torch.float16))  # rounded as torch's .to() does
    got.zero_()
    assert torch.equal(kv.read(2, "v", slots), x.to(torch.float16))
    assert (kv.element_size, kv.device) == (2, torch.device("cpu"))


def test_bad_ranges_and_kinds_are_refused():
    kv = cache()
    with pytest.raises(ValueError, match=r"tokens \[0, 9\) are not within 2 blocks of 4"):
        kv.slots([0, 1], 0, 9)
    with pytest.raises(ValueError, match="not within"):
        kv.slots([0, 1], 3, 2)
    with pytest.raises(ValueError, match="kind must be 'k' or 'v'"):
        kv.read(0, "q", kv.slots([0], 0, 1))


# ---- nobody outside the engine touches the pool tensors ---------------------------------------------------------

def pool_accesses(source: str) -> list[int]:
    """Lines of ``source`` that name a pool tensor: an attribute (``cache.k_blocks``) or a string
    (``getattr(cache, "k_blocks")``)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if (isinstance(node, ast.Attribute) and node.attr in POOL_TENSORS)
            or (isinstance(node, ast.Constant) and node.value in POOL_TENSORS)]


def first_party_packages() -> list[str]:
    """Every folder of the repository that installs as part of ``splitserve`` (pyproject's package-dir)."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    return sorted({folder.split("/")[0] for folder in folders})


# Run in a fresh process, so that the resident set measured is that process's own: a cache of POOL_MIB, its RSS
# (/proc/self/statm) before it, after it is made, and after every slot of every layer was written.
POOL_MIB = 256
RESIDENCY_SCRIPT = f"""
import json, os, torch
from splitserve.engine.kv_cache import PagedKVCache
from tests.test_kv_cache_interface import CONFIG

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

tokens = {POOL_MIB} * 2**20 // (2 * CONFIG.num_layers * CONFIG.num_kv_heads * CONFIG.head_dim * 2) // 16 * 16
layer_values = torch.ones(tokens, CONFIG.num_kv_heads, CONFIG.head_dim, dtype=torch.float16)
before = rss()
kv = PagedKVCache(CONFIG, num_blocks=tokens // 16, block_size=16, dtype=torch.float16)
made = rss()
zeros = all(kv.read(layer, kind, torch.arange(0, tokens, 997)).abs().sum() == 0
            for layer in range(CONFIG.num_layers) for kind in ("k", "v"))
slots = torch.arange(tokens)
for layer in range(CONFIG.num_layers):
    for kind in ("k", "v"):
        kv.write(layer, kind, slots, layer_values)
print(json.dumps({{"pool": kv.memory_bytes(), "made": made - before, "filled": rss() - before, "zeros": zeros}}))
"""


def test_the_pool_is_zeros_that_become_resident_as_they_are_written():
    """A CPU pool is not written at start (torch.zeros would make all of it resident in an idle pod): its memory
    arrives as slots are written, up to the pool's size, and what was never written reads as zeros."""
    run = subprocess.run([sys.executable, "-c", RESIDENCY_SCRIPT], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert figures["pool"] > 0.99 * POOL_MIB * 2**20
    assert figures["zeros"]
    assert figures["made"] < figures["pool"] / 16
    assert figures["filled"] > 0.95 * figures["pool"]


def test_nothing_outside_the_engine_touches_the_pool_tensors():
    packages = [p for p in first_party_packages() if p != "engine"]
    assert {"kvtransfer", "prefill_service", "bench"} <= set(packages)
    found = [f"{path.relative_to(ROOT)}:{line}" for package in packages
             for path in sorted((ROOT / package).rglob("*.py")) for line in pool_accesses(path.read_text())]
    assert not found, f"use PagedKVCache.slots/read/write instead of the pool tensors: {found}"
    # The engine itself does use them (attention and the model's layers): the check sees the real names.
    assert pool_accesses((ROOT / "engine" / "model" / "llama.py").read_text())


def test_the_check_finds_each_way_to_reach_the_pool():
    assert pool_accesses("x = engine.runner.kv_cache.k_blocks[0]") == [1]
    assert pool_accesses("\npool = getattr(cache, 'v_blocks')") == [2]
    assert pool_accesses("k = cache.read(0, 'k', slots)") == []
