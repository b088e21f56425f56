"""The decode pod's side of the hand-off: ``KVHandoff``, the table of every pushed request's ``KVLease``, and every
move of a lease between its states. The pod's two services call it once per step, and nothing else touches a lease:

    step     state      who calls                      what happens
    reserve  RECEIVING  PushKV's header                ``reserve`` files a lease (ALREADY_EXISTS if the request
                        (``receiver.py``)              already has KV here), then takes the prompt's blocks on the
                                                       engine thread (``LLMEngine.reserve_for_transfer``) and files
                                                       the sequence on the lease there: a release queued after it
                                                       finds them even if the handler was cancelled meanwhile
    receive  RECEIVING  PushKV's chunks                ``KVIntake.store`` (``receiver.py``) writes each into those
                                                       blocks (the engine never schedules a reserved sequence, so
                                                       writing beside its thread is safe)
             WAITING    PushKV's trailer               ``received``: every chunk is in; the lease's clock
                                                       (``lease_s``) starts
    claim    CLAIMED    Decode                         ``claim`` (NOT_FOUND: never pushed or expired;
                        (``decode_service/server.py``) FAILED_PRECONDITION: still arriving): an ``Admission``, or a
                                                       split prefill's ``PrefixHandover``. KV pushed for the n
                                                       samples of one prompt (``num_claims`` > 1) stays WAITING
                                                       through its first n - 1 claims
    run                 the engine thread, one of:     ``Admission.admit``: a prefilled request joins the running
                                                       batch with its first token (``LLMEngine.admit_prefilled``);
                                                       a sample of shared KV first forks a sequence of its own
                                                       (``LLMEngine.fork_prefilled``: the full blocks shared, the
                                                       last one copied). ``PrefixHandover.hand_over``: a split
                                                       prefill's prefix goes to the prefix cache
                                                       (``LLMEngine.cache_transferred_prefix``) just before the
                                                       request is added, which finds it there and prefills the rest
    release  RELEASED   Decode, as it ends             ``release_claim``: the entry leaves the table (the engine owns
                                                       what it admitted) and, queued on the engine thread after the
                                                       admission, so that it knows whether that ran, whatever was not
                                                       taken goes back (``LLMEngine.release_transfer``)

Every other way out, and what frees the blocks:

    way out                      who frees the blocks
    finish                       the engine, when the admitted sequence finishes (as any request's); shared KV's own
                                 reference: the ``Admission`` of the last sample's claim
    lease expiry (WAITING)       the reaper (every ``REAP_INTERVAL_S``): ``reap_expired`` -> ``release``
    abort, WAITING               ``abort`` (the Abort RPC) -> ``release``
    abort, RECEIVING             ``abort`` sets ``abort_requested``; the PushKV handler sees it at its next message and
                                 fails with CANCELLED: the error row below
    abort, CLAIMED               not the table's: the Decode call's ``engine_loop.abort`` frees an admitted request
    error or cancel in PushKV    the handler's ``finally``: ``release`` (anything not acknowledged), once its chunk
                                 writers are done
    error or cancel in Decode    ``release_claim``, as at every end of the call
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

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.protos.convert import token_logprob_to_dict
from splitserve.runtime.errors import StatusError
from splitserve.v1 import decode_pb2

logger = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.25  # how late an expired lease may be reclaimed; the scan is a walk over a small dict


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


class KVHandoff:
    """The decode pod's pushed KV, from its push's header to its Decode call (module docstring)."""

    def __init__(self, engine_loop: EngineLoop, default_lease_s: float,
                 on_expired: Callable[[str], None] = lambda request_id: None):
        self._engine_loop = engine_loop
        self.default_lease_s = default_lease_s
        self._on_expired = on_expired  # hears each lease the reaper released: KV nobody claimed nor dropped
        self._leases: dict[str, KVLease] = {}
        self._reaper: asyncio.Task | None = None

    def get(self, request_id: str) -> KVLease | None:
        return self._leases.get(request_id)

    def __len__(self) -> int:
        return len(self._leases)

    # ---- reserve and receive (PushKV) --------------------------------------------------------------------------

    async def reserve(self, request_id: str, prompt: list[int], lease_s: float = 0.0, num_claims: int = 1) -> KVLease:
        """A RECEIVING lease for a push, with blocks for its ``prompt`` (the lease's ``seq``). ``lease_s`` 0 takes the
        pod's default; ``num_claims``: the Decode calls that will claim it. ALREADY_EXISTS if the request id already
        has KV here, RESOURCE_EXHAUSTED when the pool has no room, INVALID_ARGUMENT for a prompt the engine refuses;
        nothing stays filed then."""
        if request_id in self._leases:
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} already has KV here")
        lease = KVLease(request_id, lease_s or self.default_lease_s, claims_left=num_claims, num_claims=num_claims)
        self._leases[request_id] = lease
        try:
            seq = await self._engine_loop.run(lambda engine: _reserve_blocks(engine, lease, prompt))
            if seq is None:
                free, total = await self._engine_loop.run(
                    lambda engine: (engine.block_manager.num_free_blocks, engine.block_manager.num_blocks))
                raise StatusError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room for the KV of {len(prompt)} tokens: "
                                  f"{free} of {total} blocks free")
        except BaseException as error:
            # Queued after the reservation on the engine thread: it finds the blocks even if this call was cancelled.
            await asyncio.shield(self.release(request_id))
            if isinstance(error, ValueError):
                raise StatusError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from error
            raise
        return lease

    def received(self, request_id: str) -> float:
        """RECEIVING -> WAITING: every chunk is in, and the lease starts now. Returns its seconds."""
        lease = self._leases[request_id]
        lease.state = TransferState.WAITING
        lease.expires_at = time.monotonic() + lease.lease_s
        return lease.lease_s

    # ---- claim and release (Decode) ----------------------------------------------------------------------------

    def claim(self, request: decode_pb2.DecodeRequest, params: SamplingParams) -> Admission | PrefixHandover:
        """WAITING -> CLAIMED (shared KV: at its last claim) for a Decode call: the ``Admission`` of a prefilled
        request, or the ``PrefixHandover`` of a split prefill's prefix (``kv_prefix_tokens``), each to run on the
        engine thread. The KV is the request's own, or ``kv_request_id``'s (shared by the n samples of a prompt).
        NOT_FOUND when no KV is here (never pushed, expired, released, every claim made), FAILED_PRECONDITION while
        it is still arriving, INVALID_ARGUMENT for another prompt."""
        kv_request_id = request.kv_request_id or request.request_id
        prompt = list(request.prompt_token_ids)
        if request.kv_prefix_tokens:
            return PrefixHandover(self._claim(kv_request_id, prompt[:request.kv_prefix_tokens]))
        return Admission(self._claim(kv_request_id, prompt), request, params)

    def _claim(self, request_id: str, prompt_token_ids: list[int]) -> KVLease:
        lease = self._leases.get(request_id)
        if lease is None:
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no KV for request {request_id!r} on this pod: never "
                              "pushed, or its lease expired")
        if lease.state is not TransferState.WAITING:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the KV of request {request_id!r} is {lease.state.name}, not waiting for Decode")
        if lease.seq.prompt_token_ids != prompt_token_ids:
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"prompt_token_ids differ from the prompt pushed for request {request_id!r}")
        lease.claims_left -= 1
        if lease.claims_left == 0:
            lease.state = TransferState.CLAIMED
        return lease

    async def release_claim(self, claim: Admission | PrefixHandover) -> None:
        """The Decode call that made ``claim`` ended, however it did: a claimed entry leaves the table (the engine
        owns the blocks it took), and what it did not take goes back, on the engine thread after the claim's own
        command (if that was queued at all), so that it knows whether it ran."""
        if claim.last_claim:
            self._leases.pop(claim.lease.request_id, None)
        await self._engine_loop.run(claim.release_unless_taken)

    # ---- release, abort and expiry -----------------------------------------------------------------------------

    async def release(self, request_id: str) -> bool:
        """-> RELEASED: give the request's blocks back (engine thread); False if it held none here."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        lease.state = TransferState.RELEASED
        # On the engine thread, after any reservation still queued there has filed its sequence.
        await self._engine_loop.run(lambda engine: _release_blocks(engine, lease))
        return True

    async def abort(self, request_id: str) -> bool:
        """The Abort RPC: release WAITING KV now; ask a RECEIVING push to stop. False if the id has no KV here."""
        lease = self._leases.get(request_id)
        if lease is None or lease.state is TransferState.CLAIMED:
            return False
        if lease.state is TransferState.RECEIVING:
            lease.abort_requested = True
            return True
        return await self.release(request_id)

    async def reap_expired(self) -> list[str]:
        """Release every WAITING lease whose time is up; returns their request ids."""
        now = time.monotonic()
        expired = [lease.request_id for lease in self._leases.values()
                   if lease.state is TransferState.WAITING and lease.expires_at <= now]
        for request_id in expired:
            logger.info("KV lease of request %s expired; releasing its blocks", request_id)
            await self.release(request_id)
            self._on_expired(request_id)
        return expired

    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_forever(), name="kv-lease-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                await self.reap_expired()
            except Exception:  # a failed round must not stop reclaiming: the next one retries
                logger.exception("releasing expired KV leases failed")


# ---- the engine thread's side --------------------------------------------------------------------------------------

def _reserve_blocks(engine: LLMEngine, lease: KVLease, prompt: list[int]) -> Sequence | None:
    """Blocks for the pushed prompt, filed on the lease; None when the pool is full. The Decode call brings the
    request's sampling params; ``Admission`` puts them on the sequence."""
    lease.seq = engine.reserve_for_transfer(lease.request_id, prompt, SamplingParams())
    return lease.seq


def _release_blocks(engine: LLMEngine, lease: KVLease) -> None:
    """The lease's blocks back to the pool, if its reservation got any (runs after any reservation still queued)."""
    if lease.seq is not None:
        engine.release_transfer(lease.seq)


class Admission:
    """Joins a claimed sequence, whose KV arrived, to the running batch. KV pushed for the n samples of one prompt is
    shared: each claim forks a sequence of its own off the lease's, and the last one gives the lease's reference
    back."""

    def __init__(self, lease: KVLease, request: decode_pb2.DecodeRequest, params: SamplingParams):
        self.lease = lease
        self.first_claim = lease.claims_left == lease.num_claims - 1  # one load per transfer, however many claims
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

    def release_unless_taken(self, engine: LLMEngine) -> None:
        if self.lease.shared:
            self._release_shared_lease(engine)
        elif not self.admitted:
            _release_blocks(engine, self.lease)

    def _release_shared_lease(self, engine: LLMEngine) -> None:
        """After the last sample forked off it, the shared KV's own reference goes (the samples keep theirs)."""
        if self.last_claim and not self.lease_released:
            _release_blocks(engine, self.lease)
            self.lease_released = True


class PrefixHandover:
    """A split prefill's pushed prefix, handed to the prefix cache just before its request is added here."""

    first_claim = last_claim = True  # a prefix is pushed for one request

    def __init__(self, lease: KVLease):
        self.lease = lease
        self.handed_over = False  # written and read on the engine thread only

    def hand_over(self, engine: LLMEngine) -> None:
        engine.cache_transferred_prefix(self.lease.seq)
        self.handed_over = True

    def release_unless_taken(self, engine: LLMEngine) -> None:
        if not self.handed_over:
            _release_blocks(engine, self.lease)
