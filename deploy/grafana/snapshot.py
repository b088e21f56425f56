"""Draw a dashboard's panels from a Prometheus server with matplotlib: what Grafana would show, for machines without
Grafana (the README's picture is made this way from a real ``splitserve up`` run).

    python -m splitserve.deploy.grafana.snapshot --prometheus http://127.0.0.1:9090 --dashboard overview \
        --minutes 10 --out o.png

Each panel's targets go through Prometheus' ``/api/v1/query_range`` with Grafana's variables set to "All" and
``$__rate_interval`` to ``rate_interval``; one subplot per panel, in the dashboard's order, titled and unit-labelled.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.parse
import urllib.request
from pathlib import Path

from splitserve.deploy.grafana.dashboards import OUT_DIR

ALL = {"$namespace": ".*", "$model_name": ".*", "$role": ".*"}


def grafana_expr(expr: str, rate_interval: str, variables: dict[str, str] | None = None) -> str:
    """A target's expression as Grafana sends it: variables substituted."""
    for name, value in {**ALL, **(variables or {}), "$__rate_interval": rate_interval}.items():
        expr = expr.replace(name, value)
    return expr


def query(prometheus: str, expr: str) -> list[dict]:
    """An instant query's series (Prometheus' ``/api/v1/query``); raises when Prometheus refuses it."""
    params = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{prometheus.rstrip('/')}/api/v1/query?{params}", timeout=30) as reply:
        body = json.load(reply)
    if body["status"] != "success":
        raise ValueError(f"Prometheus refused {expr!r}: {body}")
    return body["data"]["result"]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus.rstrip('/')}/api/v1/query_range?{params}", timeout=30) as reply:
        return json.load(reply)["data"]["result"]


def legend(template: str, labels: dict[str, str]) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def draw(dashboard: dict, prometheus: str, start: float, end: float, out: Path, rate_interval: str = "1m",
         variables: dict[str, str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    columns = 3
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.4 * rows), squeeze=False)
    step = max(1.0, (end - start) / 200)
    for ax, panel in zip(axes.flat, panels):
        for target in panel["targets"]:
            expr = grafana_expr(target["expr"], rate_interval, variables)
            for series in query_range(prometheus, expr, start, end, step):
                points = [(float(t) - start, float(v)) for t, v in series["values"] if math.isfinite(float(v))]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, label=legend(target.get("legendFormat", ""), series["metric"]))
        ax.set_title(panel["title"], fontsize=10)
        ax.set_ylabel(panel["fieldConfig"]["defaults"]["unit"], fontsize=8)
        ax.set_xlabel("seconds", fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    figure.suptitle(f"{dashboard['title']} (drawn from Prometheus with matplotlib)", fontsize=12)
    figure.tight_layout()
    figure.savefig(out, dpi=80)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m splitserve.deploy.grafana.snapshot",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--dashboard", default="overview")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate-interval", default="1m")
    parser.add_argument("--out", default="dashboard.png")
    args = parser.parse_args(argv)
    board = json.loads((OUT_DIR / f"splitserve-{args.dashboard}.json").read_text())
    end = time.time()
    print(draw(board, args.prometheus, end - 60 * args.minutes, end, Path(args.out), args.rate_interval))


if __name__ == "__main__":
    main()
