"""The decode pod's table of transferred KV: blocks held for a request between its push and its Decode call.

A lease's path, one ordered ``TransferState``:

    RECEIVING   open(): PushKV's header arrived; the prompt's blocks are reserved (on the engine thread, straight
                onto the lease) and chunks are written into them
    WAITING     mark_received(): every chunk is in; the KV waits for Decode under a lease of ``lease_s`` seconds
    CLAIMED     claim(): Decode took it and is admitting the sequence into the running batch; forget() then
                drops the entry, the engine owning the blocks from there. KV pushed for the n samples of one
                prompt (``num_claims`` > 1) stays WAITING through its first n - 1 claims: each Decode call forks
                a sequence of its own off the lease's (LLMEngine.fork_prefilled), and after the last one the
                lease's own reference goes back (release)
    RELEASED    release(): the blocks went back to the pool (lease expired, Abort, a failed push or admission)

The reaper releases WAITING leases whose time is up. It never touches a RECEIVING one: its PushKV handler may be
writing into the blocks, so that handler alone releases them (it does on any error or cancellation). An Abort of
a RECEIVING transfer sets ``abort_requested``, which the handler checks at its next message.

Everything here runs on the event loop; the blocks are freed on the engine thread (``release_transfer``).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

import grpc

from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.sequence import Sequence
from splitserve.runtime.errors import StatusError

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
    # Set on the engine thread by engine.reserve_for_transfer (None until then, or when there was no room);
    # its block_table holds the KV.
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


class TransferTable:
    def __init__(self, engine_loop: EngineLoop, default_lease_s: float):
        self._engine_loop = engine_loop
        self.default_lease_s = default_lease_s
        self._leases: dict[str, KVLease] = {}
        self._reaper: asyncio.Task | None = None

    def get(self, request_id: str) -> KVLease | None:
        return self._leases.get(request_id)

    def __len__(self) -> int:
        return len(self._leases)

    # ---- PushKV ----------------------------------------------------------------------------------------------

    def open(self, request_id: str, lease_s: float = 0.0, num_claims: int = 1) -> KVLease:
        """A RECEIVING lease for a push, before its blocks are reserved; ALREADY_EXISTS if the request id already
        has KV here. ``lease_s`` 0 takes the pod's default; ``num_claims``: the Decode calls that will claim it."""
        if request_id in self._leases:
            raise StatusError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} already has KV here")
        lease = KVLease(request_id, lease_s or self.default_lease_s, claims_left=num_claims, num_claims=num_claims)
        self._leases[request_id] = lease
        return lease

    def mark_received(self, request_id: str) -> float:
        """RECEIVING -> WAITING; the lease starts now. Returns its seconds."""
        lease = self._leases[request_id]
        lease.state = TransferState.WAITING
        lease.expires_at = time.monotonic() + lease.lease_s
        return lease.lease_s

    # ---- Decode ----------------------------------------------------------------------------------------------

    def claim(self, request_id: str, prompt_token_ids: list[int]) -> KVLease:
        """WAITING -> CLAIMED (shared KV: at its last claim): the lease whose sequence to admit (or, shared, to fork
        off). NOT_FOUND when no KV is here (never pushed, expired, released, every claim made), FAILED_PRECONDITION
        while it is still arriving, INVALID_ARGUMENT for another prompt."""
        lease = self._leases.get(request_id)
        if lease is None:
            raise StatusError(grpc.StatusCode.NOT_FOUND, f"no KV for request {request_id!r} on this pod: never "
                              "pushed, or its lease expired")
        if lease.state is not TransferState.WAITING:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"the KV of request {request_id!r} is {lease.state.name}, not waiting for Decode")
        if lease.seq.prompt_token_ids != list(prompt_token_ids):
            raise StatusError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"prompt_token_ids differ from the prompt pushed for request {request_id!r}")
        lease.claims_left -= 1
        if lease.claims_left == 0:
            lease.state = TransferState.CLAIMED
        return lease

    def forget(self, request_id: str) -> None:
        """A CLAIMED entry leaves the table: the engine owns its blocks now."""
        self._leases.pop(request_id, None)

    # ---- releasing -------------------------------------------------------------------------------------------

    async def release(self, request_id: str) -> bool:
        """Give the request's blocks back (engine thread); False if it held none here."""
        lease = self._leases.pop(request_id, None)
        if lease is None:
            return False
        lease.state = TransferState.RELEASED

        def release_blocks(engine) -> None:
            # On the engine thread, after any reservation still queued there has filed its sequence.
            if lease.seq is not None:
                engine.release_transfer(lease.seq)

        await self._engine_loop.run(release_blocks)
        return True

    async def abort(self, request_id: str) -> bool:
        """Abort RPC: release WAITING KV now; ask a RECEIVING push to stop. False if the id has no KV here."""
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
