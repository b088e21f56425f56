"""The planner: sizes the prefill and decode Deployments separately, as Splitwise and DistServe size each pool.

    every interval_s:
      PrometheusSignals.read()      the cluster over the last window_s (rates, percentiles, gauges)  [signals.py]
      DeploymentScaler.replicas()   the Deployments' current replica counts (scale subresource)      [scaler.py]
      Planner.plan(signals, now)    capacity model -> desired counts; bounds, hysteresis, cooldowns  [capacity.py]
      DeploymentScaler.scale()      unless dry_run                                                   [scaler.py]
      PlannerMetrics                every decision, exported on /metrics                             [metrics.py]

``capacity.py`` is pure (no I/O), so its decisions are tested on recorded inputs; ``controller.py`` wires the parts;
``config.py`` is ``PlannerConfig``, its settings from flags and ``SPLITSERVE_*`` like every other process.
"""
