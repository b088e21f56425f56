"""Every dashboard panel against real data: ``splitserve up`` (a router, a prefill pod, a decode pod, Prometheus
scraping them, SmolLM2) under a short load of short and long prompts plus a few invalid requests; then each panel's
queries go through Prometheus' HTTP API as Grafana would send them, and so do the recording rules and the planner's
queries.

A panel passes when one of its queries returns a finite sample; one that returns nothing fails, naming the metric
families nothing recorded, unless its series count events a clean run does not have (retries, KV transfer failures,
migrations) and no process recorded any of them (each such panel is shown its event on synthetic series in
tests/deploy/test_dashboards_and_rules.py).
The refusal panels are checked last, after the decode pod is stopped: requests then get 503 / UNAVAILABLE, and the
no-healthy-decode-pod alert's expression must fire on the real series.
``SPLITSERVE_DASHBOARD_PNG=path.png`` also draws the overview dashboard from this run (the README's picture).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from splitserve.deploy.grafana.dashboards import DASHBOARDS, OUT_DIR
from splitserve.deploy.grafana.snapshot import draw, grafana_expr
from splitserve.deploy.grafana.snapshot import query as _query
from splitserve.deploy.planner.config import PlannerConfig
from splitserve.deploy.planner.signals import PrometheusSignals
from splitserve.deploy.prometheus import RULES_PATH
from tests.deploy.test_dashboards_and_rules import EVENT_PANELS as EVENT_PANEL_EVENTS

pytestmark = [pytest.mark.e2e, pytest.mark.model,
              pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs prometheus")]

RATE_INTERVAL = "2m"
# Panels of events a clean run does not have (retries, failed pushes, migrations; shadow checks are off by default):
# here one passes empty only where no process recorded its event; each is shown its event on synthetic series by
# tests/deploy/test_dashboards_and_rules.py.
EVENT_PANELS = {title for _, title in EVENT_PANEL_EVENTS}
PROMPTS = [
    "The capital of France is",
    "def add(a, b):",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years the presses had",
    "<|im_start|>system\nYou are a helpful assistant who answers in one short sentence.<|im_end|>\n<|im_start|>user\n"
    "Why is the sky blue during the day but red at sunset? Explain it to a child.<|im_end|>\n<|im_start|>assistant\n",
]


def _post(url: str, body: dict) -> int:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def _load(http: str, requests_per_worker: int = 6, workers: int = 3) -> list[int]:
    """Bounded load: each worker sends its share of prompts, one after another."""
    statuses: list[int] = []

    def worker(index: int) -> None:
        for i in range(requests_per_worker):
            prompt = PROMPTS[(index + i) % len(PROMPTS)]
            statuses.append(_post(f"{http}/v1/completions", {"model": "smollm2-135m", "prompt": prompt,
                                                             "max_tokens": 24, "temperature": 0}))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for bad in ({"temperature": -1}, {"max_tokens": -5}, {"top_p": 7}):  # refused before any output: 400
        statuses.append(_post(f"{http}/v1/completions", {"model": "smollm2-135m", "prompt": "hi", **bad}))
    return statuses


@pytest.fixture(scope="module")
def running(smollm2_up):
    """The session's SmolLM2 cluster (tests/conftest.py; it speculates, so the decode dashboard's speculative
    panels have data too) once this module's load went through and was scraped, and its Prometheus URL."""
    cluster, config = smollm2_up, smollm2_up.config
    started = time.time()
    statuses = _load(f"http://{config.host}:{config.http_port}")
    assert statuses.count(200) == 18 and statuses.count(400) == 3, statuses
    url = f"http://{config.host}:{config.prometheus_port}"
    _wait_scraped_since(url, time.time())
    if os.environ.get("SPLITSERVE_DASHBOARD_PNG"):
        board = json.loads((OUT_DIR / "splitserve-overview.json").read_text())
        draw(board, url, started - 20, time.time(), Path(os.environ["SPLITSERVE_DASHBOARD_PNG"]), "30s")
    yield cluster, url


@pytest.fixture(scope="module")
def prometheus(running):
    return running[1]


def _wait_scraped_since(prometheus: str, since: float, scrapes: int = 2, timeout_s: float = 60) -> None:
    """Until Prometheus has scraped every target ``scrapes`` times after ``since`` (a Unix time): what the
    processes counted by then is in its series, and a rate over the window has both ends."""
    deadline = time.monotonic() + timeout_s
    for _ in range(scrapes):
        while True:
            with urllib.request.urlopen(f"{prometheus}/api/v1/targets?state=active", timeout=30) as reply:
                targets = json.load(reply)["data"]["activeTargets"]
            last = [datetime.fromisoformat(t["lastScrape"]).timestamp() for t in targets]
            if targets and min(last) > since:
                break
            assert time.monotonic() < deadline, f"Prometheus did not scrape every target after {since}: {targets}"
            time.sleep(0.2)
        since = max(last)


