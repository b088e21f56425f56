"""The picture of ``splitserve bench compare`` (one PNG, matplotlib's file-only backend): goodput per topology
(bars coloured by kind, the best colocated one marked), SLO attainment and p99 TPOT against the request rate
(one line per topology: the baseline bold, the other colocated settings dotted; the targets dashed red)."""

from __future__ import annotations

from splitserve.bench.compare.plan import CompareConfig, TopologyResult, best_colocated
from splitserve.measure.figures import headless_pyplot

KIND_COLORS = {"disaggregated": "tab:blue", "colocated": "tab:orange", "conditional": "tab:green"}


def plot_compare(results: list[TopologyResult], config: CompareConfig, path: str) -> None:
    plt = headless_pyplot()
    fig, (bars, attainment, tpot) = plt.subplots(1, 3, figsize=(18, 5))
    measured = [r for r in results if r.goodput is not None]
    base = best_colocated(results)
    names = [r.topology.name + (" (baseline)" if r is base else "") for r in measured]
    drawn = bars.barh(names, [r.goodput for r in measured], color=[KIND_COLORS[r.topology.kind] for r in measured])
    bars.bar_label(drawn, labels=[f"{r.goodput:.2f}" for r in measured])  # 0: not even the lowest rate met them
    bars.set_xlim(0, max(config.rates) * 1.15)
    bars.invert_yaxis()
    bars.set_xlabel(f"goodput (req/s at >= {config.attainment:.0%} SLO attainment)")
    bars.set_title("goodput per topology")
    lines = plt.get_cmap("tab10")
    for i, r in enumerate(measured):
        rows = r.sweep["runs"]
        rates = [run.config.workload.request_rate for run in rows]
        # One colour per topology; the colocated settings other than the baseline dotted, the baseline bold.
        style = dict(marker="o", label=r.topology.name, color=lines(i % 10), linewidth=2.5 if r is base else 1.5,
                     linestyle=":" if r.topology.kind == "colocated" and r is not base else "-")
        attainment.plot(rates, [run.summary["slo_attainment"] * 100 for run in rows], **style)
        tpot.plot(rates, [run.summary["tpot"]["p99"] * 1e3 if run.summary["tpot"] else float("nan")
                          for run in rows], **style)
    attainment.axhline(config.attainment * 100, color="red", linestyle="--", linewidth=1)
    attainment.set(xlabel="request rate (req/s)", ylabel="requests meeting both targets (%)",
                   title=f"SLO attainment ({config.serve.slo.describe()})")
    if config.serve.slo.tpot is not None:
        tpot.axhline(config.serve.slo.tpot * 1e3, color="red", linestyle="--", linewidth=1)
    tpot.set(xlabel="request rate (req/s)", ylabel="p99 TPOT (ms)", title="p99 time per output token")
    tpot.legend(fontsize=7)
    failed = [r.topology.name for r in results if r.goodput is None]
    fig.suptitle(f"bench compare: {config.serve.workload.describe_requests()}"
                 + (f"  (failed: {', '.join(failed)})" if failed else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
