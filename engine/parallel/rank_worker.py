"""A tensor- or pipeline-parallel rank other than 0:
``python -m splitserve.engine.parallel.rank_worker RANK SIZE PORT BLOCKS CPUS POOL_FD``.

Rank 0 (workers.py) starts it and writes to its stdin, first the ``EngineConfig``, then the calls of each step. It

1. pins itself to ``CPUS`` (e.g. ``1`` or ``4,5,6,7``) before torch starts its threads, and asks the kernel to kill
   it when rank 0 dies;
2. maps its KV pool of ``BLOCKS`` blocks of its KV heads from the shared file rank 0 passed as ``POOL_FD`` (rank 0
   reads and writes it too, for the KV transfer: sharded_kv_cache.py), loads the model's files as rank 0 does,
   keeps its shard (layout.py), says ready in the group's store at ``PORT``, and joins the group;
3. runs each call rank 0 sends (``forward`` over its cache, ``compute_logits``, ``time_all_reduce``,
   ``time_all_to_all``) on its shard,
   meeting the other ranks in the collectives, until ``close`` or the end of its stdin. A pipeline rank
   (``pipeline_parallel_size`` > 1, pipeline.py) maps the whole model's KV pool instead, keeps its layers, and runs
   each step's ``pipeline`` call: its micro-batches, received from the rank before and sent on. Any error ends the
   process (its traceback on stderr): rank 0's next collective then fails and names this rank's exit code.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys


def _die_with_parent() -> None:
    """PR_SET_PDEATHSIG: SIGKILL this process when rank 0 exits, however it exits (Linux; a no-op elsewhere)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def main(argv: list[str]) -> None:
    rank, size, port, num_blocks = (int(a) for a in argv[:4])
    cpus = [int(c) for c in argv[4].split(",")]
    pool_fd = int(argv[5])
    os.sched_setaffinity(0, cpus)  # before torch is imported: every thread it starts inherits the mask
    _die_with_parent()

    # Imported only now, once pinned.
    import torch

    from splitserve.engine.parallel.layout import plan_shards
    from splitserve.engine.parallel.pipeline import PipelineStage, layer_ranges, stage_model
    from splitserve.engine.parallel.process_group import TensorParallelGroup, open_store
    from splitserve.engine.parallel.sharded_kv_cache import map_pool
    from splitserve.engine.parallel.sharded_model import ShardedLlama, metadata_from_plan
    from splitserve.engine.parallel.workers import rank_kv_cache, read_message
    from splitserve.engine.weights.model_files import load_model_files

    torch.set_num_threads(len(cpus))
    stdin = sys.stdin.buffer
    (config,) = read_message(stdin)
    store = open_store(rank, size, port)
    loaded = load_model_files(config.model, seed=config.seed, quantization=config.quantization)
    pipeline = config.pipeline_parallel_size > 1
    if pipeline:
        kv_cache = map_pool(pool_fd, loaded.config, num_blocks, config.cache.block_size,
                            getattr(torch, config.cache.cache_dtype))
        model = stage_model(PipelineStage, config, loaded.config, loaded.state_dict,
                            layer_ranges(loaded.config, size)[rank])
    else:
        shards = plan_shards(loaded.config, size)
        kv_cache = rank_kv_cache(config, loaded.config, shards, rank, {rank: pool_fd}, num_blocks)
        model = ShardedLlama.for_rank(config, loaded.config, loaded.state_dict, shards[rank])
    os.close(pool_fd)  # the mapping stays
    del loaded
    store.set(f"ready/{rank}", "1")
    group = TensorParallelGroup(store, rank, size)
    if pipeline:
        model.group = group
    else:
        model.shard_over(group, shards)
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=config.device)
    with torch.inference_mode():
        while (message := read_message(stdin)) is not None and message[0] != "close":
            method, *args = message
            if method == "forward":
                input_ids, positions, plan = args
                model(as_tensor(input_ids), as_tensor(positions), kv_cache, metadata_from_plan(plan, config.device))
            elif method == "pipeline":
                positions, plan = args
                model.run_stage(as_tensor(positions), plan, kv_cache)
            elif method in ("compute_logits", "time_all_reduce", "time_all_to_all"):
                getattr(model, method)(*args)
            else:
                raise ValueError(f"rank {rank}: unknown call {method!r} from rank 0")


if __name__ == "__main__":
    main(sys.argv[1:])
