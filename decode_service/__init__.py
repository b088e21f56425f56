"""The decode pod (and the mixed pod): takes in prompt KV from prefill pods and generates the rest of each request.

- ``config.py``: ``DecodeConfig`` (flags / ``SPLITSERVE_*`` environment), role ``decode`` or ``mixed``
- ``server.py``: the ``Decode`` gRPC service, hosted with ``KVTransfer`` (``kvtransfer/receiver.py``, whose leases,
  ``kvtransfer/leases.py``, hold pushed KV until its Decode call; the hand-off as a whole: ``kvtransfer/handoff.py``)
  on one port, and ``main`` (``python -m splitserve.decode_service``)
"""
