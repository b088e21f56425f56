"""Moving a prompt's KV cache from a prefill pod to a decode pod.

- ``codecs/``: compression of one layer's K or V for a token range (``get_codec(name)``, ``available_codecs()``);
- ``wire.py``: a tensor cut into checked ``KVChunk`` messages (CRC-32C, sequence numbers) and back;
- ``handshake.py``: ``KVLayout`` and the compatibility check between a prefill and a decode pod;
- ``sender.py``: the prefill side, ``KVTransferClient`` / ``KVSender``, pushing layers while later ones compute;
- ``receiver.py``: the decode side, the ``KVTransfer`` gRPC service writing pushed KV into the paged cache;
- ``leases.py``: the decode side's ``TransferTable``, the leases under which received KV waits for its Decode call.

Re-exported here: the codec API, ``get_codec``, ``available_codecs``, ``KVCodec``, ``EncodedKV``.
"""

from splitserve.kvtransfer.codecs import EncodedKV, KVCodec, KVSpan, available_codecs, get_codec

__all__ = ["EncodedKV", "KVCodec", "KVSpan", "available_codecs", "get_codec"]
