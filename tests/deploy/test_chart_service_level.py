"""One service level from values to every rendered place (issue 35): ``serviceLevel``'s TTFT and TPOT targets reach
the router's goodput and placement flags, the hybrid decode pods' TPOT-slack chunking, the planner's sizing targets
and the PrometheusRule's alerts; the chart's defaults are ``runtime/service_level.py``'s and ``RouterConfig``'s, so
``splitserve up``, ``splitserve router`` and ``helm install`` agree."""

from __future__ import annotations

import helm_python as helm
import pytest
import yaml
from helm_python.errors import HelmError

from splitserve.deploy.planner.config import PlannerConfig
from splitserve.router.config import RouterConfig, Scheduling
from splitserve.runtime.service_level import DEFAULT_TPOT_S, DEFAULT_TTFT_S
from splitserve.up_config import UpConfig
from tests.deploy.test_chart import CHART, containers_by_component, parsed_config, render

ALL_ON = {"planner": {"enabled": True}, "prometheusRule": {"enabled": True}}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def rendered_targets(chart, values: dict) -> dict[str, float]:
    """Every place the chart puts a TTFT or TPOT target, read back from the rendered manifests."""
    rendered = render(chart, values)
    deployments = containers_by_component([obj for docs in rendered.values() for obj in docs])
    router, decode, planner = (parsed_config(deployments[name]) for name in ("router", "decode", "planner"))
    alerts = {rule["alert"]: rule["expr"] for group in rendered["prometheusrule.yaml"][0]["spec"]["groups"]
              for rule in group["rules"] if "alert" in rule}
    return {"router ttft": router.slo_ttft_s, "router tpot": router.slo_tpot_s,
            "decode tpot": decode.tpot_target_s,
            "planner ttft": planner.ttft_target_s, "planner tpot": planner.tpot_target_s,
            "ttft alert": float(alerts["SplitserveTTFTP99OverTarget"].rsplit(">", 1)[1]),
            "tpot alert": float(alerts["SplitserveTPOTP99OverTarget"].rsplit(">", 1)[1])}


def test_the_charts_defaults_are_the_one_service_level_and_scheduling():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["serviceLevel"] == {"ttftSeconds": DEFAULT_TTFT_S,
                                      "tpotSeconds": DEFAULT_TPOT_S}
    assert values["router"]["config"]["scheduling"] == RouterConfig.scheduling == UpConfig.scheduling == "hybrid"
    assert (RouterConfig.slo_ttft_s, RouterConfig.slo_tpot_s) == (UpConfig.slo_ttft_s, UpConfig.slo_tpot_s) == (
        PlannerConfig.ttft_target_s, PlannerConfig.tpot_target_s) == (DEFAULT_TTFT_S,
                                                                    DEFAULT_TPOT_S)


def test_one_value_changes_each_target_everywhere_it_is_used(chart):
    assert set(rendered_targets(chart, ALL_ON).values()) == {DEFAULT_TTFT_S, DEFAULT_TPOT_S}
    targets = rendered_targets(chart, {**ALL_ON, "serviceLevel": {"ttftSeconds": 0.35, "tpotSeconds": 0.042}})
    assert targets == {"router ttft": 0.35, "router tpot": 0.042, "decode tpot": 0.042, "planner ttft": 0.35,
                       "planner tpot": 0.042, "ttft alert": 0.35, "tpot alert": 0.042}


@pytest.mark.parametrize("scheduling, chunks", [("hybrid", True), ("disaggregated", False), ("colocated", False)])
def test_hybrid_decode_pods_chunk_lent_prompts(chart, scheduling, chunks):
    """The router lends prompts to decode pods only when it schedules hybrid; only then do they need to chunk them."""
    values = {"router": {"config": {"scheduling": scheduling}}, "mixed": {"enabled": True}}
    deployments = containers_by_component([obj for docs in render(chart, values).values() for obj in docs])
    assert parsed_config(deployments["router"]).scheduling is Scheduling(scheduling)
    decode = parsed_config(deployments["decode"])
    assert (decode.tpot_slack_chunking, decode.tpot_target_s) == (
        (True, DEFAULT_TPOT_S) if chunks else (False, 0.0))
    assert not parsed_config(deployments["mixed"]).tpot_slack_chunking  # a mixed pod lends nothing


def test_the_schema_refuses_a_target_set_twice_or_not_positive(chart):
    for values in ({"router": {"config": {"sloTtftS": 2}}}, {"planner": {"config": {"ttftTargetS": 2}}},
                   {"serviceLevel": {"ttftSeconds": 0}}, {"prometheusRule": {"ttftP99TargetSeconds": 2}}):
        with pytest.raises(HelmError):
            render(chart, values)
