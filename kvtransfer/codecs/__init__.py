"""KV-cache codecs: compress one layer's K or V of a token range for the trip from a prefill pod to a decode pod.

``get_codec(name)`` finds one by name (see base.py for the interface and the registry):

| name   | module        | what it sends                                                   | bytes/element (D=64) |
|--------|---------------|-----------------------------------------------------------------|----------------------|
| none   | raw.py        | the cache dtype as is (lossless)                                | 4 (fp32), 2 (bf16)   |
| bf16   | raw.py        | bfloat16                                                        | 2                    |
| fp8    | symmetric.py  | float8 e4m3fn, float16 scale per (token, head)                  | 1.03125              |
| int8   | symmetric.py  | int8, float16 scale per 16 channels of a (token, head)          | 1.125                |
| int4   | kivi.py       | 4 bits; keys per channel over 32-token groups, values per token | 0.5635               |
| kivi8  | kivi.py       | as int4 at 8 bits; the prompt's first 4 and last 32 tokens fp16 | 1.0635 (+ kept rows) |
| kivi4  | kivi.py       | as int4, the prompt's first 4 and last 32 tokens in float16     | 0.5635 (+ kept rows) |
| kivi2  | kivi.py       | as kivi4 at 2 bits                                              | 0.3135 (+ kept rows) |
| X+zstd | zstd.py       | codec X, then zstd over payload and scales (lossless)           | data-dependent       |

``engine/kv_formats/scales.py``: how the quantizing codecs (and the int8 KV pool) store their scales and range ends
(float16, rounded outward).

Only base.py is imported here; a codec's module (and zstandard) loads when the codec is first requested.
"""

from splitserve.kvtransfer.codecs.base import EncodedKV, KVCodec, KVSpan, available_codecs, get_codec

__all__ = ["EncodedKV", "KVCodec", "KVSpan", "available_codecs", "get_codec"]
