"""Paged attention for a flattened (varlen) batch, and the per-step metadata that plans it.

A step concatenates the new tokens of all its sequences (``q``: [T, Hq, D]). ``paged_attention`` first writes the
step's new K/V into the cache through ``slot_mapping``, then attends, each sequence by the cheapest exact path:

- **decode** (one new token past the prompt): every such sequence of the step together. With the native CPU kernels
  (engine/kernels/cpu_kernels.py) they attend over K/V read in place through their block tables; otherwise with ONE
  gather of their blocks into [Bd, Hkv, S, D] and ONE SDPA whose key-padding mask hides the slots past each
  sequence's length;
- **prefill** (prompt tokens, however many): with the native CPU kernels, each sequence's queries attend causally over
  its K/V read through its block table (its cached prefix, if any, and the new tokens just written), on the kernels'
  GEMM tiles. Otherwise: with nothing cached before it, causal SDPA on the fresh q/k/v (the cache is not read
  back, unless it stores 16-bit values: attention always sees K/V as the cache holds them); after a cached prefix
  (prefix-cache hit, or a later chunk of a chunked prefill), a gather of that sequence's context and SDPA with a
  causal mask shifted by the prefix length.

Over a scaled (int8) pool every path reads each query's own block's keys in float16, from the step's ``OwnKeyPlan``
(engine/kv_formats/open_keys.py: the sequences' open blocks and the step's new keys), and leaves the open blocks
their new keys after the attention.

A layer with a sliding window or a soft-cap of its scores (Gemma 2 and 3, Mistral v0.1, Qwen2/Qwen3's sliding
layers) attends in PyTorch whatever the kernels (``_attend_spans``; the native kernels have neither): each query reads
the keys it sees (positions p - window < j <= p, transformers' mask) padded to a multiple of ``SPAN_KEYS``, so that a
query's arithmetic depends on its position alone, never on its chunk, its batch or what is cached: the same bits
alone, beside others, chunked and from the prefix cache. It costs a gather of each query's keys per layer (at most the
window's, for a windowed layer; its whole context for a soft-capped full one), where the native kernels read the
blocks in place.

``AttentionMetadata.build`` runs once per step and precomputes these plans (index tensors, masks, gather buffers)
so that the model's layers reuse them instead of rebuilding them per layer. Nothing here reads a tensor back to
the host, so a step runs on CUDA without synchronizing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F

from splitserve.engine.kernels.cpu_kernels import CpuKernels
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.kv_formats.open_keys import OwnKeyPlan


class GatherBuffers:
    """Where one step gathers a context's K and V blocks, allocated by the first layer and reused by the others.

    A fresh tensor per layer costs far more than the copy once it is large: gathering 50 MB into new memory took
    38 ms against 8 ms into a reused buffer (page faults), and a batch of 32 decodes at 2k context gathers that much.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.k: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, row], the cache's rows (kv_formats/rows.py)
        self.v: torch.Tensor | None = None

    def get(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            shape = (self.num_blocks, *cache.shape[1:])
            self.k = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            self.v = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        return self.k, self.v


@dataclass
class DecodeGroup:
    """The sequences with one new token this step, attended together."""

    num_seqs: int
    token_index: torch.Tensor | None  # [Bd] long: their rows among the step's tokens; None when all rows decode
    tables: torch.Tensor  # [Bd, nb] long: each sequence's first nb block ids, nb covering the longest context
    seq_lens: torch.Tensor  # [Bd] long: keys per sequence, the new one included
    context_len: int  # keys per sequence in the gathered tensor: the longest context
    key_mask: torch.Tensor | None  # [Bd, 1, 1, context_len] bool, True on real keys; None when all are that long
    buffers: GatherBuffers


@dataclass
class PrefillSegment:
    """One sequence with several new tokens: rows ``start:end`` of the step."""

    start: int
    end: int
    blocks: torch.Tensor  # [nb] long: the blocks of its whole context
    prefix: int  # tokens cached before the chunk
    context_len: int  # cached prefix + new tokens
    # [end - start, context_len] bool, query r sees keys 0..prefix + r; None: no prefix
    causal_mask: torch.Tensor | None
    buffers: GatherBuffers  # allocated when the PyTorch path reads the context back from the cache


@dataclass
class AttentionMetadata:
    query_lens: list[int]  # new tokens per sequence this step
    seq_lens: list[int]  # context length per sequence after this step (cached + new)
    query_start_loc: torch.Tensor  # [B + 1] long
    slot_mapping: torch.Tensor  # [T] long: cache slot of every new token
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with a valid block id (build pads with 0)
    is_decode_only: bool  # every row decodes: the batched fast path covers the whole step
    block_size: int
    # Sequences whose one new token is a prompt token: a one-row prefill, summed as a prefill sums (a chunked
    # prompt's last chunk may hold a single token), so a prompt position's bits never depend on its chunking.
    one_row_prefills: frozenset[int] = frozenset()
    # The same step over the window pool's tables (a model that mixes windowed and full layers, kv_cache.py): what
    # its windowed layers write and read through. None: every layer uses this one.
    window_meta: "AttentionMetadata | None" = None
    # Each row's sequence's open block, for a scaled pool (kv_formats/open_keys.py); None: a float pool's step.
    open_blocks: list[int] | None = None
    own_keys: OwnKeyPlan | None = field(init=False)
    decode: DecodeGroup | None = field(init=False)
    prefills: list[PrefillSegment] = field(init=False)
    _key_spans: dict[int | None, list["KeySpan"]] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        starts = [0, *accumulate(self.query_lens)]
        decoding = [i for i, n in enumerate(self.query_lens) if n == 1 and i not in self.one_row_prefills]
        self.decode = self._decode_group(decoding, starts) if decoding else None
        self.prefills = [self._prefill_segment(i, starts[i]) for i, n in enumerate(self.query_lens)
                         if n > 1 or i in self.one_row_prefills]
        self.own_keys = None
        if self.open_blocks is not None:
            segments = [i for i, n in enumerate(self.query_lens) if n > 1 or i in self.one_row_prefills]
            self.own_keys = OwnKeyPlan.build(self.query_lens, self.seq_lens, self.open_blocks, decoding, segments,
                                             self.block_size, self.block_tables.device)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        one_row_prefills: frozenset[int] = frozenset(),
        window_block_tables: list[list[int]] | None = None,
        open_blocks: list[int] | None = None,
        window_open_blocks: list[int] | None = None,
    ) -> "AttentionMetadata":
        """Metadata of one step from per-sequence lengths and block tables (host lists). A sequence with one new
        token decodes, unless its index is in ``one_row_prefills`` (a prompt token). ``window_block_tables``: the
        window pool's tables of the same rows (its ``window_meta``). ``open_blocks`` (``window_open_blocks``): each
        row's sequence's open block in the pool (the window pool) of a scaled format."""
        window_meta = None
        if window_block_tables is not None:
            window_meta = cls.build(query_lens, seq_lens, window_block_tables, block_size, device, one_row_prefills,
                                    open_blocks=window_open_blocks)
        slots = [
            table[p // block_size] * block_size + p % block_size
            for n, seq_len, table in zip(query_lens, seq_lens, block_tables)
            for p in range(seq_len - n, seq_len)
        ]
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            query_start_loc=as_tensor([0, *accumulate(query_lens)]),
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(padded),
            is_decode_only=not one_row_prefills and all(n == 1 for n in query_lens),
            block_size=block_size,
            one_row_prefills=one_row_prefills,
            window_meta=window_meta,
            open_blocks=None if open_blocks is None else list(open_blocks),
        )

    def for_layer(self, windowed: bool) -> "AttentionMetadata":
        """This step's metadata for a windowed layer (``windowed``) or a full one: the window pool's where it has
        one."""
        return self.window_meta if windowed and self.window_meta is not None else self

    def split_phases(self) -> tuple[tuple["AttentionMetadata", torch.Tensor], tuple["AttentionMetadata", torch.Tensor]]:
        """The step's prefill sequences and its decode sequences as two steps of their own: (metadata, rows [n] long
        among this step's) for each. A model that computes the phases in different formats runs the prefill step
        first, so that a decode row of the same sequence (a resumed request's outputs) attends to its prompt's K/V."""
        starts = [0, *accumulate(self.query_lens)]
        is_prefill = [n > 1 or i in self.one_row_prefills for i, n in enumerate(self.query_lens)]
        prefill = [i for i, p in enumerate(is_prefill) if p]
        decode = [i for i, p in enumerate(is_prefill) if not p]
        return self._select(prefill, starts), self._select(decode, starts)

    def _select(self, seqs: list[int], starts: list[int]) -> tuple["AttentionMetadata", torch.Tensor]:
        device = self.block_tables.device
        rows = torch.tensor([r for i in seqs for r in range(starts[i], starts[i + 1])], dtype=torch.long,
                            device=device)
        query_lens = [self.query_lens[i] for i in seqs]
        one_row = frozenset(j for j, i in enumerate(seqs) if i in self.one_row_prefills)
        meta = AttentionMetadata(
            query_lens=query_lens,
            seq_lens=[self.seq_lens[i] for i in seqs],
            query_start_loc=torch.tensor([0, *accumulate(query_lens)], dtype=torch.long, device=device),
            slot_mapping=self.slot_mapping[rows],
            block_tables=self.block_tables[torch.tensor(seqs, dtype=torch.long, device=device)],
            is_decode_only=not one_row and all(n == 1 for n in query_lens),
            block_size=self.block_size,
            one_row_prefills=one_row,
            window_meta=self.window_meta._select(seqs, starts)[0] if self.window_meta is not None else None,
            open_blocks=None if self.open_blocks is None else [self.open_blocks[i] for i in seqs],
        )
        return meta, rows

    def key_spans(self, window: int | None) -> list["KeySpan"]:
        """The step's queries grouped by how many key slots each reads under ``window`` (None: every key before it),
        built on a layer's first call and reused by the others of the same window."""
        if window not in self._key_spans:
            self._key_spans[window] = self._plan_key_spans(window)
        return self._key_spans[window]

    def _plan_key_spans(self, window: int | None) -> list["KeySpan"]:
        device = self.block_tables.device
        seq = torch.repeat_interleave(torch.arange(len(self.query_lens)), torch.tensor(self.query_lens))  # [T]
        end = torch.tensor([p + 1 for n, s in zip(self.query_lens, self.seq_lens) for p in range(s - n, s)])  # [T]
        start = (end - window).clamp(min=0) if window is not None else torch.zeros_like(end)
        width = (end - start + SPAN_KEYS - 1) // SPAN_KEYS * SPAN_KEYS
        # Without a window a sequence's queries of one width read the same keys: one span of shared keys each.
        group = width if window is not None else width * len(self.query_lens) + seq
        spans = []
        for value in group.unique().tolist():  # host tensors, from the host lists: no read back from the device
            rows = (group == value).nonzero().flatten()
            keys = int(width[rows[0]])
            positions = start[rows, None] + torch.arange(keys)  # [n, keys]
            visible = positions < end[rows, None]
            # Padding reads a key the sequence has (masked: any finite value gives the same bits).
            positions = torch.minimum(positions, end[rows, None] - 1)
            readers = rows if window is not None else rows[-1:]  # shared keys: the last query's, which sees them all
            first_keys = start[rows].to(device)
            positions = positions[-len(readers):].to(device)
            blocks = self.block_tables[seq[readers, None].to(device), positions // self.block_size]
            slots = blocks * self.block_size + positions % self.block_size
            spans.append(KeySpan(rows.to(device), slots, visible.to(device), first_keys, (end[rows] - 1).to(device)))
        return spans

    def _decode_group(self, seqs: list[int], starts: list[int]) -> DecodeGroup:
        device = self.block_tables.device
        lens = [self.seq_lens[i] for i in seqs]
        context_len = max(lens)
        whole_step = len(seqs) == len(self.query_lens)
        tables = self.block_tables if whole_step else self.block_tables[torch.tensor(seqs, device=device)]
        tables = tables[:, : -(-context_len // self.block_size)].contiguous()
        lens_t = torch.tensor(lens, device=device)
        key_mask = None
        if min(lens) < context_len:
            key_mask = (torch.arange(context_len, device=device) < lens_t[:, None]).view(len(seqs), 1, 1, -1)
        rows = None if whole_step else torch.tensor([starts[i] for i in seqs], device=device)
        return DecodeGroup(len(seqs), rows, tables, lens_t, context_len, key_mask, GatherBuffers(tables.numel()))

    def _prefill_segment(self, i: int, start: int) -> PrefillSegment:
        n, seq_len = self.query_lens[i], self.seq_lens[i]
        prefix = seq_len - n
        blocks = self.block_tables[i, : -(-seq_len // self.block_size)]
        causal = None
        if prefix > 0:
            device = self.block_tables.device
            query_pos = torch.arange(prefix, seq_len, device=device)  # [n]
            causal = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]  # [n, seq_len]
        return PrefillSegment(start, start + n, blocks, prefix, seq_len, causal, GatherBuffers(blocks.shape[0]))


# A query's keys are read in runs padded to a multiple of this many (masked), so that their count, and with it the
# shapes of its products, is a function of the query's position alone.
SPAN_KEYS = 16


@dataclass
class KeySpan:
    """Queries that read the same number of key slots: their rows among the step's [n], each one's cache slots
    [n, keys] (the keys it sees, in order, then padding), or [1, keys] shared by all (full attention: one sequence's
    queries of one width), and which of them each sees [n, keys]."""

    rows: torch.Tensor
    slots: torch.Tensor
    visible: torch.Tensor
    first_keys: torch.Tensor  # [n]: the position of each query's first key slot
    positions: torch.Tensor  # [n]: each query's position


def paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels: CpuKernels | None = None,
    kv_written: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the step's queries over their sequences' contexts; writes k_new/v_new into the cache first
    (unless ``kv_written``: the caller has).

    q: [T, Hq, D]; k_new, v_new: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, row] (kv_formats/rows.py).
    ``kernels``: the native CPU kernels, for the decode queries when they take the cache's dtype and D.
    ``window``: keys at positions p - window < j <= p only; ``softcap``: scores s become softcap * tanh(s / softcap)
    before the mask (Gemma 2); either attends through ``_attend_spans``.
    Returns [T, Hq, D] in q's dtype.
    """
    if not kv_written:
        _write(k_cache, k_new, meta.slot_mapping)
        _write(v_cache, v_new, meta.slot_mapping)
    plan = meta.own_keys if kv_rows.is_scaled(k_cache.dtype) else None
    source = None if plan is None else plan.source(k_cache, v_cache, k_new)
    out = _attend(q, k_new, v_new, k_cache, v_cache, meta, scale, kernels, window, softcap, source)
    if plan is not None:
        plan.write(k_cache, v_cache, k_new)
    return out


def _attend(q, k_new, v_new, k_cache, v_cache, meta: AttentionMetadata, scale: float, kernels: CpuKernels | None,
            window: int | None, softcap: float | None, source: torch.Tensor | None) -> torch.Tensor:
    """``paged_attention``'s attention, its K/V written; ``source``: a scaled pool's own-block keys (``OwnKeyPlan``),
    or None."""
    plan = meta.own_keys
    if window is not None or softcap is not None:
        own = None if source is None else source[plan.token_index()]
        return _attend_spans(q, k_cache, v_cache, meta.key_spans(window), scale, softcap, own)
    group = meta.decode
    native = (kernels is not None and kernels.supports_cache_dtype(k_cache.dtype)
              and kernels.supports_head_dim(q.shape[-1]))
    decode = partial(_decode_native, kernels) if native else _decode
    prefill = partial(_prefill_native, kernels) if native else _prefill
    decode_own = None if source is None or group is None else source[plan.decode_index]
    if group is not None and group.token_index is None:
        return decode(q, k_cache, v_cache, group, scale, decode_own)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if group is not None:
        rows = group.token_index
        out.index_copy_(0, rows, decode(q.index_select(0, rows), k_cache, v_cache, group, scale, decode_own))
    for i, seg in enumerate(meta.prefills):
        rows = slice(seg.start, seg.end)
        own = None if source is None else source[plan.segment_index[i]]
        prefill(q[rows], k_new[rows], v_new[rows], k_cache, v_cache, seg, scale, out[rows], own)
    return out


def _attend_spans(q, k_cache, v_cache, spans: list[KeySpan], scale: float, softcap: float | None,
                  own: torch.Tensor | None = None) -> torch.Tensor:
    """Each query over the keys of its span, as transformers' eager attention computes it: scores q k^T * scale,
    soft-capped, masked, softmaxed, times V; the G query heads of a KV head as G rows of one product per query.
    Every gathered operand is made contiguous: over strided K and V the batched products' bits depend on how many
    queries share the call (measured), over contiguous ones they do not. Shared keys enter each query's product as a
    broadcast (stride-0) batch, which gives the bits of a copy per query (measured, 1 to 40 queries, 2 and 8
    threads) without the copies: a full-attention layer then reads each sequence's keys once per 16 query
    positions, not once per query."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_rows, v_rows = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [slots, Hkv, row]
    group = num_heads // num_kv_heads
    for span in spans:
        n, width = span.visible.shape
        keys = kv_rows.load(k_rows[span.slots].transpose(1, 2), q.dtype).contiguous()  # [n or 1, Hkv, width, D]
        values = kv_rows.load(v_rows[span.slots].transpose(1, 2), q.dtype).contiguous()
        queries = q[span.rows].reshape(n, num_kv_heads, group, head_dim)  # [n, Hkv, G, D]
        if len(span.slots) == 1:  # shared keys, read once: each head's product over them, broadcast, not copied
            heads = queries.transpose(0, 1).contiguous()  # [Hkv, n, G, D]
            scores = torch.stack([torch.bmm(heads[h], keys[0, h].t().expand(n, head_dim, width))
                                  for h in range(num_kv_heads)], 1)  # [n, Hkv, G, width]
        else:
            scores = torch.matmul(queries, keys.transpose(2, 3))  # [n, Hkv, G, width]
        if own is not None:  # a scaled pool: each query's own block's keys [T, B, Hkv, D] in float16
            _own_block_scores(scores, queries, own[span.rows], span)
        scores = scores * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(~span.visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if len(span.slots) == 1:
            probs = probs.transpose(0, 1).contiguous()  # [Hkv, n, G, width]
            attended = torch.stack([torch.bmm(probs[h], values[0, h].expand(n, width, head_dim))
                                    for h in range(num_kv_heads)], 1)
        else:
            attended = torch.matmul(probs, values)
        out[span.rows] = attended.reshape(n, num_heads, head_dim)
    return out


def _own_block_scores(scores: torch.Tensor, queries: torch.Tensor, own: torch.Tensor, span: KeySpan) -> None:
    """A span's scores [n, Hkv, G, width] of its queries [n, Hkv, G, D] over their own blocks' keys, from ``own``
    [n, B, Hkv, D] in place of the pool's."""
    n, width = span.visible.shape
    block_size = own.shape[1]
    own_scores = torch.einsum("nhgd,nbhd->nbhg", queries, own.to(queries.dtype))  # [n, B, Hkv, G]
    columns = (span.positions - span.positions % block_size - span.first_keys)[:, None] + torch.arange(
        block_size, device=scores.device)
    keep = (columns >= 0) & (columns < width)  # (keys before the window or past the span: not read)
    rows = torch.arange(n, device=scores.device)[:, None].expand(n, block_size)
    scores.permute(0, 3, 1, 2)[rows[keep], columns[keep]] = own_scores[keep]


def _write(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    if new.dtype != cache.dtype:  # a cache stored narrower than the compute dtype; checked, as .to costs a call
        new = kv_rows.store(new, cache.dtype)
    cache.flatten(0, 1).index_copy_(0, slots, new)  # [num_blocks * block_size, Hkv, row]


def _gather(cache, blocks, buffer, num_seqs: int, context_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_seqs, Hkv, context_len, D]: each sequence's blocks in order, trimmed to context_len keys, as values in
    ``dtype``."""
    rows = torch.index_select(cache, 0, blocks, out=buffer)  # [num_seqs * nb, block_size, Hkv, row]
    rows = rows.view(num_seqs, -1, cache.shape[2], cache.shape[3])[:, :context_len]  # [B, nb * block_size, Hkv, row]
    return kv_rows.load(rows.transpose(1, 2), dtype)


def _decode(q, k_cache, v_cache, group: DecodeGroup, scale: float, own: torch.Tensor | None) -> torch.Tensor:
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k_buffer, v_buffer = group.buffers.get(k_cache)
    blocks = group.tables.view(-1)
    keys = _gather(k_cache, blocks, k_buffer, b, group.context_len, q.dtype)  # [Bd, Hkv, S, D]
    values = _gather(v_cache, blocks, v_buffer, b, group.context_len, q.dtype)
    if own is not None:  # each query's own block's keys [Bd, B, Hkv, D], in place of the pool's
        block_size = own.shape[1]
        columns = ((group.seq_lens - 1) // block_size * block_size)[:, None] + torch.arange(block_size,
                                                                                             device=q.device)
        keep = columns < group.context_len  # (a block's tail past the longest context: never read)
        seqs = torch.arange(b, device=q.device)[:, None].expand(b, block_size)
        keys.transpose(1, 2)[seqs[keep], columns[keep]] = own[keep].to(keys.dtype)
    # The G query heads that share a KV head become G query rows of that head: with a single new token per
    # sequence there is no causality among them, so one SDPA covers GQA without repeating K and V.
    grouped = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [Bd, Hkv, G, D]
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=group.key_mask, scale=scale)
    return out.reshape(b, num_heads, head_dim)


def _decode_native(kernels: CpuKernels, q, k_cache, v_cache, group: DecodeGroup, scale: float,
                   own: torch.Tensor | None) -> torch.Tensor:
    return kernels.paged_decode_attention(q, k_cache, v_cache, group.tables, group.seq_lens, scale, own)


def _prefill(q, k_new, v_new, k_cache, v_cache, seg: PrefillSegment, scale: float, out: torch.Tensor,
             own: torch.Tensor | None) -> None:
    if own is not None:
        _prefill_own_block(q, k_cache, v_cache, seg, scale, out, own)
        return
    queries = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if seg.prefix == 0 and k_cache.dtype == q.dtype:  # the fresh K/V are what the cache holds: no read back
        keys = k_new.transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
        values = v_new.transpose(0, 1).unsqueeze(0)
    else:  # a cached prefix, or a narrower cache's rounded K/V (what the native kernels and later steps attend over)
        k_buffer, v_buffer = seg.buffers.get(k_cache)
        keys = _gather(k_cache, seg.blocks, k_buffer, 1, seg.context_len, q.dtype)  # [1, Hkv, context_len, D]
        values = _gather(v_cache, seg.blocks, v_buffer, 1, seg.context_len, q.dtype)
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=seg.causal_mask,
                                              is_causal=seg.causal_mask is None, scale=scale, enable_gqa=True)
    out.copy_(attended[0].transpose(0, 1))  # [n, Hq, D]


# Query rows per product of the PyTorch prefill over a scaled pool (_prefill_own_block): its scores [Hq, rows, keys]
# in float32 stay at ~80 MB for 9 heads at 8,192 keys.
OWN_BLOCK_ROWS = 256


def _prefill_own_block(q, k_cache, v_cache, seg: PrefillSegment, scale: float, out: torch.Tensor,
                       own: torch.Tensor) -> None:
    """``_prefill`` over a scaled pool: each query's scores over its own block's keys from ``own`` [m, Hkv, D]
    (positions from the prefix's block's first on), over older keys from the pool; explicit products, as the
    keys differ by query."""
    n, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_buffer, v_buffer = seg.buffers.get(k_cache)
    keys = _gather(k_cache, seg.blocks, k_buffer, 1, seg.context_len, torch.float32)[0]  # [Hkv, context_len, D]
    values = _gather(v_cache, seg.blocks, v_buffer, 1, seg.context_len, torch.float32)[0]
    own_start = seg.prefix - seg.prefix % block_size
    own_keys = own.float().permute(1, 2, 0)  # [Hkv, D, m]
    key_pos = torch.arange(seg.context_len, device=q.device)
    for r0 in range(0, n, OWN_BLOCK_ROWS):
        rows = slice(r0, min(n, r0 + OWN_BLOCK_ROWS))
        pos = seg.prefix + torch.arange(rows.start, rows.stop, device=q.device)
        queries = q[rows].float().view(-1, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)  # [Hkv, R, G, D]
        queries = queries.reshape(num_kv_heads, -1, head_dim)  # [Hkv, R * G, D]
        scores = torch.bmm(queries, keys.transpose(1, 2))  # [Hkv, R * G, context_len]
        own_scores = torch.bmm(queries, own_keys)  # [Hkv, R * G, m]
        in_own = (key_pos[None, own_start:] // block_size == pos[:, None] // block_size).repeat_interleave(group, 0)
        scores[:, :, own_start:] = torch.where(in_own, own_scores, scores[:, :, own_start:])
        visible = (key_pos[None, :] <= pos[:, None]).repeat_interleave(group, 0)
        probs = torch.softmax((scores * scale).masked_fill(~visible, float("-inf")), dim=-1)
        attended = torch.bmm(probs, values)  # [Hkv, R * G, D]
        out[rows] = attended.view(num_kv_heads, -1, group, head_dim).permute(1, 0, 2, 3).reshape(
            -1, num_heads, head_dim).to(out.dtype)


def _prefill_native(kernels: CpuKernels, q, k_new, v_new, k_cache, v_cache, seg: PrefillSegment, scale: float,
                    out: torch.Tensor, own: torch.Tensor | None) -> None:
    kernels.prefill_attention(q, k_cache, v_cache, seg.blocks, seg.prefix, scale, out, own)
