"""The router's view of the pods.

- ``registry.py``: ``PodRegistry`` (static list or Redis heartbeats), which pods exist, and ``PodInfo``, how loaded
  each is (its last report plus what this router sent since);
- ``monitor.py``: ``PodMonitor``, one pod's live view from the health and load streams it pushes;
- ``client.py``: ``PodClient``, the gRPC calls to one pod, and every message the router sends a pod or makes in a
  pod's stead (``prefill_request``, ``decode_request``, ``first_token_response``, ``scored_responses``);
- ``calls.py``: ``PodCalls``, one request's calls to its pods (to cancel, their failures as statuses) and its holds
  on them (the router's own count of its requests on each pod), and ``DecodeStream``, D's stream of the request.
"""
