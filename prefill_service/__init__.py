"""The prefill pod: runs prompts' prefill in batches and streams their KV to decode pods, layer by layer.

- ``config.py``: ``PrefillConfig`` (flags / ``SPLITSERVE_*`` environment)
- ``server.py``: the ``Prefill`` gRPC service and ``main`` (``python -m splitserve.prefill_service``)
- ``kv_export.py``: the prefill side of the hand-off narrated (open, compute and push, hold, free, and what frees
  what on each way out), and the engine hook that hands each computed layer's K/V to the request's ``KVSender``
"""
