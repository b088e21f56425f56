"""The decode pod (and the mixed pod): takes in prompt KV from prefill pods and generates the rest of each request.

- ``config.py``: ``DecodeConfig`` (flags / ``SPLITSERVE_*`` environment), role ``decode`` or ``mixed``
- ``server.py``: the ``Decode`` gRPC service, hosted with ``KVTransfer`` (``kvtransfer/receiver.py``) on one port,
  both reaching the pushed KV's leases through the hand-off (``kvtransfer/handoff.py``, which holds pushed KV until
  its Decode call), and ``main`` (``python -m splitserve.decode_service``)
"""
