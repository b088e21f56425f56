"""Moving a prompt's KV cache from a prefill pod to a decode pod.

- ``kvtransfer.codecs``: compression of one layer's K or V for a token range (``get_codec(name)``).

Re-exported here: the codec API, ``get_codec``, ``available_codecs``, ``KVCodec``, ``EncodedKV``.
"""

from kvtransfer.codecs import EncodedKV, KVCodec, available_codecs, get_codec

__all__ = ["EncodedKV", "KVCodec", "available_codecs", "get_codec"]
