"""Rank 0's side of a tensor-parallel engine: it starts the other ranks, sends them each step, watches them, and
stops them.

``start_tensor_parallel`` is what the ``ModelRunner`` calls for ``tensor_parallel_size`` > 1. The engine's process is
rank 0: it owns the scheduler, the block manager and the sampler, and holds shard 0 of the model. It

1. opens the group's store on a free loopback port, creates every rank's KV pool as a shared file
   (sharded_kv_cache.py), and starts ranks 1..N-1 as processes of their own (``python -m
   splitserve.engine.parallel.rank_worker``, rank_worker.py), each given its pool's file and pinned to its share of
   the cores this process may run on (rank 0 keeps the first share for the thread that steps the engine, and one
   compute thread per core of it: restored when the workers stop);
2. loads its own shard while they load theirs, waits until each says ready (a rank that exits meanwhile fails the
   start, naming it), and joins the gloo group with them;
3. then, every step, writes the call its model is about to run (``forward`` with the step's token ids, positions and
   the lists its attention metadata is built from, or ``compute_logits`` with the rows to score) to each worker's
   stdin, length-prefixed pickles in the order they are run, and runs it itself: the ranks meet in the step's
   collectives. KV read and written from outside the engine needs no call: rank 0 maps every rank's pool;
4. stops them when the model is garbage-collected or ``close``d: a ``close`` message, then a kill after a grace
   period. A worker also exits when its stdin closes and dies with rank 0 (``PR_SET_PDEATHSIG``): no orphan holds
   cores after the engine.

A rank that exits or hangs fails the step that needs it with ``TensorParallelError`` naming the ranks and their exit
codes (the collectives time out after ``COLLECTIVE_TIMEOUT_S``); the engine then fails that step's requests
(``EngineStepError``), and every later step fails the same way: a tensor-parallel engine restarts whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import BinaryIO, TypeVar

import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.parallel.layout import RankShard, even_ranges, kv_cache_blocks, plan_shards
from splitserve.engine.parallel.process_group import TensorParallelGroup, check_device, open_store
from splitserve.engine.parallel.sharded_kv_cache import ShardedKVCache, create_pools
from splitserve.engine.parallel.sharded_model import ShardedLlama

logger = logging.getLogger(__name__)

M = TypeVar("M")  # rank 0's model
T = TypeVar("T")  # rank 0's view of the KV pools

READY_TIMEOUT_S = 600.0  # loading a large model's file on every rank takes a while
STOP_GRACE_S = 10.0
WATCH_INTERVAL_S = 0.2  # how soon a serving process learns that a rank exited between steps
_FRAME = struct.Struct("<Q")  # each message's length in bytes


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine exited, hung or failed."""


def write_message(stream: BinaryIO, message: tuple) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_FRAME.pack(len(payload)) + payload)
    stream.flush()


def read_message(stream: BinaryIO) -> tuple | None:
    """The next message, or None at the end of the stream (rank 0 is gone)."""
    header = stream.read(_FRAME.size)
    if len(header) < _FRAME.size:
        return None
    return pickle.loads(stream.read(_FRAME.unpack(header)[0]))


def cpu_shares(cpus: list[int], size: int) -> list[list[int]]:
    """Each rank's cores: ``cpus`` cut into ``size`` contiguous shares; with fewer cores than ranks, one core each,
    shared round-robin."""
    if len(cpus) < size:
        return [[cpus[r % len(cpus)]] for r in range(size)]
    return [cpus[a:b] for a, b in even_ranges(len(cpus), size)]


