"""The planner's view of the cluster: one PromQL instant query per field of ``Signals``, through Prometheus' HTTP
API (``GET /api/v1/query``, within ``request_timeout_s``). A query that matches no series reads NaN ("not known"),
never 0. An answer that makes no sense (not JSON, several series, a value that is no number, a negative or
infinite one) is logged and read as NaN too: that signal is skipped, the others still count. Prometheus down
(a connection error or a timeout) raises OSError: the tick changes nothing.

Every query takes the router's series for what clients see (request and token rates, TTFT and TPOT p99) and the
pods' series for what each pool does (tokens prefilled, prefill time, running and waiting, step time, KV usage),
narrowed by ``model_name`` and ``promql_selector`` (for example the release's namespace).
"""

from __future__ import annotations

import json
import logging
import math
import urllib.parse
import urllib.request

from splitserve.deploy.planner.capacity import Signals
from splitserve.deploy.planner.config import PlannerConfig

logger = logging.getLogger(__name__)


def signal_queries(config: PlannerConfig) -> dict[str, str]:
    """PromQL for each field of ``Signals``."""
    w = f"{config.window_s}s"
    matchers = [m for m in (f'model_name="{config.model_name}"' if config.model_name else "",
                            config.promql_selector.strip()) if m]

    def sel(role: str = "", *extra: str) -> str:
        return "{" + ",".join(([f'role="{role}"'] if role else []) + list(extra) + matchers) + "}"

    def rate(metric: str, role: str, *extra: str) -> str:
        return f"sum(rate({metric}{sel(role, *extra)}[{w}]))"

    def p99(metric: str, role: str) -> str:
        return f"histogram_quantile(0.99, sum by (le) (rate({metric}_bucket{sel(role)}[{w}])))"

    return {
        "requests_per_s": rate("splitserve_request_success_total", "router"),
        "prompt_tokens_per_s": rate("splitserve_prompt_tokens_total", "router"),
        "output_tokens_per_s": rate("splitserve_generation_tokens_total", "router"),
        "prefill_tokens_per_s": rate("splitserve_prompt_tokens_total", "prefill"),
        "decode_prefill_tokens_per_s": rate("splitserve_prompt_tokens_total", "decode"),
        "prefill_busy": rate("splitserve_request_prefill_time_seconds_sum", "prefill"),
        "prefill_queue_p99_s": p99("splitserve_request_queue_time_seconds", "prefill"),
        "decode_pods": f"count(splitserve_kv_cache_usage_perc{sel('decode')})",
        "decode_running": f"sum(avg_over_time(splitserve_num_requests_running{sel('decode')}[{w}]))",
        "decode_waiting": f"sum(avg_over_time(splitserve_num_requests_waiting{sel('decode')}[{w}]))",
        "decode_step_s": (f"{rate('splitserve_inter_token_latency_seconds_sum', 'decode')} / "
                          f"{rate('splitserve_inter_token_latency_seconds_count', 'decode')}"),
        "kv_usage_max": f"max(splitserve_kv_cache_usage_perc{sel('decode')})",
        "ttft_p99_s": p99("splitserve_time_to_first_token_seconds", "router"),
        "tpot_p99_s": p99("splitserve_request_time_per_output_token_seconds", "router"),
    }


class BadAnswer(ValueError):
    """Prometheus answered, but not with one number that makes sense."""


class PrometheusSignals:
    """Reads ``Signals`` from a Prometheus server."""

    def __init__(self, config: PlannerConfig):
        self.base_url = config.prometheus_url.rstrip("/")
        self.queries = signal_queries(config)
        self.timeout_s = config.request_timeout_s

    def read(self) -> Signals:
        values = {}
        for name, promql in self.queries.items():
            try:
                values[name] = self.query(promql)
            except BadAnswer as err:
                logger.warning("skipping the signal %s: %s", name, err)
                values[name] = math.nan
        return Signals(**values)

    def query(self, promql: str) -> float:
        """The value of a query that yields one sample (or none: NaN). Raises OSError when Prometheus cannot be
        asked (down, slow past the timeout) and BadAnswer when its answer makes no sense."""
        url = f"{self.base_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
            raw = reply.read()
        try:
            body = json.loads(raw)
            if body.get("status") != "success":
                raise BadAnswer(f"Prometheus refused {promql!r}: {body.get('error', body)}")
            result = body["data"]["result"]
            if not result:
                return math.nan
            if len(result) > 1:
                raise BadAnswer(f"{promql!r} returned {len(result)} series, expected one")
            value = float(result[0]["value"][1])
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
            if isinstance(err, BadAnswer):
                raise
            raise BadAnswer(f"{promql!r}: unreadable answer {raw[:200]!r} ({err!r})") from None
        if math.isinf(value) or value < 0:  # NaN is "not known" (0/0), never bad
            raise BadAnswer(f"{promql!r} = {value}: no rate, count or duration is that")
        return value
