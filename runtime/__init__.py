"""The shared runtime of every splitserve process, below the services and above the engine and the protos.

- ``config.py``: the one configuration mechanism (a dataclass per service, filled from flags and ``SPLITSERVE_*``);
- ``pod_server.py``: a pod process (``PodConfig``, ``Pod``, ``run_pod``): the engine on its thread, the gRPC server
  with health and reflection, ``/metrics``, the registry heartbeat, graceful shutdown;
- ``pod_status.py``: a pod's load (``LoadTracker``, measured on the engine thread) and the ``PodStatus`` gRPC
  service that pushes it to the router (``PodLoad``, ``GetLoad`` / ``WatchLoad``);
- ``discovery.py``: how the router finds pods (``RegistryKind``), the Redis record and heartbeat;
- ``cpus.py``: CPU sets (``--cpus``): parse them and pin a process's threads; ``torch_threads.py``: a pod's CPU set
  with torch's thread pools sized to it;
- ``core_lending.py``: a prefill pod computing on a decode pod's CPU while that pod can spare it;
- ``kv_codecs.py``: the KV codecs' names, what the router asks for and what a decode pod accepts;
- ``metrics.py``: every Prometheus series, defined once (vLLM's names under ``splitserve_``);
- ``roles.py``: ``Role`` (prefill, decode, mixed, router);
- ``service_level.py``: the default TTFT and TPOT targets, defined once for the router, the pods, the planner
  and the chart;
- ``errors.py``: ``StatusError``, the one error model (a gRPC status and a message);
- ``transport.py``: gRPC servers and channels, with one set of options and optional (mutual) TLS;
- ``logs.py``: the one logging setup.

Nothing here imports a service (``router``, ``prefill_service``, ``decode_service``), ``kvtransfer`` or the command
line (``splitserve``): the import contracts in ``pyproject.toml`` check it.
"""
