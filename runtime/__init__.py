"""The shared runtime of every splitserve process, below the services and above the engine and the protos.

- ``config.py``: the one configuration mechanism (a dataclass per service, filled from flags and ``SPLITSERVE_*``);
- ``pod.py``: a pod process (``PodConfig``, ``Pod``, ``run_pod``): the engine on its thread, the gRPC server with
  health and reflection, ``/metrics``, the registry heartbeat, graceful shutdown;
- ``pod_status.py``: a pod's load (``LoadTracker``, measured on the engine thread) and the ``PodStatus`` gRPC
  service that pushes it to the router (``PodLoad``, ``GetLoad`` / ``WatchLoad``);
- ``cpus.py``: CPU sets (``--cpus``): pin a process's threads and size torch's thread pools;
- ``metrics.py``: every Prometheus series, defined once (vLLM's names under ``splitserve_``);
- ``registry.py``: how the router finds pods (``RegistryKind``), the Redis record and heartbeat;
- ``roles.py``: ``Role`` (prefill, decode, mixed, router);
- ``errors.py``: ``StatusError``, the one error model (a gRPC status and a message);
- ``transport.py``: gRPC servers and channels, with one set of options and optional (mutual) TLS;
- ``logs.py``: the one logging setup.

Nothing here imports a service (``router``, ``prefill_service``, ``decode_service``), ``kvtransfer`` or the command
line (``splitserve``): the import contracts in ``pyproject.toml`` check it.
"""
