"""The router: the front door of splitserve.

It validates and tokenizes requests, places each on a (prefill, decode) pod pair, and streams the output back
as text, over gRPC (``grpc_api``) and the OpenAI-compatible HTTP API (``openai_api``). Where things live:

- ``router.py``: ``Router``, the request's path (``make_request``, ``generate``, ``abort``), through three rooms:
  ``intake.py`` (request -> token ids, the limits), ``placement.py`` (admission, which pods, retries, migration)
  and ``request_run.py`` (one request in flight: pod calls, stream -> text, completion, metrics);
- ``policies.py``: which pods serve a request, and whether it needs a prefill pod at all;
- ``registry.py``: which pods exist and how loaded they are (static list or Redis heartbeats);
- ``pod_monitor.py``: ``PodMonitor``, the live view of one pod from the health and load streams it pushes;
- ``pod_client.py``: the gRPC calls to one pod; ``config.py``: ``RouterConfig``;
- ``server.py``: the process (both APIs, health, reflection, TLS, graceful stop);
- ``grpc_api.py``: ``splitserve.v1.Generation`` over ``Router`` (and its API-key interceptor);
- ``openai_api.py``: the OpenAI-compatible HTTP API (routes; ``openai_stream.py`` its event streams);
  ``openai_middleware.py`` CORS aside, its middleware (API keys, body limit, request ids); ``openai_requests.py``
  what it accepts (chat: ``openai_chat_requests.py``), ``openai_fields.py`` how strictly; ``openai_responses.py``
  what it answers, ``openai_errors.py`` its errors; ``openai_format.py`` router outputs -> responses and stream
  chunks;
- ``api_keys.py``: the API-key check both APIs share.

Errors are ``splitserve.runtime.errors.StatusError``; parameters cross the wire through ``splitserve.protos.convert``.
"""

from splitserve.router.intake import RouterRequest
from splitserve.router.request_run import Completion, OutputDelta
from splitserve.router.router import Router

__all__ = ["Completion", "OutputDelta", "Router", "RouterRequest"]
