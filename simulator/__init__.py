"""The simulator, ``splitserve simulate``: the router's policies and the engine's scheduler on a virtual clock, step
times from a profile measured on the target machine (``bench phases --profile-out``), for the questions one
machine cannot answer (P:D ratios at 100+ pods, the planner on a day's traffic). docs/simulator.md.

The top of the house, beside the benchmarks: it reuses the measurement library's workloads, figures and profiles
(``splitserve.measure``), the planner's decisions (``deploy``), the router's policies and the engine's scheduler;
nothing imports it (``splitserve/cli.py`` loads it by name when ``splitserve simulate`` runs).

- ``events.py``: the virtual clock;
- ``sim_pod.py``: a pod, the real ``Scheduler`` and ``BlockManager`` stepping at the profile's step times;
- ``cluster.py``: the router's placement over the pods and each request's path, ending in bench serve's records;
- ``run.py``: the command line, one run per rate and the sweep, bench compare's goodput;
- ``ratios.py``: ``simulate ratios``, the best P:D ratio per trace, cluster size and SLO regime;
- ``slo_map.py``: ``simulate slo-map``, the three schedulings under bench compare's SLO regimes;
- ``validate.py``: ``simulate validate``, predictions against a real ``bench compare`` run;
- ``planner_replay.py``: ``simulate planner``, the planner's decisions replayed on a day-shaped rate curve;
- ``planner_check.py``: the planner with its decisions checked in simulation before they apply;
- ``profiles/``: profiles measured here.
"""
