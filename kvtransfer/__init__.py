"""Moving a prompt's KV cache from a prefill pod to a decode pod.

- ``codecs/``: compression of one layer's K or V for a token range (``get_codec(name)``, ``available_codecs()``);
- ``link_codec.py``: ``kv_codec=auto``, the codec that moves a prompt's KV soonest over a link, among those whose
  measured quality (``quality/``) clears the floor;
- ``wire.py``: a tensor cut into checked ``KVChunk`` messages (CRC-32C, sequence numbers) and back;
- ``shm.py``: the same-host hand-off, chunk bytes through a shared-memory file, messages still over gRPC;
- ``shm_arena.py``: its prefill side, the link's choice and the arena a push's chunks are framed into;
- ``handshake.py``: ``KVLayout`` and the compatibility check between a prefill and a decode pod;
- ``sender.py``: the prefill side, ``KVTransferClient`` / ``KVSender``, pushing layers while later ones compute;
- ``receiver.py``: the decode side, the ``KVTransfer`` gRPC service writing pushed KV into the paged cache;
- ``handoff.py``: the decode side's hand-off, narrated and owned in one place: ``KVHandoff``, the lease under which
  each pushed request's KV waits for its Decode call, every move between its states (one call per step: reserve,
  received, claim, release), and what frees its blocks on each way out;
- ``push_hold.py``: a test hook (``SPLITSERVE_TEST_HOLD_PUSH``) that holds a push at a named point, so that a fault
  test kills a pod at a known moment of it, not by racing the machine's speed.

Re-exported here: the codec API, ``get_codec``, ``available_codecs``, ``KVCodec``, ``EncodedKV``.
"""

from splitserve.kvtransfer.codecs import EncodedKV, KVCodec, KVSpan, available_codecs, get_codec

__all__ = ["EncodedKV", "KVCodec", "KVSpan", "available_codecs", "get_codec"]
