"""The benchmarks, ``splitserve bench NAME``: figures printed beside a baseline measured in the same run.

The top of the house: they start clusters with ``splitserve.launcher`` and load them as clients, or run the engine
in-process; nothing imports them (``splitserve/cli.py`` loads each benchmark's module by name when its subcommand
runs). What they share with ``splitserve simulate`` (workloads, the serving figures' arithmetic, phase profiles, SLO
regimes, the codec measurements, ``--json`` / ``--plot``) is the measurement library below them, ``splitserve.measure``.

- ``engine.py``: the engine against ``transformers`` on the same weights, prefill and decode;
- ``codecs.py``: every KV codec's size, speed and model quality against the lossless path; ``codecs_served.py``:
  its ``--through-up`` run, each codec's agreement over a real cluster; ``codec_variants.py``: variants it measures
  that no pod serves (keys per channel, keys before RoPE);
- ``transfer.py``: a prompt's KV pushed between real pods, overlap on and off, per codec;
- ``phases/``: prefill and decode against the machine's limits: per prompt length, batch and context; per prefill
  compute format (and its quality); per KV pool format;
- ``serve/``: a running router as its clients see it;
- ``compare/``: disaggregated, colocated and conditional serving on the same cores, and the map of SLO regimes;
- ``soak.py``: a cluster under load with injected faults;
- ``spec.py``: speculative decoding on vs off, the same requests through two engines taking turns;
- ``structured.py``: structured outputs' cost per token, guided against free decoding;
- ``llamacpp.py``: splitserve's engine beside llama.cpp, the CPU peer, on the same GGUF file;
- ``lm_eval/``: lm-eval against a cluster, each answer checked offline, and its scores side by side per prefill
  format and KV codec on long-context recall documents;
- ``tp.py``: tensor parallelism, TP 1 against TP N on the same cores, its collectives, and the 8-rank projection;
- ``moe.py``: a mixture of experts beside a dense model of the same active parameters, prefill and decode.
"""
