"""The decode pod's side of the hand-off: one pushed request's states, who moves it between them, and what frees its
blocks on each way out. The other files call in here; this one narrates.

One ordered ``TransferState`` per pushed request, kept on its ``KVLease`` in the pod's ``TransferTable``
(``leases.py``):

    reserve  RECEIVING  PushKV's header (``receiver.py``, ``KVTransferServicer.PushKV``): ``TransferTable.open``
                        files the lease, then ``reserve`` (engine thread) takes the prompt's blocks with
                        ``LLMEngine.reserve_for_transfer`` and files the sequence on the lease: a release queued
                        after it finds them even if the handler was cancelled meanwhile
    receive  RECEIVING  PushKV's chunks: ``KVIntake.store`` writes each into those blocks (the engine never
                        schedules a reserved sequence, so writing beside its thread is safe)
             WAITING    PushKV's trailer: ``KVIntake.check_complete``, then ``TransferTable.mark_received``; the
                        lease's clock (``lease_s``) starts
    claim    CLAIMED    Decode (``decode_service/server.py``): ``TransferTable.claim`` (NOT_FOUND: never pushed or
                        expired; FAILED_PRECONDITION: still arriving). KV pushed for the n samples of one prompt
                        (``num_claims`` > 1) stays WAITING through its first n - 1 claims
    run                 on the engine thread, one of:
                        ``Admission.admit``: a prefilled request joins the running batch with its first token
                        (``LLMEngine.admit_prefilled``); a sample of shared KV first forks a sequence of its own
                        (``LLMEngine.fork_prefilled``: the full blocks shared, the last one copied);
                        ``PrefixHandover.hand_over``: a split prefill's prefix goes to the prefix cache
                        (``LLMEngine.cache_transferred_prefix``) just before the request is added, which finds it
                        there and prefills only the rest.
                        Then ``TransferTable.forget`` drops the entry: the engine owns the blocks
    free     RELEASED   ``release`` (``LLMEngine.release_transfer``) or the engine's own freeing, by the way out:

    way out                      who frees the blocks
    finish                       the engine, when the admitted sequence finishes (as any request's); shared KV's own
                                 reference: ``Admission`` at the last sample's claim
    lease expiry (WAITING)       the reaper: ``TransferTable.reap_expired`` -> ``TransferTable.release``
    abort, WAITING               ``TransferTable.abort`` -> ``TransferTable.release``
    abort, RECEIVING             ``TransferTable.abort`` sets ``abort_requested``; the PushKV handler sees it at its
                                 next message and fails with CANCELLED: the error row below
    abort, CLAIMED               not the table's: the Decode call's ``engine_loop.abort`` frees an admitted request
    error or cancel in PushKV    the handler's ``finally``: ``TransferTable.release`` (anything not acknowledged)
    error or cancel in Decode    ``Admission.release_unless_admitted`` / ``PrefixHandover.release_unless_handed_over``,
                                 queued on the engine thread after the admission, so it knows whether that ran
    bad KV under "recompute"     the PushKV handler releases it; Decode finds NOT_FOUND and prefills here
    the pod stops (SIGTERM)      running Decode and PushKV calls finish within ``shutdown_grace_s`` (as above); a
                                 claim or push that comes once the server takes no new call is refused (UNAVAILABLE,
                                 or CANCELLED as it stops, which the router reads as UNAVAILABLE) and the router
                                 retries the request on another pair before its first token; KV still WAITING goes
                                 with the process (tests/test_shm_transport.py's SIGTERM'd decode pod)

The reaper never touches a RECEIVING lease: its PushKV handler may be writing into the blocks, so that handler alone
releases them. The table lives on the event loop; every block moves on the engine thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.protos.convert import token_logprob_to_dict
from splitserve.runtime.errors import StatusError
from splitserve.v1 import decode_pb2


class TransferState(enum.IntEnum):
    RECEIVING = 1
    WAITING = 2
    CLAIMED = 3
    RELEASED = 4


@dataclass
class KVLease:
    request_id: str
    lease_s: float
    # Set on the engine thread by ``reserve`` (None until then, or when there was no room); its block_table holds
    # the KV.
    seq: Sequence | None = None
    state: TransferState = TransferState.RECEIVING
    expires_at: float = float("inf")  # time.monotonic(); set when the KV is complete
    abort_requested: bool = False
    num_claims: int = 1  # Decode calls that claim it: the samples of one prompt (n)
    claims_left: int = 1

    @property
    def shared(self) -> bool:
        """Pushed for several samples: every claim forks its own sequence off the lease's."""
        return self.num_claims > 1


# ---- reserve and free (engine thread) ----------------------------------------------------------------------------

def reserve(engine: LLMEngine, lease: KVLease, prompt: list[int]) -> Sequence | None:
    """Blocks for the pushed prompt, filed on the lease; None when the pool is full. The Decode call brings the
    request's sampling params; ``Admission`` puts them on the sequence."""
    lease.seq = engine.reserve_for_transfer(lease.request_id, prompt, SamplingParams())
    return lease.seq


def release(engine: LLMEngine, lease: KVLease) -> None:
    """The lease's blocks back to the pool, if its reservation got any (runs after any reservation still queued)."""
    if lease.seq is not None:
        engine.release_transfer(lease.seq)


# ---- run (engine thread) -----------------------------------------------------------------------------------------

class Admission:
    """Joins a claimed sequence, whose KV arrived, to the running batch. KV pushed for the n samples of one prompt is
    shared: each claim forks a sequence of its own off the lease's, and the last one gives the lease's reference
    back."""

    def __init__(self, lease: KVLease, request: decode_pb2.DecodeRequest, params: SamplingParams):
        self.lease = lease
        self.last_claim = lease.claims_left == 0
        self.request = request
        self.params = params
        self.admitted = False  # written and read on the engine thread only
        self.lease_released = False  # likewise

    def admit(self, engine: LLMEngine) -> Sequence:
        first_logprobs = (token_logprob_to_dict(self.request.first_token_logprob)
                          if self.request.HasField("first_token_logprob") else None)
        seq = self.lease.seq
        if self.lease.shared:
            seq = engine.fork_prefilled(self.lease.seq, self.request.request_id, self.params)
            self._release_shared_lease(engine)
            if seq is None:
                raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  "no KV block free for this sample's copy of the prompt's last block")
        seq.sampling_params = self.params  # the push reserved the blocks before the params were known
        seq.tpot_target_s = self.request.tpot_target_seconds
        seq.priority = self.request.priority  # which running request is preempted first
        seq = engine.admit_prefilled(seq, self.request.first_token_id, first_logprobs)
        self.admitted = True
        return seq

    def release_unless_admitted(self, engine: LLMEngine) -> None:
        if self.lease.shared:
            self._release_shared_lease(engine)
        elif not self.admitted:
            release(engine, self.lease)

    def _release_shared_lease(self, engine: LLMEngine) -> None:
        """After the last sample forked off it, the shared KV's own reference goes (the samples keep theirs)."""
        if self.last_claim and not self.lease_released:
            release(engine, self.lease)
            self.lease_released = True


class PrefixHandover:
    """A split prefill's pushed prefix, handed to the prefix cache just before its request is added here."""

    def __init__(self, lease: KVLease):
        self.lease = lease
        self.handed_over = False  # written and read on the engine thread only

    def hand_over(self, engine: LLMEngine) -> None:
        engine.cache_transferred_prefix(self.lease.seq)
        self.handed_over = True

    def release_unless_handed_over(self, engine: LLMEngine) -> None:
        if not self.handed_over:
            release(engine, self.lease)
