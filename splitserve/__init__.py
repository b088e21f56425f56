"""splitserve's command line: it starts services, and nothing below imports it (only the benchmarks above do).

- ``cli.py``: ``splitserve up | generate | router | prefill | decode | demo | bench | simulate | build-kernels`` (the
  full list, with one line each, is its docstring, printed by ``splitserve`` alone);
- ``launcher.py``: ``splitserve up``, the whole system on this machine, one process per pod (``Cluster``);
- ``up_config.py``: what ``splitserve up`` starts (``UpConfig``, its flags), and free ports for a test's cluster;
- ``cpu_plan.py``: which CPUs each of those processes runs on, and how many threads it starts;
- ``supervisor.py``: starts those processes, restarts any that exits, stops them in stages;
- ``probes.py``: whether a process of the cluster serves (gRPC health), and which pods the router routes to;
- ``client.py``: ``splitserve generate``, a gRPC client of the router.

The benchmarks (``splitserve bench NAME``, ``bench/``) and the simulator (``splitserve simulate``, ``simulator/``)
are their own packages above this one, over the measurement library (``measure/``): the command line imports a
benchmark's module, or the simulator, by name only when its subcommand runs.
"""
