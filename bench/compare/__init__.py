"""``splitserve bench compare``: disaggregated, colocated and conditional serving side by side on the same cores.

- ``command.py``: the command line and the run, topology by topology (``run_compare``, ``measure_topology``);
- ``plan.py``: the topologies (``plan_topologies``), one topology's result, the best colocated baseline;
- ``slo_map.py``: ``--slo-map``, goodput of every topology on a map of SLO regimes;
- ``vllm_server.py``: vLLM's CPU build as one more topology of the map;
- ``plots.py``: the picture of a run.
"""
