"""The router: the front door of splitserve.

It validates and tokenizes requests, places each on a (prefill, decode) pod pair, and streams the output back
as text, over gRPC (``grpc_api.py``) and the OpenAI-compatible HTTP API (``openai/``). Where things live:

- ``router.py``: ``Router``, the request's path (``make_request``, ``generate``, ``abort``), through three rooms:
  ``intake.py`` (``RequestIntake``: request -> token ids, the limits), ``request_run.py`` (``RequestRun``, one
  request in flight and the one owner of its state: it drives the request from admission to its completion) and
  ``placement.py`` (``Placement``: the decisions the run asks for, admit, which pods, retry, where to migrate,
  synchronous over a snapshot of the pods, no pod call);
- ``outputs.py``: what ``generate`` yields, ``OutputDelta`` and ``Completion``, read by both APIs, and
  ``RunOutput``, which makes them from a run's pod messages (text, TTFT and gaps, the one completion's metrics);
- ``route_plan.py``: the placement's vocabulary, ``RoutePlan``, ``SLOTargets``, ``PromptBlocks``;
- ``policies.py``: which pods serve a request, and whether it needs a prefill pod at all (routing policies,
  ``LocalPrefill``); ``latency.py``: ``HybridPlacement``, the same choice from predicted latency;
- ``pods/``: ``registry.py`` (which pods exist and how loaded they are: static list or Redis heartbeats),
  ``monitor.py`` (``PodMonitor``, the live view of one pod from its health and load streams), ``client.py``
  (the gRPC calls to one pod, and every message the router sends a pod or makes in a pod's stead), ``calls.py``
  (one run's calls and holds on its pods);
- ``config.py``: ``RouterConfig``; ``server.py``: the process (both APIs, health, reflection, TLS, graceful stop);
- ``grpc_api.py``: ``splitserve.v1.Generation`` over ``Router`` (and its API-key interceptor);
- ``openai/``: the OpenAI-compatible HTTP API (``app.py`` its routes, ``stream.py`` its event streams,
  ``middleware.py`` its middleware, ``requests.py`` / ``chat_requests.py`` what it accepts, ``fields.py`` how
  strictly, ``responses.py`` what it answers, ``errors.py`` its errors, ``format.py`` router outputs ->
  responses and stream chunks, ``tool_calls.py`` tool calls in generated text);
- ``shadow.py``: ``ShadowChecks``, a share of finished answers served again through the other path and compared
  (``--shadow-check-fraction``, off by default);
- ``choices.py``: the n choices of one request merged into one stream;
- ``api_keys.py``: the API-key check both APIs share.

Errors are ``splitserve.runtime.errors.StatusError``; parameters cross the wire through ``splitserve.protos.convert``.
"""

from splitserve.router.intake import RouterRequest
from splitserve.router.outputs import Completion, OutputDelta
from splitserve.router.router import Router

__all__ = ["Completion", "OutputDelta", "Router", "RouterRequest"]
