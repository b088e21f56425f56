"""``splitserve up`` without starting anything: the CPU plan (its rules, the documented default on 2 CPUs) and the
command lines the launcher builds, parsed back by the real pod and router configs. Supervision, with real
processes: tests/reliability/test_launcher_faults.py and test_pod_faults.py."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from splitserve.cpu_plan import floating, format_plan, plan_cpus
from splitserve.decode_service.config import DecodeConfig
from splitserve.launcher import Cluster
from splitserve.prefill_service.config import PrefillConfig
from splitserve.router.config import RouterConfig
from splitserve.runtime.config import PASSED_AS, PASSED_TO, parse_config
from splitserve.runtime.cpus import allowed_cpus, format_cpu_list
from splitserve.runtime.roles import Role
from splitserve.up_config import UpConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
TWO_CPUS = frozenset({0, 1})


def placements(pods: list[tuple[str, Role]], allowed=TWO_CPUS, **given: str) -> dict[str, tuple[str, int, bool]]:
    """{process: (CPUs, threads, pinned)} of the plan."""
    sets = {Role(role.removesuffix("_cpus")): frozenset(int(cpu) for cpu in cpus.split(","))
            for role, cpus in given.items()}
    plan = plan_cpus(pods, frozenset(allowed), sets)
    return {name: (format_cpu_list(p.cpus), p.threads, p.pinned) for name, p in plan.items()}


P, D, M = Role.PREFILL, Role.DECODE, Role.MIXED


# ---- the CPU plan -------------------------------------------------------------------------------------------------

def test_default_plan_on_two_cpus_is_the_documented_one():
    """docs/configuration.md, "CPU plan": prefill on CPU 0, decode on CPU 1, one thread each, the router on any CPU;
    mixed pods split the CPUs."""
    plan = plan_cpus([("prefill-0", P), ("decode-0", D)], TWO_CPUS, {})
    assert {name: (format_cpu_list(p.cpus), p.threads, p.pinned) for name, p in plan.items()} == {
        "prefill-0": ("0", 1, True), "decode-0": ("1", 1, True), "router": ("0-1", 0, False)}
    printed = format_plan([*plan.values(), floating("prometheus", TWO_CPUS)])  # as `make run` prints it
    assert printed in (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert placements([("mixed-0", M), ("mixed-1", M)]) == {
        "mixed-0": ("0", 1, True), "mixed-1": ("1", 1, True), "router": ("0-1", 0, False)}
    assert placements([("mixed-0", M)]) == {"mixed-0": ("0-1", 2, True), "router": ("0-1", 0, False)}


def test_roles_share_out_the_cpus_by_pod_count_and_pods_split_their_role_set():
    eight = frozenset(range(8))
    assert placements([("prefill-0", P), ("decode-0", D), ("decode-1", D), ("decode-2", D)], eight) == {
        "prefill-0": ("0-1", 2, True), "decode-0": ("2-3", 2, True), "decode-1": ("4-5", 2, True),
        "decode-2": ("6-7", 2, True), "router": ("0-7", 0, False)}
    # 3 CPUs: prefill 0, decode 1-2; the decode pods split them.
    assert placements([("prefill-0", P), ("decode-0", D), ("decode-1", D)], frozenset({0, 1, 2})) == {
        "prefill-0": ("0", 1, True), "decode-0": ("1", 1, True), "decode-1": ("2", 1, True),
        "router": ("0-2", 0, False)}


def test_pods_share_a_set_smaller_than_their_number_with_threads_divided_among_them():
    # 2 CPUs, 1 prefill + 2 decode pods: the decode pods share CPU 1.
    assert placements([("prefill-0", P), ("decode-0", D), ("decode-1", D)]) == {
        "prefill-0": ("0", 1, True), "decode-0": ("1", 1, True), "decode-1": ("1", 1, True),
        "router": ("0-1", 0, False)}
    # Three roles on 2 CPUs: every pod shares both CPUs, one thread each (3 threads on 2 CPUs, not 6).
    assert placements([("prefill-0", P), ("decode-0", D), ("mixed-0", M)]) == {
        "prefill-0": ("0-1", 1, True), "decode-0": ("0-1", 1, True), "mixed-0": ("0-1", 1, True),
        "router": ("0-1", 0, False)}
    # One CPU: everyone on it.
    assert placements([("prefill-0", P), ("decode-0", D)], frozenset({3})) == {
        "prefill-0": ("3", 1, True), "decode-0": ("3", 1, True), "router": ("3", 0, False)}


def test_given_sets_win_and_the_other_roles_share_what_they_leave():
    four = frozenset(range(4))
    assert placements([("prefill-0", P), ("decode-0", D), ("decode-1", D)], four, decode_cpus="2,3") == {
        "prefill-0": ("0-1", 2, True), "decode-0": ("2", 1, True), "decode-1": ("3", 1, True),
        "router": ("0-3", 0, False)}
    # The given sets took every CPU: the planned role shares all of them.
    assert placements([("prefill-0", P), ("decode-0", D)], decode_cpus="0,1") == {
        "prefill-0": ("0-1", 1, True), "decode-0": ("0-1", 1, True), "router": ("0-1", 0, False)}
    assert placements([("prefill-0", P), ("decode-0", D)], prefill_cpus="1", decode_cpus="0") == {
        "prefill-0": ("1", 1, True), "decode-0": ("0", 1, True), "router": ("0-1", 0, False)}
    assert placements([("prefill-0", P), ("decode-0", D)], router_cpus="1")["router"] == ("1", 0, True)


def test_up_config_refuses_bad_sets_and_engine_settings_naming_the_field():
    with pytest.raises(ValueError, match="^prefill_cpus: CPU"):
        UpConfig(prefill_cpus=str(max(allowed_cpus()) + 1))
    with pytest.raises(ValueError, match="^router_cpus: '1-0' is not a CPU list"):
        UpConfig(router_cpus="1-0")
    with pytest.raises(SystemExit):
        parse_config(UpConfig, ["--decode-cpus", "x"], env={})
    with pytest.raises(ValueError, match="^max_num_seqs must be > 0, got 0$"):
        UpConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="^kv_codec must be one of none, .*, got 'gzip'$"):
        UpConfig(kv_codec="gzip")
    with pytest.raises(ValueError, match="^method must be one of ngram, suffix, draft, got 'bogus'$"):
        UpConfig(speculative_method="bogus")
    with pytest.raises(ValueError, match="required by method 'draft'"):  # a draft method needs its draft model
        UpConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="required by method 'draft'"):
        DecodeConfig(speculative_method="draft").engine_config()


def test_a_bad_weight_format_is_refused_naming_the_role_field_or_the_pod_flag():
    for role in ("prefill", "decode", "mixed"):
        with pytest.raises(ValueError, match=f"^{role}_quantization must be one of auto, none, gguf, int8, int4, "
                                             "got 'q4_k'$"):
            UpConfig(**{f"{role}_quantization": "q4_k"})
    with pytest.raises(SystemExit):
        parse_config(UpConfig, ["--decode-quantization", "fp4"], env={})
    for pod_config in (PrefillConfig, DecodeConfig):
        with pytest.raises(ValueError, match="^quantization must be one of auto, none, gguf, int8, int4, got 'fp4'$"):
            pod_config(quantization="fp4")


# ---- command lines --------------------------------------------------------------------------------------------------

def test_every_pod_and_the_router_accept_the_flags_the_launcher_builds(tmp_path):
    config = UpConfig(model="tiny-random", prefill=1, decode=1, mixed=1, max_num_batched_tokens=256,
                      max_num_seqs=8, long_prefill_token_threshold=128, shutdown_grace_s=3.0,
                      mixed_cpus=format_cpu_list(allowed_cpus()), kv_codec="int8", run_dir=str(tmp_path),
                      prefill_quantization="none", decode_quantization="gguf", mixed_quantization="int8",
                      heartbeat_ttl_s=3.0, pod_ttl_s=4.0)
    cluster = Cluster(config)
    by_role = {pod.role: pod for pod in cluster.pods}
    prefill = parse_config(PrefillConfig, cluster._pod_flags(by_role[P]), env={})
    decode = parse_config(DecodeConfig, cluster._pod_flags(by_role[D]), env={})
    mixed = parse_config(DecodeConfig, cluster._pod_flags(by_role[M]), env={})
    for pod_config in (prefill, decode, mixed):
        assert (pod_config.model, pod_config.max_num_batched_tokens, pod_config.max_num_seqs,
                pod_config.long_prefill_token_threshold, pod_config.shutdown_grace_s, pod_config.heartbeat_ttl_s) == (
            "tiny-random", 256, 8, 128, 3.0, 3.0)
    assert (decode.role, mixed.role) == ("decode", "mixed")
    # Each role's pods get their own weight format, as the one --quantization flag of their config.
    assert [c.engine_config().quantization for c in (prefill, decode, mixed)] == ["none", "gguf", "int8"]
    for pod_config, name in ((prefill, "prefill-0"), (decode, "decode-0"), (mixed, "mixed-0")):
        placement = cluster.cpu_plan[name]
        assert (pod_config.cpus, pod_config.num_threads) == (format_cpu_list(placement.cpus), placement.threads)
    router = parse_config(RouterConfig, cluster._router_flags(), env={})
    assert (router.decode_pods, router.mixed_pods, router.kv_codec, router.pod_ttl_s) == (
        [cluster.address(by_role[D])], [cluster.address(by_role[M])], "int8", 4.0)
    assert router.cpus == ""  # the router floats


def test_pods_get_their_thread_count_in_the_environment_too(tmp_path):
    cluster = Cluster(UpConfig(model="tiny-random", run_dir=str(tmp_path), prometheus=False))
    spec = cluster._child_spec("decode-0")
    threads = str(cluster.cpu_plan["decode-0"].threads)
    assert spec.env == {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    assert spec.stop_grace_s > UpConfig().shutdown_grace_s  # SIGKILL only after the pod's own drain


def test_without_pinning_the_pods_keep_their_thread_counts_but_float(tmp_path):
    cluster = Cluster(UpConfig(model="tiny-random", run_dir=str(tmp_path), prometheus=False, pin_cpus=False))
    flags = cluster._pod_flags(cluster.pods[1])
    assert "--cpus" not in flags
    assert flags[flags.index("--num-threads") + 1] == str(max(1, len(allowed_cpus()) // 2))
    assert not any(p.pinned for p in cluster.cpu_plan.values())


def test_fields_handed_on_are_the_fields_of_the_configs_they_reach():
    # UpConfig restates no per-role default: a field passed to pods or the router has their type and default.
    handed_on = [f for f in dataclasses.fields(UpConfig) if PASSED_TO in f.metadata]
    assert {"model", "kv_cache_memory_bytes", "max_num_seqs", "kv_codec", "policy"} <= {f.name for f in handed_on}
    up_hints = typing.get_type_hints(UpConfig)
    for f in handed_on:
        for target in f.metadata[PASSED_TO]:
            (own,) = [g for g in dataclasses.fields(target) if g.name == f.metadata[PASSED_AS]]
            assert up_hints[f.name] == typing.get_type_hints(target)[own.name], f.name
            assert own.default == f.default, f.name


@pytest.mark.parametrize("scheduling", ["hybrid", "disaggregated", "colocated"])
def test_scheduling_shapes_the_pods_and_the_router(tmp_path, scheduling):
    cluster = Cluster(UpConfig(model="tiny-random", run_dir=str(tmp_path), prometheus=False, scheduling=scheduling,
                               slo_tpot_s=0.2))
    roles = [pod.role for pod in cluster.pods]
    assert roles == ([M, M] if scheduling == "colocated" else [P, D])
    router = parse_config(RouterConfig, cluster._router_flags(), env={})
    assert (router.scheduling, router.slo_tpot_s) == (scheduling, 0.2)
    decode = parse_config(DecodeConfig, cluster._pod_flags(cluster.pods[1]), env={})
    # Hybrid decode pods keep the router's TPOT target while they prefill lent prompts; no other pod lends.
    assert (decode.tpot_slack_chunking, decode.tpot_target_s) == ((True, 0.2) if scheduling == "hybrid" else
                                                                   (False, 0.0))
