"""The measurement library below the benchmarks (``splitserve bench``) and the simulator (``splitserve simulate``):
what both need to produce the same figures by the same code, so that neither imports the other and nothing imports
the benchmarks.

- ``workload.py``: what a serving run sends and when (``RequestSpec``s from a seeded ``WorkloadConfig``: random,
  Azure-shaped or a replayed trace);
- ``serve_metrics.py``: per-request timings (``RequestRecord``) to TTFT / TPOT / ITL / E2E, goodput and SLO
  attainment, and the router's Prometheus histograms read back;
- ``slo_regimes.py``: the SLO regimes of a goodput map, and the shape of the ``bench compare`` run they come from;
- ``phase_profile.py``: a pod's speed in fitted step-time numbers (``bench phases`` writes it, the simulator runs
  on it);
- ``codec_texts.py``: the reference text and the greedy-agreement prompts of the KV codec measurements;
- ``codec_agreement.py``: a codec's round trip in an engine's paged cache and the greedy agreement it leaves;
- ``figures.py``: ``--json`` and ``--plot`` (``FiguresOutput``, ``save_results``, matplotlib without a display);
- ``pinning.py``: ``one_pinned_thread``, the single-thread figures' CPU and thread count.
"""
