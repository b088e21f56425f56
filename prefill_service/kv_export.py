"""The prefill pod's side of the hand-off, and the engine's KV export hook that does its engine-thread part: after
each layer of a step, copy that layer's fresh K and V out of the paged cache and hand them to the request's
``KVSender``, while the engine goes on with the next layer. (The decode pod's side: ``kvtransfer/handoff.py``.)

The export of one request, as ``PrefillServicer._prefill_and_push`` (``server.py``) runs it:

    open      ``KVTransferClient.open``: the handshake with the decode pod (once per pod and codec) and a
              ``KVSender`` for the request
    compute   the request enters the engine with its sender registered here (``register``, below), and two tasks
    and push  run side by side: the prefill (each step's layers handed to the sender by ``on_layer``) and
              ``KVSender.push`` (header, chunks as layers arrive, trailer: the decode pod reserves, receives and
              acknowledges, starting the request's lease there)
    hold      the step that completes the prompt holds its blocks (``BlockManager.hold``): the engine finishes the
              request, but the KV stays until the push is over
    free      ``unregister``, queued on the engine thread when the call ends whichever way, frees the held blocks

    way out                        what frees what
    acknowledged                   ``unregister`` frees the held blocks; the KV now waits on the decode pod
    the push fails (refused,       the prefill task is cancelled: the engine aborts the request and frees its
      link down, timeout)          blocks (or ``unregister`` frees them, if already held)
    the prefill fails              the push is cancelled: the decode pod sees CANCELLED and releases its reservation
    Abort, or the client gone      both tasks are cancelled: both of the above

A request's path through the hook (all on the engine thread):

    register(request_id, sender)     when the request enters the engine (inside the EngineLoop's add command)
    each step holding it:
      wants(batch)                   before the step: this step exports tokens [exported, start + new) of it.
                                     The first step also covers [0, start), the prefix the prefix cache supplied
                                     and nobody computed; later chunks of a chunked prefill start where the last
                                     one ended, so the export covers the whole prompt exactly once.
      on_layer(layer, batch)         after the layer wrote its K/V: copy them by slot, hand them over (from a
                                     tensor-parallel engine, each rank's KV heads apart: read_heads); after the
                                     last layer of the step that reaches the prompt's end, mark compute done and
                                     hold the prompt's blocks (BlockManager.hold): the request finishes with
                                     this step, but its blocks stay allocated until the push is over
    unregister(request_id)           when the Prefill call ends, whichever way, so after the decode pod's
                                     acknowledgement (or the push's failure): frees the held blocks. An engine
                                     command too, so it runs after the registration even when the call was
                                     cancelled mid-admission

Only the engine thread touches the table, so it needs no lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.parallel.sharded_kv_cache import read_heads
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.sequence import Sequence
from splitserve.kvtransfer.sender import HeadsKV, KVSender


@dataclass
class _Export:
    sender: KVSender
    num_exported_tokens: int = 0  # prompt tokens whose KV is already handed over
    held: Sequence | None = None  # the holder of the prompt's blocks once it is computed, until unregister


@dataclass
class _StepExport:
    """One request's share of the current step's export: tokens [token_start, token_end) of the prompt, from
    ``window_start`` on in the layers where the decode pod keeps only a window (``KVSender.window_layers``)."""

    export: _Export
    seq: Sequence
    token_start: int
    window_start: int
    token_end: int
    completes_prompt: bool
    _slots: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)  # by (block table, first token)

    def start(self, layer: int) -> int:
        return self.window_start if layer in self.export.sender.window_layers else self.token_start

    def slots(self, cache: PagedKVCache, layer: int) -> torch.Tensor:
        """[token_end - start(layer)] long: where ``layer``'s tokens lie in its pool (the same for the layers of
        one block table and start)."""
        key = (cache.table_of(layer), self.start(layer))
        if key not in self._slots:
            self._slots[key] = cache.slots(getattr(self.seq, key[0]), key[1], self.token_end)
        return self._slots[key]


class PrefillKVExport:
    """Implements the engine's ``KVExportHook`` for the requests that registered a sender."""

    def __init__(self, engine: LLMEngine):
        self._kv_cache = engine.runner.kv_cache
        self._block_manager = engine.block_manager
        self._last_layer = engine.model_config.num_layers - 1
        self._exports: dict[str, _Export] = {}
        self._step: list[_StepExport] = []

    def register(self, seq: Sequence, sender: KVSender) -> None:
        """Export ``seq``'s KV through ``sender`` (before its first step: its prefix-cache hit then holds every block
        it covers, ``Sequence.exported``, which the export reads from)."""
        seq.exported = True
        self._exports[seq.request_id] = _Export(sender)

    def unregister(self, request_id: str) -> None:
        export = self._exports.pop(request_id, None)
        if export is not None and export.held is not None:
            self._block_manager.free(export.held)

    def wants(self, batch: SchedulerOutput) -> bool:
        self._step = []
        for item in batch.scheduled:
            export = self._exports.get(item.seq.request_id)
            token_end = min(item.start + item.num_new_tokens, item.seq.num_prompt_tokens)
            if export is None or token_end <= export.num_exported_tokens:
                continue  # not ours, or recomputing tokens already sent (after a preemption)
            # Tokens before the decode pod's window (KVSender.first_token) are not sent in its windowed layers: it
            # keeps none of them there.
            token_start = export.num_exported_tokens
            self._step.append(_StepExport(export, item.seq, token_start, max(token_start, export.sender.first_token),
                                          token_end, token_end == item.seq.num_prompt_tokens))
            export.num_exported_tokens = token_end
        return bool(self._step)

    def on_layer(self, layer: int, batch: SchedulerOutput) -> None:
        # read() copies, so the sender owns what it gets even after the request's blocks are freed and reused.
        cache = self._kv_cache
        for part in self._step:
            sender = part.export.sender
            if part.completes_prompt and layer == self._last_layer:
                # Before the last layer goes out: the decode pod's acknowledgement may otherwise arrive first,
                # and the exposed transfer time would read 0.
                sender.mark_compute_done()
                part.export.held = self._block_manager.hold(part.seq)
            if part.start(layer) >= part.token_end:
                continue  # all before the decode pod's window
            rows = sender.codec.pool_dtype == cache.dtype  # the codec carries this pool's rows as they lie
            slots = part.slots(cache, layer)
            keys, values = (read_heads(cache, layer, kind, slots, rows) for kind in ("k", "v"))
            sender.submit_layer(layer, part.start(layer), part.token_end,
                                [HeadsKV(heads, k, v) for (heads, k), (_, v) in zip(keys, values)])
