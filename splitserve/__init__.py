"""splitserve's command line: it starts services, and nothing below imports it (only the benchmarks above do).

- ``cli.py``: ``splitserve up | generate | router | prefill | decode | demo | bench | build-kernels`` (the full list,
  with one line each, is its docstring, printed by ``splitserve`` alone);
- ``launcher.py``: ``splitserve up``, the whole system on this machine, one process per pod;
- ``cpu_plan.py``: which CPUs each of those processes runs on, and how many threads it starts;
- ``supervisor.py``: starts those processes, restarts any that exits, stops them in stages;
- ``client.py``: ``splitserve generate``, a gRPC client of the router.

The benchmarks (``splitserve bench NAME``) are their own top-level package, ``bench/``, above this one: the
command line imports a benchmark's module by name only when its subcommand runs.
"""
