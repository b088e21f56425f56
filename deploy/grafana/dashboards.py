"""splitserve's Grafana dashboards, built with grafana-foundation-sdk: overview, prefill, decode, router, planner.

``python -m splitserve.deploy.grafana`` writes them as JSON into ``deploy/grafana/dashboards/`` (the Helm chart ships
that folder as ConfigMaps for Grafana's sidecar); a test checks the committed JSON equals this module's output.

Every dashboard has a datasource variable, a ``namespace`` variable (the label Kubernetes scrapes add; "All" also
matches series without one), a ``model_name`` variable and a ``role`` variable (limited to the roles the dashboard
is about), and every query filters on all three. Percentiles are ``histogram_quantile`` over ``sum by (le, role)``
of bucket rates over ``$__rate_interval``: one line per role, so the router's histogram (what clients see) and the
pods' (their share) never merge into one meaningless percentile. Every panel has a unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'namespace=~"$namespace", model_name=~"$model_name", role=~"$role"'
QUANTILES = (0.5, 0.9, 0.99)
TOKENS_PER_S = "suffix: tok/s"
VARIABLE_SERIES = "process_cpu_seconds_total"  # every splitserve process has it, with namespace, model and role
RATIO = "suffix:x"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


def rate(metric: str, by: str = "", extra: str = "") -> str:
    """``sum [by (...)] (rate(metric{SEL, extra}[$__rate_interval]))``."""
    selector = SEL + (f", {extra}" if extra else "")
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{selector}}}[$__rate_interval]))"


def quantiles(histogram: str, by: str = "") -> list[Query]:
    """p50, p90 and p99 of a histogram (``histogram`` without the ``_bucket`` suffix), per role (and ``by``)."""
    group = ", ".join(["le", "role", *([by] if by else [])])
    legend = " ".join(["{{role}}", *([f"{{{{{by}}}}}"] if by else [])])
    return [Query(f"histogram_quantile({q}, {rate(histogram + '_bucket', group)})", f"p{round(q * 100)} {legend}")
            for q in QUANTILES]


def mean(histogram: str, by: str = "role") -> str:
    return f"{rate(histogram + '_sum', by)} / {rate(histogram + '_count', by)}"


def panel(title: str, unit: str, queries: list[Query], description: str = "", width: int = 8,
          stacked: bool = False, max_value: float | None = None) -> Timeseries:
    builder = (Timeseries().title(title).description(description).unit(unit).min(0).span(width).height(8)
               .datasource(DATASOURCE)
               .legend(common_builders.VizLegendOptions().show_legend(True)
                       .display_mode(common.LegendDisplayMode.TABLE).placement(common.LegendPlacement.BOTTOM)
                       .calcs(["mean", "max", "lastNotNull"])))
    if max_value is not None:
        builder = builder.max(max_value)
    if stacked:
        builder = builder.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(40)
    for ref, query in zip("ABCDEFGH", queries):
        builder = builder.with_target(Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref)
                                      .datasource(DATASOURCE))
    return builder


def dashboard(uid: str, title: str, description: str, roles: str, default_role: str) -> Dashboard:
    """A dashboard with the three variables; ``roles`` is a regex of the roles its role variable offers."""
    role_default = VariableOption(selected=True, text=default_role, value=default_role)
    return (Dashboard(title).uid(uid).description(description).tags(["splitserve", "llm"])
            .refresh("30s").time("now-1h", "now").timezone("browser").tooltip(DashboardCursorSync.CROSSHAIR)
            .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
            .with_variable(QueryVariable("namespace").label("Namespace").datasource(DATASOURCE)
                           .query(f"label_values({VARIABLE_SERIES}, namespace)")
                           .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                           .multi(True).include_all(True).all_value(".*"))
            .with_variable(QueryVariable("model_name").label("Model").datasource(DATASOURCE)
                           .query(f'label_values({VARIABLE_SERIES}{{namespace=~"$namespace"}}, model_name)')
                           .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                           .multi(True).include_all(True).all_value(".*"))
            .with_variable(QueryVariable("role").label("Role").datasource(DATASOURCE)
                           .query(f'label_values({VARIABLE_SERIES}{{namespace=~"$namespace", '
                                  f'model_name=~"$model_name"}}, role)')
                           .regex(f"/^({roles})$/").current(role_default)
                           .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                           .multi(True).include_all(True).all_value(roles)))


def overview() -> Dashboard:
    return (dashboard("splitserve-overview", "splitserve / Overview",
                      "What clients see (role router) and what each role does: load, goodput, latency, errors.",
                      "router|prefill|decode|mixed", "router")
            .with_row(Row("Traffic"))
            .with_panel(panel("Request rate", "reqps", [
                Query(rate("splitserve_request_success_total", "role"), "{{role}}")],
                "Finished requests per second, by role."))
            .with_panel(panel("Goodput", "reqps", [
                Query(rate("splitserve_requests_within_slo_total"), "within TTFT and TPOT targets"),
                Query(rate("splitserve_request_success_total"), "all finished")],
                "Requests per second that met both the TTFT and the TPOT target (slo_ttft_s, slo_tpot_s)."))
            .with_panel(panel("Token throughput", TOKENS_PER_S, [
                Query(rate("splitserve_prompt_tokens_total", "role"), "prompt {{role}}"),
                Query(rate("splitserve_generation_tokens_total", "role"), "generated {{role}}")]))
            .with_row(Row("Latency"))
            .with_panel(panel("Time to first token", "s", quantiles("splitserve_time_to_first_token_seconds"),
                              "From request arrival to the first output token."))
            .with_panel(panel("Time per output token", "s",
                              quantiles("splitserve_request_time_per_output_token_seconds"),
                              "Per request: (end-to-end - TTFT) / (output tokens - 1)."))
            .with_panel(panel("End-to-end latency", "s", quantiles("splitserve_e2e_request_latency_seconds"),
                              "From request arrival to its last token."))
            .with_panel(panel("Where TTFT goes (mean)", "s", [
                Query(mean("splitserve_request_queue_time_seconds"), "queue {{role}}"),
                Query(mean("splitserve_request_prefill_time_seconds"), "prefill {{role}}"),
                Query(mean("splitserve_kv_transfer_time_seconds"), "KV transfer (exposed) {{role}}")],
                "TTFT splits into queue + prefill + the KV transfer not hidden behind compute.", stacked=True))
            .with_row(Row("Errors and load"))
            .with_panel(panel("Errors", "reqps", [
                Query(rate("splitserve_router_rejected_requests_total", "code"), "rejected {{code}}"),
                Query(rate("splitserve_request_success_total", "finished_reason", 'finished_reason="abort"'),
                      "aborted")],
                "Requests refused before any output (by gRPC code) and requests aborted."))
            .with_panel(panel("Requests running and waiting", "short", [
                Query(f"sum by (role) (splitserve_num_requests_running{{{SEL}}})", "running {{role}}"),
                Query(f"sum by (role) (splitserve_num_requests_waiting{{{SEL}}})", "waiting {{role}}")]))
            .with_panel(panel("Finish reasons", "reqps", [
                Query(rate("splitserve_request_success_total", "role, finished_reason"),
                      "{{role}} {{finished_reason}}")],
                "Finished requests by why they ended: stop (EOS or a stop string), length (max_tokens), abort, error."))
            .with_row(Row("Requests"))
            .with_panel(panel("Prompt length", "short", quantiles("splitserve_request_prompt_tokens"),
                              "Prompt tokens per request (decode and mixed pods, where every request ends)."))
            .with_panel(panel("Output length", "short", quantiles("splitserve_request_generation_tokens"),
                              "Output tokens per request."))
            .with_row(Row("Resources"))
            .with_panel(panel("CPU per pod", "short", [
                Query(f"sum by (role, instance) (rate(process_cpu_seconds_total{{{SEL}}}[$__rate_interval]))",
                      "{{role}} {{instance}}")],
                "Cores busy in each process (router, pods, planner), from the process collector."))
            .with_panel(panel("Memory per pod", "bytes", [
                Query(f"sum by (role, instance) (process_resident_memory_bytes{{{SEL}}})", "{{role}} {{instance}}")],
                "Resident memory of each process (weights, KV cache, the Python heap)."))
            .build())


def prefill() -> Dashboard:
    return (dashboard("splitserve-prefill", "splitserve / Prefill",
                      "Prefill pods: queueing, prefill compute, batch sizes, and the KV cache push to decode pods.",
                      "prefill|mixed", "prefill")
            .with_row(Row("Prefill"))
            .with_panel(panel("Queue time", "s", quantiles("splitserve_request_queue_time_seconds"),
                              "From arrival at the pod to the prefill's first scheduling."))
            .with_panel(panel("Prefill time", "s", quantiles("splitserve_request_prefill_time_seconds"),
                              "From first scheduling to the first token."))
            .with_panel(panel("Prompt tokens prefilled", TOKENS_PER_S, [
                Query(rate("splitserve_prompt_tokens_total", "instance"), "{{instance}}")]))
            .with_panel(panel("Batch tokens per step", "short",
                              quantiles("splitserve_iteration_tokens_total")[::2] + [
                                  Query(mean("splitserve_iteration_tokens_total"), "mean {{role}}")],
                              "Tokens in one engine step (prefill chunks and decode tokens together)."))
            .with_row(Row("KV transfer"))
            .with_panel(panel("KV transfer time", "s", quantiles("splitserve_kv_transfer_time_seconds"),
                              "Exposed transfer: from the end of prefill compute to the decode pod's "
                              "acknowledgement."))
            .with_panel(panel("KV bytes sent", "Bps", [
                Query(rate("splitserve_kv_transfer_bytes_total", "codec"), "wire {{codec}}"),
                Query(rate("splitserve_kv_transfer_raw_bytes_total", "codec"), "raw {{codec}}")],
                "On the wire (compressed) and before compression, by codec."))
            .with_panel(panel("Compression ratio", RATIO, [
                Query(f'{rate("splitserve_kv_transfer_raw_bytes_total", "codec")} / '
                      f'{rate("splitserve_kv_transfer_bytes_total", "codec")}', "{{codec}}")],
                "Raw KV bytes over wire bytes, by codec."))
            .build())


def decode() -> Dashboard:
    return (dashboard("splitserve-decode", "splitserve / Decode",
                      "Decode pods: the running batch, the KV cache, token pace, preemptions and speculation.",
                      "decode|mixed", "decode")
            .with_row(Row("Batch and KV cache"))
            .with_panel(panel("Running and waiting", "short", [
                Query(f"sum by (instance) (splitserve_num_requests_running{{{SEL}}})", "running {{instance}}"),
                Query(f"sum by (instance) (splitserve_num_requests_waiting{{{SEL}}})", "waiting {{instance}}")]))
            .with_panel(panel("KV cache usage", "percentunit", [
                Query(f"max by (instance) (splitserve_kv_cache_usage_perc{{{SEL}}})", "{{instance}}")],
                "Fraction of KV blocks in use; admissions stall and requests are preempted near 100%.",
                max_value=1))
            .with_panel(panel("Preemptions", "short", [
                Query(f"sum by (instance) (increase(splitserve_num_preemptions_total{{{SEL}}}[$__rate_interval]))",
                      "{{instance}}")],
                "Requests pushed out of the running batch for lack of KV blocks (recomputed later)."))
            .with_row(Row("Token pace"))
            .with_panel(panel("Inter-token latency", "s", quantiles("splitserve_inter_token_latency_seconds"),
                              "Time between consecutive output tokens: one decode step."))
            .with_panel(panel("Time per output token", "s",
                              quantiles("splitserve_request_time_per_output_token_seconds")))
            .with_panel(panel("Tokens generated", TOKENS_PER_S, [
                Query(rate("splitserve_generation_tokens_total", "instance"), "{{instance}}")]))
            .with_panel(panel("Prefix cache hit rate", "percentunit", [
                Query(f'{rate("splitserve_prefix_cache_hits_total")} / '
                      f'{rate("splitserve_prefix_cache_queries_total")}', "hit rate")],
                "Prompt tokens found in the prefix cache over prompt tokens looked up.", max_value=1))
            .with_row(Row("Speculative decoding"))
            .with_panel(panel("Draft acceptance rate", "percentunit", [
                Query(f'{rate("splitserve_spec_decode_num_accepted_tokens_total", "instance")} / '
                      f'{rate("splitserve_spec_decode_num_draft_tokens_total", "instance")}', "{{instance}}")],
                "Draft tokens accepted over draft tokens verified (--speculative-method).", max_value=1))
            .with_panel(panel("Mean accepted length", "short", [
                Query(f'1 + {rate("splitserve_spec_decode_num_accepted_tokens_total", "instance")} / '
                      f'{rate("splitserve_spec_decode_num_drafts_total", "instance")}', "{{instance}}")],
                "Tokens a speculating request gets per step: its accepted drafts and the model's own token."))
            .with_panel(panel("Acceptance by draft position", "percentunit", [
                Query(f'{rate("splitserve_spec_decode_num_accepted_tokens_per_pos_total", "position")} / '
                      f'scalar({rate("splitserve_spec_decode_num_drafts_total")})', "position {{position}}")],
                "Share of proposals whose draft at this position was accepted (position 0: the first).",
                max_value=1))
            .build())


# The router names pods by pod_address: `pod` is the scraped pod's name wherever Kubernetes labels the targets.
PER_POD = "{{pod_role}} {{pod_address}}"


def router() -> Dashboard:
    def per_pod(metric: str) -> str:
        return f"sum by (pod_address, pod_role) ({metric}{{{SEL}}})"

    return (dashboard("splitserve-router", "splitserve / Router",
                      "The router: the load it sees on every pod, where it sends requests, retries and refusals.",
                      "router", "router")
            .with_row(Row("Per-pod load (as the router sees it)"))
            .with_panel(panel("Requests sent per pod", "reqps", [
                Query(rate("splitserve_router_pod_requests_total", "pod_address, pod_role"), PER_POD)]))
            .with_panel(panel("Running per pod", "short", [
                Query(per_pod("splitserve_router_pod_running_requests"), PER_POD)]))
            .with_panel(panel("Waiting per pod", "short", [
                Query(per_pod("splitserve_router_pod_waiting_requests"), PER_POD)]))
            .with_panel(panel("KV cache usage per pod", "percentunit", [
                Query(per_pod("splitserve_router_pod_kv_cache_usage_perc"), PER_POD)], max_value=1))
            .with_panel(panel("Queued prefill tokens per pod", "short", [
                Query(per_pod("splitserve_router_pod_queued_prefill_tokens"), PER_POD)]))
            .with_panel(panel("Healthy pods", "short", [
                Query(f"sum by (pod_role) (splitserve_router_pod_healthy{{{SEL}}})", "{{pod_role}}")],
                "Pods the router routes to, by role."))
            .with_row(Row("Routing"))
            .with_panel(panel("Routing decisions", "reqps", [
                Query(rate("splitserve_router_routing_decisions_total", "decision"), "{{decision}}")],
                "disaggregated: prefill pod then decode pod; prefill_on_decode: short, cached or lent prompts; split: "
                "a prefix on the prefill pod, the rest on the decode pod (hybrid scheduling)."))
            .with_panel(panel("Retries", "reqps", [
                Query(rate("splitserve_router_retries_total", "code"), "{{code}}")],
                "Requests retried on another pod after a failure before their first token."))
            .with_panel(panel("Rejected requests", "reqps", [
                Query(rate("splitserve_router_rejected_requests_total", "code"), "{{code}}")],
                "Refused before any output: load shedding (RESOURCE_EXHAUSTED), bad input, no pod."))
            .with_panel(panel("KV transfer failures and migrations", "reqps", [
                Query(rate("splitserve_kv_transfer_failures_total", "code"), "KV transfer failed {{code}}"),
                Query(rate("splitserve_kv_load_total", "outcome"), "KV load {{outcome}}"),
                Query(rate("splitserve_router_migrations_total"), "migrated"),
                Query(rate("splitserve_router_decode_pod_waits_total", "outcome"),
                      "waited for a decode pod: {{outcome}}")],
                "KV load outcomes on decode pods: loaded, recomputed (kv_load_failure_policy recompute, or a split "
                "prefill's expired prefix), failed; requests that waited for a decode pod (decode_pod_wait_s)."))
            .with_panel(panel("Shadow checks", "reqps", [
                Query(rate("splitserve_router_shadow_checks_total", "outcome"), "{{outcome}}")],
                "Answers served again through the other path and compared (--shadow-check-fraction): match, diverged "
                "(with a lossless KV codec, a wrong answer served), failed (the second run did not finish)."))
            .with_panel(panel("First diverging position", "short",
                              quantiles("splitserve_router_shadow_divergence_position"),
                              "Output token index where a diverged shadow check first differed from the answer "
                              "served."))
            .build())


def planner() -> Dashboard:
    def per_pool(metric: str) -> str:
        return f"max by (pool) ({metric}{{{SEL}}})"

    return (dashboard("splitserve-planner", "splitserve / Planner",
                      "The planner's decisions for the prefill and decode pools and the signals behind them.",
                      "planner", "planner")
            .with_row(Row("Decisions"))
            .with_panel(panel("Replicas per pool", "short", [
                Query(per_pool("splitserve_planner_current_replicas"), "current {{pool}}"),
                Query(per_pool("splitserve_planner_desired_replicas"), "desired {{pool}}"),
                Query(per_pool("splitserve_planner_needed_replicas"), "needed {{pool}}")],
                "What the Deployment had, what the planner set, and what the capacity model says the load needs."))
            .with_panel(panel("Decisions", "short", [
                Query(f"sum by (pool, reason) (increase(splitserve_planner_decisions_total{{{SEL}}}"
                      "[$__rate_interval]))", "{{pool}} {{reason}}")],
                "up, down, hold, cooldown, bounds, slo, starting (a previous change not ready yet), no-data, "
                "simulated (a shrink the simulated check held)."))
            .with_panel(panel("Errors", "short", [
                Query(f"sum by (stage) (increase(splitserve_planner_errors_total{{{SEL}}}[$__rate_interval]))",
                      "{{stage}}")],
                "Failed steps: reading Prometheus, reading or setting a Deployment's scale, the simulated check."))
            .with_panel(panel("Predicted SLO attainment (simulated check)", "percentunit", [
                Query(f"max by (plan) (splitserve_planner_predicted_attainment{{{SEL}}})", "{{plan}}")],
                "With simulateCheck: the share of the measured window's requests the simulator predicts to meet "
                "both targets, on the pools as they are (current) and as decided.", max_value=1))
            .with_row(Row("Signals"))
            .with_panel(panel("Demand", "short", [Query(per_pool("splitserve_planner_demand"), "{{pool}}")],
                              "Prefill: prompt tokens/s for prefill pods; decode: requests decoding at once."))
            .with_panel(panel("Capacity per pod", "short", [
                Query(per_pool("splitserve_planner_capacity_per_pod"), "{{pool}}")],
                "Prefill: prompt tokens/s one busy pod prefills; decode: requests one pod runs within TPOT."))
            .with_panel(panel("Dry run", "short", [
                Query(f"max(splitserve_planner_dry_run{{{SEL}}})", "dry run")],
                "1 while the planner only reports what it would do.", max_value=1))
            .build())


DASHBOARDS = {"overview": overview, "prefill": prefill, "decode": decode, "router": router, "planner": planner}


def render(name: str) -> str:
    built = DASHBOARDS[name]()
    for number, item in enumerate(built.panels, start=1):  # Grafana links and views panels by a unique id
        item.id_val = number
    return JSONEncoder(sort_keys=True, indent=2).encode(built) + "\n"


OUT_DIR = Path(__file__).parent / "dashboards"


def write_all() -> list[Path]:
    OUT_DIR.mkdir(exist_ok=True)
    paths = []
    for name in DASHBOARDS:
        path = OUT_DIR / f"splitserve-{name}.json"
        path.write_text(render(name))
        paths.append(path)
    return paths
