"""Tensor and pipeline parallelism inside one engine (``EngineConfig.tensor_parallel_size``,
``pipeline_parallel_size``): the model split over ranks that are processes of their own, one process group per
engine.

- ``layout.py``: which heads, intermediate slice and vocabulary rows each rank holds, and its slice of the weights;
- ``process_group.py``: the gloo group and its collectives (all-reduce, the logits' gather, all-to-all), counted;
  ``shm_all_reduce.py``: the all-reduce through shared memory, for ranks on one x86-64 host;
- ``sharded_model.py``: ``ShardedLlama``, one rank's model: the ordinary one over its shard, summed across ranks;
- ``expert_dispatch.py``: expert parallelism by all-to-all, a mixture of experts' tokens sent to their experts' ranks;
- ``sharded_kv_cache.py``: ``ShardedKVCache``, one rank's KV pool in shared memory that rank 0 maps for every rank,
  read and written by KV head range from outside the engine (KV transfer between engines of different degrees);
- ``pipeline.py``: pipeline parallelism: each rank's layers, a step's rows in micro-batches through the ranks;
- ``workers.py``: rank 0 (the engine's process) starts, drives, watches and stops the other ranks;
- ``rank_worker.py``: the other ranks' process.
"""