class RankWorkers:
    """Ranks 1..N-1 as processes; ``procs[i]`` is rank i + 1."""

    def __init__(self, procs: list[subprocess.Popen], restore: tuple[set[int], int]):
        self.procs = procs
        self._restore = restore  # rank 0's thread affinity and torch thread count before it pinned itself
        self._closed = False

    @classmethod
    def start(cls, config: EngineConfig, port: int, num_blocks: int, shares: list[list[int]],
              pool_fds: list[int]) -> RankWorkers:
        """Ranks 1..N-1 started, ``pool_fds[rank]`` each rank's KV pool file (rank_worker.py's arguments)."""
        procs = []
        for rank, cpus in enumerate(shares[1:], start=1):
            env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus)), "MKL_NUM_THREADS": str(len(cpus))}
            command = [sys.executable, "-m", "splitserve.engine.parallel.rank_worker", str(rank), str(len(shares)),
                       str(port), str(num_blocks), ",".join(map(str, cpus)), str(pool_fds[rank])]
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, env=env, pass_fds=(pool_fds[rank],))
            write_message(proc.stdin, (config,))
            procs.append(proc)
        restore = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, shares[0])  # this thread steps the engine; threads it starts inherit the mask
        torch.set_num_threads(len(shares[0]))
        return cls(procs, restore)

    def wait_ready(self, store) -> None:
        """Return once every worker has loaded its shard; raise when one exits first or none is ready in time."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = {rank for rank in range(1, len(self.procs) + 1)}
        while pending:
            pending = {r for r in pending if not store.check([f"ready/{r}"])}
            self.raise_if_exited("while loading its shard")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"ranks {sorted(pending)} not ready after {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def send(self, method: str, *args) -> None:
        """Tell every worker to run ``method(*args)`` on its shard, as rank 0 is about to."""
        self.raise_if_exited("before the step")
        for proc in self.procs:
            try:
                write_message(proc.stdin, (method, *args))
            except (BrokenPipeError, OSError) as err:
                raise self._failure("could not be sent the step") from err

    @contextlib.contextmanager
    def failures_named(self):
        """A collective that failed because a rank is gone becomes a ``TensorParallelError`` that names it."""
        try:
            yield
        except RuntimeError as err:
            if isinstance(err, TensorParallelError):
                raise
            raise self._failure(f"during a collective ({err})") from err

    def raise_if_exited(self, when: str) -> None:
        if any(proc.poll() is not None for proc in self.procs):
            raise self._failure(when)

    def watch(self, on_lost: Callable[[], None]) -> None:
        """Until ``close``: once a worker exits, log the ranks' states and call ``on_lost`` (a thread's loop)."""
        while not self._closed:
            if any(proc.poll() is not None for proc in self.procs):
                logger.error("tensor-parallel rank gone (%s): this engine cannot step again", self.states())
                on_lost()
                return
            time.sleep(WATCH_INTERVAL_S)

    def _failure(self, when: str) -> TensorParallelError:
        for proc in self.procs:  # a rank that broke a collective is exiting: give it a moment to report its code
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
        return TensorParallelError(f"tensor-parallel engine failed {when}: {self.states()}")

    @property
    def closed(self) -> bool:
        return self._closed

    def states(self) -> str:
        """Each worker's state: "rank 1 running, rank 2 exited with code -9"."""
        return ", ".join(f"rank {i} {'running' if p.poll() is None else f'exited with code {p.returncode}'}"
                         for i, p in enumerate(self.procs, start=1))

    def close(self) -> None:
        """Stop the workers (a ``close`` message, then a kill after ``STOP_GRACE_S``) and unpin rank 0's thread."""
        if self._closed:
            return
        self._closed = True
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                write_message(proc.stdin, ("close",))
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        affinity, threads = self._restore
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def rank_lost(model) -> str | None:
    """Whether an engine's model (``ModelRunner.model``) is a tensor-parallel one that lost a rank: which, with the
    ranks' states, or None. A pod's service asks it of a failed request: the pod's failure, not the request's
    (UNAVAILABLE: the router tries other pods), as the pod is ending to restart whole."""
    workers = getattr(model, "plan_to", None)
    if workers is None or workers.closed or all(proc.poll() is None for proc in workers.procs):
        return None
    return workers.states()


def end_process_on_rank_loss(model) -> None:
    """For a serving process (a pod, runtime/pod_server.py) whose engine's model (``ModelRunner.model``) is
    tensor-parallel: once a rank exits, log which and send this process SIGTERM, whose drain ends it (the failed
    steps' requests already failed, and the router moves them), so that its supervisor (``splitserve up``'s, or
    Kubernetes') starts the pod again whole: every later step of this engine would fail. A no-op for one process."""
    workers = getattr(model, "plan_to", None)
    if workers is not None:
        threading.Thread(target=workers.watch, args=(lambda: os.kill(os.getpid(), signal.SIGTERM),), daemon=True,
                         name="tensor-parallel-watch").start()