def _wait_for_data(prometheus: str, exprs: list[str], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(_has_data(_query(prometheus, e)) for e in exprs):
        assert time.monotonic() < deadline, f"{what} returns no data after {timeout_s:.0f} s: {exprs}"
        time.sleep(0.5)


def _has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(series["value"][1])) for series in result)


def _recorded(prometheus: str, family: str) -> bool:
    """Some process recorded something in the family: a non-zero counter, gauge or histogram count (a labelled
    counter has no series before its first event; a histogram declared with its labels has zero counts)."""
    return bool(_query(prometheus, f'count({{__name__=~"{family}(_count)?"}} != 0)'))


def _families(expr: str) -> set[str]:
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in re.findall(r"\b(splitserve_\w+)\{", expr)}


REFUSAL_PANELS = [("overview", "Errors"), ("router", "Rejected requests")]
# `splitserve up` runs no planner (it scales Kubernetes Deployments): the planner dashboard is left out here.
PANELS = [(name, panel["title"]) for name in DASHBOARDS if name != "planner"
          for panel in json.loads((OUT_DIR / f"splitserve-{name}.json").read_text())["panels"]
          if panel["type"] != "row" and (name, panel["title"]) not in REFUSAL_PANELS]


def _panel_exprs(dashboard: str, title: str) -> list[str]:
    board = json.loads((OUT_DIR / f"splitserve-{dashboard}.json").read_text())
    panel = next(p for p in board["panels"] if p.get("title") == title)
    return [grafana_expr(t["expr"], RATE_INTERVAL) for t in panel["targets"]]


@pytest.mark.parametrize("dashboard, title", PANELS, ids=[f"{d}:{t}" for d, t in PANELS])
def test_every_panel_returns_data(prometheus, dashboard, title):
    exprs = _panel_exprs(dashboard, title)
    if any(_has_data(_query(prometheus, expr)) for expr in exprs):
        return
    families = set().union(*(_families(e) for e in exprs))
    unrecorded = sorted(f for f in families if not _recorded(prometheus, f))
    assert title in EVENT_PANELS, f"{dashboard}: {title!r} returns no data (nothing recorded {unrecorded}): {exprs}"
    # Empty, an event panel must be right: its event did not happen (no process recorded any series it reads).
    recorded = sorted(families - set(unrecorded))
    assert not recorded, f"{dashboard}: {title!r} returns no data though {recorded} recorded its event: {exprs}"


def test_recording_rules_return_data(prometheus):
    import yaml

    for group in yaml.safe_load(RULES_PATH.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                assert _has_data(_query(prometheus, rule["expr"])), rule["record"]


def test_the_planner_reads_the_cluster(prometheus):
    # A window as long as this module runs: the load went through at its start, and the rates over a window that
    # no longer holds it read 0 (a slow run of the tests before this one took past 120 s).
    signals = PrometheusSignals(PlannerConfig(prometheus_url=prometheus, window_s=900)).read()
    for name in ("requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s", "prefill_tokens_per_s",
                 "prefill_busy", "decode_pods", "decode_step_s", "kv_usage_max", "ttft_p99_s", "tpot_p99_s"):
        value = getattr(signals, name)
        assert math.isfinite(value) and value >= 0, (name, value)
    assert signals.requests_per_s > 0 and signals.decode_pods == 1


def test_refusals_show_once_no_decode_pod_is_left(running):
    """Last (it stops the decode pod, which the supervisor then restarts for the cluster's next users): requests
    now fail with 503, the refusal panels show them by code, and the no-healthy-decode-pod alert's expression fires
    on the real series."""
    import yaml

    cluster, prometheus = running
    decode = next(p for p in cluster.processes if p.name.startswith("decode"))
    decode.popen.terminate()
    decode.popen.wait(timeout=60)
    http = f"http://{cluster.config.host}:{cluster.config.http_port}"
    deadline = time.monotonic() + 60
    statuses = []
    while time.monotonic() < deadline and statuses.count(503) < 2:
        statuses.append(_post(f"{http}/v1/completions", {"model": "smollm2-135m", "prompt": "hi", "max_tokens": 4}))
        time.sleep(0.25)
    assert statuses.count(503) >= 2, statuses
    for dashboard, title in REFUSAL_PANELS:
        _wait_for_data(prometheus, _panel_exprs(dashboard, title), f"{dashboard}: {title!r}")
    alerts = [r for g in yaml.safe_load(RULES_PATH.read_text())["groups"] for r in g["rules"]
              if r.get("alert") == "SplitserveNoHealthyDecodePod"]
    _wait_for_data(prometheus, [alerts[0]["expr"]], "the no-healthy-decode-pod alert's condition")
    # The cluster is the session's: the supervisor starts the decode pod again; wait until requests succeed.
    deadline = time.monotonic() + 120
    while _post(f"{http}/v1/completions", {"model": "smollm2-135m", "prompt": "hi", "max_tokens": 4}) != 200:
        assert time.monotonic() < deadline, "the restarted decode pod did not serve within 120 s"
        time.sleep(0.25)
