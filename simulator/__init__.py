"""The simulator, ``splitserve simulate``: the router's policies and the engine's scheduler on a virtual clock, step
times from a profile measured on the target machine (``bench phases --profile-out``), for the questions one
machine cannot answer (P:D ratios at 100+ pods, the planner on a day's traffic). docs/simulator.md.

The top of the house: it reuses the benchmarks' workloads and figures (``bench``), the planner's decisions
(``deploy``), the router's policies and the engine's scheduler; nothing imports it (``splitserve/cli.py`` loads it
by name when ``splitserve simulate`` runs).

- ``events.py``: the virtual clock;
- ``pod.py``: a pod, the real ``Scheduler`` and ``BlockManager`` stepping at the profile's step times;
- ``cluster.py``: the router's placement over the pods and each request's path, ending in bench serve's records;
- ``run.py``: the command line, one run per rate and the sweep, bench compare's goodput;
- ``profiles/``: profiles measured here.
"""
