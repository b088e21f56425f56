"""The decode pod's table of transferred KV: the ``KVLease`` of every request between its push and its Decode call.

``TransferTable`` moves a lease through the states that ``handoff.py`` narrates (the hand-off as a whole, and what
frees the blocks on each way out):

    open()           a RECEIVING lease for PushKV's header, before its blocks are reserved
    mark_received()  RECEIVING -> WAITING: every chunk is in; the lease's ``lease_s`` start now
    claim()          WAITING -> CLAIMED for a Decode call (shared KV: at its last claim); forget() then drops it
    release()        -> RELEASED: the blocks go back (``handoff.release``, on the engine thread)
    abort()          the Abort RPC: a WAITING lease is released, a RECEIVING one asked to stop
    reap_expired()   the reaper's round (every ``REAP_INTERVAL_S``): WAITING leases whose time is up are released

Everything here runs on the event loop; the blocks are freed on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from splitserve.engine.engine_loop import EngineLoop
from splitserve.kvtransfer.handoff import KVLease, TransferState, release
from splitserve.runtime.errors import StatusError

logger = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.25  # how late an expired lease may be reclaimed; the scan is a walk over a small dict


class TransferTable:
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
        # On the engine thread, after any reservation still queued there has filed its sequence.
        await self._engine_loop.run(lambda engine: release(engine, lease))
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
