"""How KV is stored in fewer bytes than float32, in the pool and on the wire.

- ``rows.py``: how a pool row stores one token and head's K or V: a float dtype's values, or int8 codes and their
  float16 scale (the int8 codec's encoding as it lies);
- ``scales.py``: how quantized formats (the int8 pool's rows, the KV codecs) round their float16 scales;
- ``open_keys.py``: a scaled pool's open blocks, the float16 keys each query reads for its own block's.
"""
