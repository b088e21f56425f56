"""Grafana dashboards and Prometheus rules: the committed files are the generators' output, every panel has a unit
and filters on the model and role variables, every PromQL expression (dashboards, rules, the planner's queries)
passes promtool, and the alerts behave on synthetic series (``promtool test rules``), and so does each panel that shows
an event a clean run does not have (``EVENT_PANELS``), fed that event."""

from __future__ import annotations

import json
import re
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


# The panels that show events a clean run does not have (retries, failed pushes, migrations, shadow checks: the
# real-data run of tests/deploy/test_dashboards_e2e.py passes them empty only where no process recorded the event):
# each panel here is fed the event it shows, a counter rising by 60 a minute (1/s) or a histogram whose every
# observation falls in (2, 4], and must show it at that rate, by the labels it groups by.
EVENT_PANELS = {
    ("router", "Retries"): ['splitserve_router_retries_total{role="router", code="UNAVAILABLE"}'],
    ("router", "KV transfer failures and migrations"): [
        'splitserve_kv_transfer_failures_total{role="prefill", code="DATA_LOSS"}',
        'splitserve_kv_load_total{role="decode", outcome="recomputed"}',
        'splitserve_router_migrations_total{role="router"}',
        'splitserve_router_decode_pod_waits_total{role="router", outcome="found"}'],
    ("router", "Shadow checks"): ['splitserve_router_shadow_checks_total{role="router", outcome="diverged"}'],
    ("router", "First diverging position"): [
        f'splitserve_router_shadow_divergence_position_bucket{{role="router", le="{le}"}}'
        for le in ("1", "2", "4", "+Inf")],
}


def _event_test(dashboard_name: str, title: str) -> dict:
    """A ``promtool test rules`` case: the event's series, and each of the panel's queries expected to show it."""
    series = EVENT_PANELS[dashboard_name, title]
    rising = {s: "0+0x12" if re.search(r'le="[12]"', s) else "0+60x12" for s in series}
    [panel] = [p for p in panels(dashboard(dashboard_name)) if p["title"] == title]
    cases = []
    for target in panel["targets"]:
        expr = target["expr"]
        for variable, value in {**GRAFANA_VARIABLES, "$__rate_interval": "2m"}.items():
            expr = expr.replace(variable, value)
        if (quantile := re.match(r"histogram_quantile\(([\d.]+),", expr)) is not None:
            q = float(quantile.group(1))
            cases.append({"expr": expr, "eval_time": "10m",
                          "exp_samples": [{"labels": '{role="router"}', "value": 2 + 2 * q}]})
            continue
        [family] = re.findall(r"\b(splitserve_\w+)\{", expr)
        [shown] = [s for s in series if s.startswith(family + "{")]
        labels = dict(re.findall(r'(\w+)="([^"]*)"', shown))
        by = re.match(r"sum(?: by \(([\w, ]*)\))? \(rate", expr)
        grouped = [name.strip() for name in (by.group(1) or "").split(",") if name.strip()]
        kept = ", ".join(f'{name}="{labels[name]}"' for name in grouped)
        cases.append({"expr": expr, "eval_time": "10m", "exp_samples": [{"labels": f"{{{kept}}}", "value": 1}]})
    return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in rising.items()],
            "promql_expr_test": cases}


@pytest.mark.parametrize("dashboard_name, title", list(EVENT_PANELS), ids=[t for _, t in EVENT_PANELS])
def test_each_event_panel_shows_the_event_it_is_for(tmp_path, dashboard_name, title):
    case = _event_test(dashboard_name, title)
    read = {re.sub(r"_bucket$", "", f) for c in case["promql_expr_test"] for f in re.findall(r"\b(splitserve_\w+)\{",
                                                                                              c["expr"])}
    assert read == {re.sub(r"(_bucket)?\{.*", "", s) for s in EVENT_PANELS[dashboard_name, title]}  # every event read
    path = tmp_path / "event.test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [case]}))
    result = subprocess.run(["promtool", "test", "rules", path.name], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
