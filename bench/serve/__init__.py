"""``splitserve bench serve``: a running router loaded by a seeded workload, measured as its clients see it.

- ``command.py``: the command line (``ServeCommand``, ``main``);
- ``driver.py``: one run (``run_serve_benchmark``, the library's way in), a sweep of rates, the router's view;
- ``report.py``: a run's, a sweep's and the router's figures as text;
- ``run.py``: what one run is: its config (``ServeBenchConfig``) and what it measured (``ServeRun``);
- ``client.py``: the clients, HTTP completions and gRPC ``Generate``, timing every chunk;
- ``prompts.py``: a workload's token ids, of the lengths its ``RequestSpec``s ask for;
- ``plots.py``: a run's and a sweep's pictures.

The workload and the arithmetic of the figures are the measurement library's (``splitserve.measure``).
"""
