"""The router: the front door of splitserve.

It validates and tokenizes requests, places each on a (prefill, decode) pod pair, and streams the output back
as text, over gRPC (``grpc_api``) and the OpenAI-compatible HTTP API (``openai_api``). Where things live:

- ``router.py``: ``Router``, the request's path (``make_request``, ``generate``, ``abort``);
- ``policies.py``: which pods serve a request, and whether it needs a prefill pod at all;
- ``registry.py``: which pods exist and how loaded they are (static list or Redis heartbeats);
- ``pod_client.py``: the gRPC calls to one pod; ``wire_params.py``: parameters and logprobs on the wire;
- ``errors.py``: ``RouterError``, the one error model; ``config.py``: ``RouterConfig``;
- ``server.py``: the process (both APIs, health, reflection, graceful stop).
"""

from router.errors import RouterError
from router.router import Completion, OutputDelta, Router, RouterRequest

__all__ = ["Completion", "OutputDelta", "Router", "RouterError", "RouterRequest"]
