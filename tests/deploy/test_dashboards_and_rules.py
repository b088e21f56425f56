"""Grafana dashboards and Prometheus rules: the committed files are the generators' output, every panel has a unit
and filters on the model and role variables, every PromQL expression (dashboards, rules, the planner's queries)
passes promtool, and the alerts behave on synthetic series (``promtool test rules``)."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from splitserve.deploy.grafana.dashboards import DASHBOARDS, OUT_DIR, render
from splitserve.deploy.planner.config import PlannerConfig
from splitserve.deploy.planner.signals import signal_queries
from splitserve.deploy.prometheus import RULES_PATH, TESTS_PATH, render_rules

# What Grafana substitutes before a query reaches Prometheus (All selected).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$namespace": ".*", "$model_name": ".*", "$role": ".*"}


def dashboard(name: str) -> dict:
    return json.loads((OUT_DIR / f"splitserve-{name}.json").read_text())


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def dashboard_queries() -> list[str]:
    """Every target's expression of every dashboard, as Prometheus receives it."""
    queries = []
    for name in DASHBOARDS:
        for panel in panels(dashboard(name)):
            for target in panel["targets"]:
                expr = target["expr"]
                for variable, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(variable, value)
                queries.append(expr)
    return queries


@pytest.mark.parametrize("name", list(DASHBOARDS))
def test_committed_dashboard_is_the_generators_output(name):
    assert (OUT_DIR / f"splitserve-{name}.json").read_text() == render(name), "run: python -m splitserve.deploy.grafana"


@pytest.mark.parametrize("name", list(DASHBOARDS))
def test_dashboard_variables_units_and_filters(name):
    board = dashboard(name)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "model_name", "role"} <= set(variables)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            for variable in ('namespace=~"$namespace"', 'model_name=~"$model_name"', 'role=~"$role"'):
                assert variable in target["expr"], (variable, target)
            if "histogram_quantile" in target["expr"]:  # one line per role: router and pod histograms never merge
                assert "sum by (le, role" in target["expr"] and "[$__rate_interval]" in target["expr"]
                assert "{{role}}" in target["legendFormat"]


def test_every_promql_expression_passes_promtool(tmp_path):
    planner = list(signal_queries(PlannerConfig(model_name="m", promql_selector='namespace="llm"')).values())
    rules = [r["expr"] for g in yaml.safe_load(RULES_PATH.read_text())["groups"] for r in g["rules"]]
    expressions = dashboard_queries() + planner + rules
    as_rules = {"groups": [{"name": "check", "rules": [{"record": f"check:expr_{i}", "expr": e}
                                                       for i, e in enumerate(expressions)]}]}
    path = tmp_path / "expressions.yaml"
    path.write_text(yaml.safe_dump(as_rules))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(expressions)} rules found" in result.stdout


def test_committed_rules_are_the_charts_rules_with_default_thresholds():
    assert RULES_PATH.read_text() == render_rules(), "run: python -m splitserve.deploy.prometheus"


def test_promtool_unit_tests_of_the_rules_pass():
    result = subprocess.run(["promtool", "test", "rules", TESTS_PATH.name], cwd=TESTS_PATH.parent,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_thresholds_come_from_values():
    rules = yaml.safe_load(render_rules({"serviceLevel": {"ttftSeconds": 0.75, "tpotSeconds": 0.1},
                                         "prometheusRule": {"kvCacheUsageThreshold": 0.9, "for": "2m"}}))
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts["SplitserveTTFTP99OverTarget"]["expr"].endswith("> 0.75")
    assert alerts["SplitserveTTFTP99OverTarget"]["for"] == "2m"
    assert alerts["SplitserveKVCacheNearlyFull"]["expr"].endswith("> 0.9")
