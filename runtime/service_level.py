"""The service level every part of splitserve is held to by default: the TTFT and TPOT targets, defined here once.

Its readers: the router (``RouterConfig.slo_ttft_s`` / ``slo_tpot_s``: goodput, hybrid placement, and the TPOT
target each decode request carries to its pod's TPOT-slack chunking), ``splitserve up`` (the router's fields, passed
on, and its decode pods' ``--tpot-target-s``), the planner (``PlannerConfig.ttft_target_s`` / ``tpot_target_s``) and
the simulator (its router's targets, from ``RouterConfig``'s defaults). The Helm chart holds the same figures in one
value, ``serviceLevel`` (tests/deploy/test_chart_flags.py checks that the two agree and that the one value
reaches every rendered place). An operator overrides them with the flags above; a request may name its own
(docs/api.md).

It sits below the router, the pods, the planner, ``bench`` and ``simulate`` in the import layers, and imports
nothing of theirs.
"""

# 1 s to the first token and 100 ms per token after it: an interactive chat's targets on the 2-core machines the
# project is measured on (docs/PERFORMANCE.md: the default hybrid met both for 40 of 40 requests at 0.5 req/s).
# A request's own targets (router/intake.py's ServiceLevel) take precedence over these.
DEFAULT_TTFT_S = 1.0  # seconds from arrival to the first token
DEFAULT_TPOT_S = 0.1  # seconds per output token after the first
