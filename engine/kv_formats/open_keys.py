"""A scaled pool's *open blocks*: the float16 keys of the block each sequence is filling.

The rule (docs/kv_cache.md, "The own block"): a query at position ``p`` reads the keys of its own block, positions
``p - p % block_size`` .. ``p``, as float16, and every older key as the pool stores it (int8 rows); values always as
stored. The newest keys are the ones a query weighs most, and their quantization error is what the int8 pool's
answers lose most to. A rule of positions alone: a query's keys are the same values whatever its chunk, its batch or
the prefix cache's hit (a hit ends before the block of the prompt's last token, so that block is always computed).

Where they live: each sequence of a scaled pool holds one block of the pool besides its table (``open_block``), and
that block's storage holds the float16 keys of its current block, a token's keys (``num_kv_heads * head_dim``
float16, head after head) at offset ``p % block_size``: tokens 0 .. B/2 - 1 at the start of the block's K storage,
the others at the start of its V storage (half a block's float16 keys take B/2 * Hkv * D * 2 bytes, no more than a
block of int8 rows' B * Hkv * (D + D / 8)). The native kernels address them alike (``OpenKeys``,
kernels/csrc/cache_elems.h).

Each step's queries read their own blocks' keys from the open blocks as the steps before left them and from the
step's new keys (``OwnKeyPlan``); after its attention the step leaves in each open block the keys of the block of
its sequence's last position, so a step that crosses blocks never overwrites keys one of its own queries reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate

import torch

from splitserve.engine.kv_formats import rows as kv_rows


def used_by(dtype: torch.dtype) -> bool:
    """Whether a pool of ``dtype`` keeps open blocks: a scaled one (a float pool's rows are float16 or finer)."""
    return kv_rows.is_scaled(dtype)


def _halves(k_pool: torch.Tensor, v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views [num_blocks, B/2, Hkv, D] float16 of every block's first and second half of open keys."""
    num_blocks, block_size, num_kv_heads, _ = k_pool.shape
    head_dim = kv_rows.head_dim_of(k_pool)
    half = block_size // 2
    size = half * num_kv_heads * head_dim * 2 // k_pool.element_size()  # pool elements of half a block's keys

    def region(pool: torch.Tensor) -> torch.Tensor:
        return pool.view(num_blocks, -1)[:, :size].view(torch.float16).view(num_blocks, half, num_kv_heads, head_dim)

    return region(k_pool), region(v_pool)


def read(k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The open keys of ``blocks`` [n] long: [n, B, Hkv, D] float16, a copy."""
    first, second = _halves(k_pool, v_pool)
    return torch.cat([first[blocks], second[blocks]], dim=1)


def write(k_pool: torch.Tensor, v_pool: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor,
          keys: torch.Tensor) -> None:
    """Tokens' keys [n, Hkv, D] (any float dtype, rounded to float16) into their open blocks ``blocks`` [n] long at
    offsets ``positions`` [n] % B. The positions of one block must be distinct."""
    half = k_pool.shape[1] // 2
    offsets = positions % (2 * half)
    keys = keys.to(torch.float16)
    for region, in_half in zip(_halves(k_pool, v_pool), (offsets < half, offsets >= half)):
        region[blocks[in_half], offsets[in_half] % half] = keys[in_half]


@dataclass
class OwnKeyPlan:
    """Where one step's queries read their own block's keys from, and what the step leaves in the open blocks.

    A layer's *source* is the rows its sequences' open blocks held before the step (``read_blocks``, B rows each)
    followed by the step's new keys in float16 (``source``); a query's own keys are rows of it: ``decode_index``
    [Bd, B] for the decode rows (a row's keys past its own position repeat it: the kernels never read them),
    ``segment_index`` [prefix % B + n] for each prefill segment. After the layer's attention, ``write`` leaves in
    each sequence's open block the keys of the block of its last position in the step."""

    read_blocks: torch.Tensor  # [S] long
    decode_index: torch.Tensor | None  # [Bd, B] long
    segment_index: list[torch.Tensor]  # per prefill segment, [m] long
    write_blocks: torch.Tensor  # [W] long: open blocks,
    write_positions: torch.Tensor  # [W] long: the positions written to them,
    write_rows: torch.Tensor  # [W] long: the step's rows holding their keys
    # Every token's own keys' rows of the source, [T, B] long, built when first asked for (token_index)
    _token_rows: Callable[[], torch.Tensor] | None = field(repr=False, default=None)
    _token_index: torch.Tensor | None = field(init=False, repr=False, default=None)

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], open_blocks: list[int], decode_rows: list[int],
              segment_rows: list[int], block_size: int, device: torch.device | str) -> "OwnKeyPlan":
        """From a step's rows (the rows of one sequence consecutive, with the same open block and each row's
        positions following the last's), the rows that decode and those that are prefill segments, in order."""
        starts = [0, *accumulate(query_lens)]
        first_row: dict[int, int] = {}  # open block -> the sequence's first row in the step
        last_row: dict[int, int] = {}  # and its last
        for r, block in enumerate(open_blocks):
            first_row.setdefault(block, r)
            last_row[block] = r
        read_blocks = [b for b, r in first_row.items() if (seq_lens[r] - query_lens[r]) % block_size]
        read_slot = {b: j for j, b in enumerate(read_blocks)}
        fresh = len(read_blocks) * block_size

        def source_index(row: int, position: int) -> int:
            first = first_row[open_blocks[row]]
            step_start = seq_lens[first] - query_lens[first]
            if position >= step_start:
                return fresh + starts[first] + position - step_start
            return read_slot[open_blocks[row]] * block_size + position % block_size

        def own(row: int, position: int) -> list[int]:
            first = position - position % block_size
            return [source_index(row, min(first + t, position)) for t in range(block_size)]

        decode = [own(r, seq_lens[r] - 1) for r in decode_rows]
        segments = [[source_index(r, p) for p in range((seq_lens[r] - query_lens[r]) // block_size * block_size,
                                                       seq_lens[r])] for r in segment_rows]
        writes = []
        for block, first in first_row.items():
            end, step_start = seq_lens[last_row[block]], seq_lens[first] - query_lens[first]
            writes += [(block, p, starts[first] + p - step_start)
                       for p in range(max(step_start, (end - 1) // block_size * block_size), end)]
        as_tensor = partial(torch.tensor, dtype=torch.long, device=device)

        def token_rows() -> list[list[int]]:
            return [own(r, p) for r, n in enumerate(query_lens) for p in range(seq_lens[r] - n, seq_lens[r])]

        return cls(as_tensor(read_blocks), as_tensor(decode) if decode else None, [as_tensor(s) for s in segments],
                   *(as_tensor(list(column)) for column in (zip(*writes) if writes else ([], [], []))),
                   lambda: as_tensor(token_rows()))

    def token_index(self) -> torch.Tensor:
        """[T, B] long: every token's own block's keys as rows of the source (a position's keys past its own
        repeat it), for the attention that reads each query's keys apart (``_attend_spans``)."""
        if self._token_index is None:
            self._token_index = self._token_rows()
        return self._token_index

    def source(self, k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor) -> torch.Tensor:
        """A layer's source rows [S * B + T, Hkv, D] float16, before the step's ``write``."""
        old = read(k_pool, v_pool, self.read_blocks).flatten(0, 1)
        return torch.cat([old, k_new.to(torch.float16)])

    def write(self, k_pool: torch.Tensor, v_pool: torch.Tensor, k_new: torch.Tensor) -> None:
        """After the layer's attention: its open blocks' new keys, from the step's ``k_new`` [T, Hkv, D]."""
        write(k_pool, v_pool, self.write_blocks, self.write_positions, k_new[self.write_rows])
