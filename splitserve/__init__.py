"""splitserve's command line, the top of the house: it starts services and nothing below imports it.

- ``cli.py``: ``splitserve up | generate | router | prefill | decode | demo | bench | build-kernels`` (the full list,
  with one line each, is its docstring, printed by ``splitserve`` alone);
- ``launcher.py``: ``splitserve up``, the whole system on this machine, one process per pod;
- ``cpu_plan.py``: which CPUs each of those processes runs on, and how many threads it starts;
- ``supervisor.py``: starts those processes, restarts any that exits, stops them in stages;
- ``client.py``: ``splitserve generate``, a gRPC client of the router;
- ``bench/``: ``splitserve bench NAME``, one module per benchmark (engine, codecs, transfer: figures beside a
  baseline measured in the same run; serve: a running router as its clients see it; phases: prefill and decode
  on this machine).
"""
