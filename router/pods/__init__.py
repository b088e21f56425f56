"""The router's view of the pods.

- ``registry.py``: ``PodRegistry`` (static list or Redis heartbeats), which pods exist, and ``PodInfo``, how loaded
  each is (its last report plus what this router sent since);
- ``monitor.py``: ``PodMonitor``, one pod's live view from the health and load streams it pushes;
- ``client.py``: ``PodClient``, the gRPC calls to one pod, and the ``PrefillRequest`` / ``DecodeRequest`` messages
  the router sends (``prefill_request``, ``decode_request``).
"""
