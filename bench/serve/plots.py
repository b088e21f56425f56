"""The pictures of ``splitserve bench serve`` (PNG, matplotlib's file-only backend).

  plot_run(run, path)      CDFs of TTFT, TPOT, ITL and E2E over the run's successful requests, targets marked
  plot_sweep(sweep, path)  goodput, SLO attainment, p99 TPOT and p99 TTFT against the request rate (top row), and
                           the four CDFs, one line per rate (bottom row)
"""

from __future__ import annotations

from splitserve.bench.serve.run import ServeRun
from splitserve.measure.figures import headless_pyplot

FIGURES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))


def latency_values(run: ServeRun) -> dict[str, list[float]]:
    """Milliseconds per figure, over the run's successful requests (ITL: every gap of every request)."""
    ok = [r for r in run.records if r.status == "ok"]
    return {"ttft": [r.ttft * 1e3 for r in ok if r.ttft is not None],
            "tpot": [r.tpot * 1e3 for r in ok if r.tpot is not None],
            "itl": [gap * 1e3 for r in ok for gap in r.itl],
            "e2e": [r.e2e * 1e3 for r in ok]}


def _cdf(ax, values: list[float], label: str | None = None) -> None:
    if not values:
        return
    ordered = sorted(values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], drawstyle="steps-post", label=label)


def _targets(ax, run: ServeRun, figure: str) -> None:
    target = {"ttft": run.config.slo.ttft, "tpot": run.config.slo.tpot, "e2e": run.config.slo.e2e}.get(figure)
    if target is not None:
        ax.axvline(target * 1e3, color="red", linestyle="--", linewidth=1, label="target")


def plot_run(run: ServeRun, path: str) -> None:
    plt = headless_pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    values = latency_values(run)
    for ax, (figure, title) in zip(axes, FIGURES):
        _cdf(ax, values[figure])
        _targets(ax, run, figure)
        ax.set(xlabel=f"{title} (ms)", ylabel="fraction of requests" if figure != "itl" else "fraction of gaps",
               title=title, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right")
    s = run.summary
    fig.suptitle(f"{run.model}, {run.config.workload.describe()}\n{s['successful']} ok, {s['failed']} failed, "
                 f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.0f} output tok/s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(sweep: dict, path: str) -> None:
    plt = headless_pyplot()
    runs: list[ServeRun] = sweep["runs"]
    rates = [run.config.workload.request_rate for run in runs]
    fig, axes = plt.subplots(2, 4, figsize=(17, 7.5))
    by_rate = [run.summary for run in runs]
    top = [("goodput (req/s)", [s["goodput"] for s in by_rate]),
           ("SLO attainment", [s["slo_attainment"] for s in by_rate]),
           ("p99 TPOT (ms)", [_p(s, "tpot", "p99") for s in by_rate]),
           ("p99 TTFT (ms)", [_p(s, "ttft", "p99") for s in by_rate])]
    for ax, (label, ys) in zip(axes[0], top):
        ax.plot(rates, ys, "o-")
        ax.set(xlabel="request rate (req/s)", ylabel=label)
        ax.grid(alpha=0.3)
    axes[0][0].plot(rates, rates, ":", color="gray", label="offered rate")
    axes[0][0].legend()
    axes[0][1].axhline(sweep["attainment_target"], color="red", linestyle="--", linewidth=1, label="target")
    if sweep["max_rate_meeting_slo"] is not None:
        axes[0][1].axvline(sweep["max_rate_meeting_slo"], color="green", linestyle=":", linewidth=1,
                           label=f"max rate {sweep['max_rate_meeting_slo']:g}")
    axes[0][1].legend()
    slo = runs[0].config.slo
    for ax, target in ((axes[0][2], slo.tpot), (axes[0][3], slo.ttft)):
        if target is not None:
            ax.axhline(target * 1e3, color="red", linestyle="--", linewidth=1, label="target")
            ax.legend()
    for ax, (figure, title) in zip(axes[1], FIGURES):
        for run, rate in zip(runs, rates):
            _cdf(ax, latency_values(run)[figure], f"{rate:g} req/s")
        _targets(ax, runs[0], figure)
        ax.set(xlabel=f"{title} (ms)", ylabel="CDF", title=title, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{runs[0].model}: sweep, SLO {sweep['slo']}, target attainment {sweep['attainment_target']:.0%}\n"
                 f"{runs[0].config.workload.describe_requests()}; "
                 f"{'Poisson' if runs[0].config.workload.burstiness == 1 else 'gamma'} arrivals", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _p(summary: dict, figure: str, key: str) -> float | None:
    d = summary[figure]
    return d[key] * 1e3 if d else None