def rank_kv_cache(config: EngineConfig, model_config: ModelConfig, shards: list[RankShard], rank: int,
                  pool_fds: dict[int, int], num_blocks: int) -> ShardedKVCache:
    """Rank ``rank``'s KV pool: ``num_blocks`` blocks (every rank's count) of its KV heads, over the shared files
    ``pool_fds`` (rank 0: every rank's; a worker: its own)."""
    return ShardedKVCache(model_config, shards, rank, pool_fds, num_blocks, config.cache.block_size,
                          config.cache.cache_dtype)


class RankLaunch:
    """Rank 0's start of ranks 1..N-1, for either kind of parallelism (the module docstring's steps 1 and 2; tensor
    parallelism here, pipeline parallelism in pipeline.py): the constructor checks what is built and opens the
    group's store, ``start_workers`` starts the ranks on their KV pool files, ``join`` builds rank 0's model beside
    their loading and joins the group. A failure after the workers started stops them."""

    def __init__(self, config: EngineConfig, size: int, setting: str):
        check_device(config.device)
        if config.prefill_compute_dtype == "bfloat16":
            raise ValueError(f"{setting} > 1 computes prefill in float32; prefill_compute_dtype 'bfloat16' is not "
                             "built for it yet")
        self.config, self.size = config, size
        self.store = open_store(0, size)
        self.shares = cpu_shares(sorted(os.sched_getaffinity(0)), size)
        self.workers: RankWorkers | None = None

    def start_workers(self, num_blocks: int, pool_fds: list[int], rank_fds: list[int], map_own: Callable[[], T]) -> T:
        """Ranks 1..N-1 started, rank r on ``rank_fds[r]``; ``map_own()`` maps rank 0's view of the pools. The
        descriptors ``pool_fds`` are closed here either way: each process has its own, or its mapping."""
        try:
            own = map_own()
            self.workers = RankWorkers.start(self.config, self.store.port, num_blocks, self.shares, rank_fds)
        finally:
            for fd in pool_fds:
                os.close(fd)
        return own

    def join(self, build: Callable[[], M], attach: Callable[[M, TensorParallelGroup], None], during: str) -> M:
        """Rank 0's model (``build``), once every rank is ready, in the group with them (``attach``); the workers
        stop when the model is garbage-collected, and a rank that exits fails the collective ``during`` which the
        watch notices it."""
        workers = self.workers
        try:
            model = build()
            workers.wait_ready(self.store)
            group = TensorParallelGroup(self.store, 0, self.size)
            group.watch(lambda: workers.raise_if_exited(during))
            attach(model, group)
        except BaseException:
            workers.close()
            raise
        model.plan_to = workers
        weakref.finalize(model, workers.close)
        return model


def start_tensor_parallel(config: EngineConfig, model_config: ModelConfig,
                          state_dict: dict) -> tuple[ShardedLlama, ShardedKVCache]:
    """Rank 0's model and KV cache, with ranks 1..N-1 started and joined (the module docstring's steps 1 and 2)."""
    size = config.tensor_parallel_size
    shards = plan_shards(model_config, size)
    num_blocks = kv_cache_blocks(model_config, config.cache, shards)
    launch = RankLaunch(config, size, "tensor_parallel_size")
    fds = create_pools(model_config, shards, num_blocks, config.cache.block_size,
                       getattr(torch, config.cache.cache_dtype))
    kv_cache = launch.start_workers(num_blocks, fds, fds, lambda: rank_kv_cache(
        config, model_config, shards, 0, dict(enumerate(fds)), num_blocks))
    model = launch.join(lambda: ShardedLlama.for_rank(config, model_config, state_dict, shards[0]),
                        lambda model, group: model.shard_over(group, shards), "during a collective")
    logger.info("tensor parallel: %d ranks on cores %s; rank 0 holds query heads %s, KV heads %s",
                size, launch.shares, shards[0].q_heads, shards[0].kv_heads)
    return model, kv_cache
