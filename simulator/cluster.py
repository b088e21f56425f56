"""A simulated cluster: the router's placement over ``SimPod``s, and each request's path as ``bench serve`` sees it.

A request's path, as in DESIGN.md ("One request, disaggregated") and ``router/request_run.py``:

  arrival (the workload's send time)
  + ``router_s`` (HTTP, tokenizing, placing: the profile's fitted overhead)
  -> the routing policy (``splitserve.router.policies``, the real one, given the router's SLO targets) picks D, and P
     unless the prompt prefills on D (conditional disaggregation, no prefill pod: a colocated cluster of mixed pods,
     or, hybrid, ``HybridPlacement`` predicting that a prompt lent to D gets its first token sooner);
     no decode pod with room -> RESOURCE_EXHAUSTED, the request fails as a real client's would (HTTP 429)
  -> disaggregated: D reserves the prompt's blocks (the push lands there), P's scheduler prefills the prompt
     (``max_tokens = 1``), the KV's exposed transfer time passes, the first token reaches the client, and D admits
     the sequence with it (``admit_prefilled``) and decodes the rest;
     split (hybrid): the same for the prompt's first ``RoutePlan.prefix_tokens``, after which D takes their KV
     through its prefix cache and prefills the rest (``SimPod.add_after_prefix``), then decodes;
     on D: D's scheduler prefills and decodes it (hybrid: a decode pod's ``TPOTSlackBudget`` chunks a lent prompt
     so that its running requests keep the TPOT target);
  -> every token D samples reaches the client at the step's end; the last one ends the request.

The router's own bookkeeping on each pod (``PodInfo.active_requests``, ``queued_prompt_tokens``,
``blocks_since_report``) is kept as the router's ``PodCalls.hold`` keeps it, so the policies see what the real router
sees; with hybrid scheduling each remote prefill's exposed KV transfer time is fed back to the placement
(``HybridPlacement.observe_transfer``), as ``router/request_run.py`` does.
Each request ends as a ``splitserve.measure.serve_metrics.RequestRecord``: the same figures, by the same code, as a
real run.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass, field

from splitserve.engine.config import SchedulerConfig
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import Sequence
from splitserve.measure.phase_profile import PhaseProfile
from splitserve.measure.serve_metrics import RequestRecord
from splitserve.measure.workload import RequestSpec
from splitserve.router.config import Scheduling
from splitserve.router.pods.registry import PodInfo
from splitserve.router.policies import RoutingPolicy, SLOTargets
from splitserve.runtime.errors import StatusError
from splitserve.runtime.roles import Role
from splitserve.simulator.events import EventLoop
from splitserve.simulator.sim_pod import SimPod

# The simulator's scheduling unless told another (its cluster spec, simulate and simulate ratios): the pure split,
# which its recorded fixtures and tables were made with; splitserve up's own default is hybrid (RouterConfig).
DEFAULT_SCHEDULING = Scheduling.DISAGGREGATED


@dataclass(frozen=True)
class PodPool:
    """``count`` pods of one role running at one profile's speed."""

    role: Role
    count: int
    profile: PhaseProfile

    @property
    def cpus(self) -> int:
        """The CPUs the pool occupies: each pod the CPUs of its profile's size (its ranks' share)."""
        return self.count * self.profile.pod_cpus

    def describe(self) -> str:
        pod = self.profile
        return (f"{self.role.value}:{self.count} x {pod.pod_cpus} CPU{'s' if pod.pod_cpus > 1 else ''} "
                f"(TP {pod.tensor_parallel_size}) = {self.cpus}")


@dataclass(frozen=True)
class ClusterSpec:
    """What every pod shares (``splitserve up``'s pod flags) and how requests reach them."""

    pools: tuple[PodPool, ...]
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_blocks: int = 0  # KV blocks per pod
    block_size: int = 16
    max_model_len: int = 8192
    codec_ratio: float = 1.0  # the KV codec's wire bytes over raw bytes (none: 1)
    span_s: float = 0.0  # longest span of steady decode steps taken at once (simulator/sim_pod.py; 0: single steps)
    # The workloads' prompts are fresh to every pod (as bench serve's are), so the prefix cache never hits: off, the
    # pods skip hashing every full block (the same schedule, faster); on, it runs as the real pods run it. A hybrid
    # cluster's decode pods have it on regardless: a split prefill's prefix reaches D through it.
    prefix_caching: bool = False
    router_s: float = 0.0  # the router's time per request before placing it (the profile's fitted overhead)
    # splitserve up's --scheduling: hybrid gives the decode pods TPOT-slack chunking at the router's TPOT target
    # (the policy must then carry a HybridPlacement); colocated clusters come as pools of mixed pods.
    scheduling: Scheduling = DEFAULT_SCHEDULING
    targets: SLOTargets = SLOTargets(1.0, 0.1)  # the router's --slo-ttft-s / --slo-tpot-s

    @property
    def cpus(self) -> int:
        """The CPUs the cluster's pods occupy, every pool's pods counted at their profile's size."""
        return sum(pool.cpus for pool in self.pools)


@dataclass
class _InFlight:
    """One request's simulated state: its record, and where it is counted (the router's holds)."""

    spec: RequestSpec
    record: RequestRecord
    prefill: SimPod | None = None
    decode: SimPod | None = None
    decode_seq: Sequence | None = None
    pushed: Sequence | None = None  # a split prefill: the prefix whose KV P pushes to D (D prefills the rest)
    prefill_on_decode: int = 0  # prompt tokens D prefills (the router's hold on D counts them until the first token)
    released: bool = False  # the router's hold on D ended (the request's last token)


class SimCluster:
    """Pods, the router's policy, and the requests of one run; ``run(specs)`` returns their records."""

    def __init__(self, spec: ClusterSpec, policy: RoutingPolicy, loop: EventLoop | None = None):
        if spec.scheduling is Scheduling.HYBRID and policy.hybrid is None:
            raise ValueError("hybrid scheduling needs a policy with a HybridPlacement (make_policy(hybrid=...))")
        self.spec, self.policy = spec, policy
        self.loop = loop or EventLoop()
        self.pods: list[SimPod] = []
        self._by_name: dict[str, SimPod] = {}
        self._names = itertools.count()
        for pool in spec.pools:
            for _ in range(pool.count):
                self.add_pod(pool)
        self._flights: dict[str, _InFlight] = {}
        self.records: list[RequestRecord] = []
        self.decisions: Counter[str] = Counter()  # RoutePlan.decision of each placed request (the router's metric)

    def add_pod(self, pool: PodPool) -> SimPod:
        """One more pod of ``pool``, serving at once (the planner's replay adds pods after their start-up)."""
        scheduler, prefix_caching = self.spec.scheduler, self.spec.prefix_caching
        if pool.role is Role.DECODE and self.spec.scheduling is Scheduling.HYBRID:  # as splitserve up starts them
            scheduler = dataclasses.replace(scheduler, tpot_slack_chunking=True,
                                            default_tpot_target_s=self.spec.targets.tpot_s)
            prefix_caching = True
        pod = SimPod(f"{pool.role}-{next(self._names)}", pool.role, pool.profile, scheduler,
                     self.spec.num_blocks, self.spec.block_size, self.spec.max_model_len, self.loop, self._on_token,
                     self.spec.span_s, self._release, prefix_caching)
        self.pods.append(pod)
        self._by_name[pod.name] = pod
        self._routable()
        return pod

    def drain(self, pod: SimPod) -> None:
        """The pod takes no new request (the planner scaled its pool down); its requests finish there."""
        pod.info.serving = False
        self._routable()

    def remove(self, pod: SimPod) -> None:
        """A drained pod with nothing left leaves."""
        self.pods.remove(pod)
        del self._by_name[pod.name]

    def _routable(self) -> None:
        # The registry's routable pods of each role: they change only as pods come and go.
        self._prefill_infos = [p.info for p in self.pods if p.info.healthy and p.role is Role.PREFILL]
        self._decode_infos = [p.info for p in self.pods if p.info.healthy and p.info.can_decode]

    def run(self, specs: list[RequestSpec], until: float = float("inf")) -> list[RequestRecord]:
        records = self.records = []  # filled as they go: a planner reads them while the run goes on
        for spec in specs:
            record = RequestRecord(spec.index, spec.prompt_len, spec.output_len, spec.arrival_s)
            records.append(record)
            self.loop.at(spec.arrival_s, self.arrive, spec, record)
        self.loop.run(until)
        for record in records:
            if record.status == "sent":
                record.status = "unfinished"
        return records

    # ---- the router -------------------------------------------------------------------------------------

    def arrive(self, spec: RequestSpec, record: RequestRecord) -> None:
        record.status, record.sent_s = "sent", self.loop.now
        self.loop.after(self.spec.router_s, self._place, _InFlight(spec, record))

    def _place(self, flight: _InFlight) -> None:
        spec, record = flight.spec, flight.record
        request_id = f"r{spec.index}"
        prompt = [spec.index + 1] * spec.prompt_len  # fresh per request: no prefix-cache hits, as bench serve's
        if len(prompt) >= self.spec.max_model_len:  # the router's 400: the prompt fills the model's context
            record.status, record.end_s, record.error = "failed", self.loop.now, "http_400"
            return
        try:
            plan = self.policy.choose_pair(_Prompt(prompt), self._prefill_infos, self._decode_infos,
                                           self.spec.targets)
        except StatusError as error:
            record.status, record.end_s, record.error = "failed", self.loop.now, f"grpc_{error.code.name}"
            return
        self.decisions[plan.decision] += 1
        by_name = self._by_name
        flight.decode = by_name[plan.decode.address]
        params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
        seq = Sequence(request_id, prompt, params)
        self._flights[request_id] = flight
        flight.decode_seq = seq
        if plan.prefill is None:
            _hold(plan.decode, prompt_tokens=len(prompt), kv_tokens=len(prompt))
            flight.prefill_on_decode = len(prompt)
            flight.decode.add(seq)
            return
        flight.prefill = by_name[plan.prefill.address]
        num_pushed = plan.prefix_tokens or len(prompt)
        prefill_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        pushed = Sequence(request_id, prompt[:num_pushed], prefill_params) if plan.prefix_tokens else seq
        if not flight.decode.reserve(pushed):
            self._flights.pop(request_id)
            record.status, record.end_s, record.error = "failed", self.loop.now, "grpc_RESOURCE_EXHAUSTED"
            return
        if plan.prefix_tokens:  # D's share of the prompt counts there from now, as the router holds it
            flight.pushed, flight.prefill_on_decode = pushed, len(prompt) - num_pushed
        _hold(plan.decode, prompt_tokens=flight.prefill_on_decode, kv_tokens=len(prompt))
        _hold(plan.prefill, prompt_tokens=num_pushed)
        flight.prefill.add(Sequence(request_id, prompt[:num_pushed], prefill_params))

    # ---- tokens -----------------------------------------------------------------------------------------

    def _on_token(self, pod: SimPod, seq: Sequence, times: list[float]) -> None:
        """``seq`` sampled tokens on ``pod`` at ``times`` (one, or each step of a span)."""
        flight = self._flights[seq.request_id]
        if pod is flight.prefill:
            self._prefilled(flight, seq)
            return
        record = flight.record
        if not record.chunk_s:
            flight.decode.info.queued_prompt_tokens -= flight.prefill_on_decode  # the hold's prompt_done
        record.chunk_s.extend(times)
        if seq.is_finished:
            self._finish(flight, seq, times[-1])

    def _prefilled(self, flight: _InFlight, seq: Sequence) -> None:
        """P sampled the first token: P's hold ends; after the KV's exposed transfer, the client has the first
        token and D admits the sequence."""
        prefill = flight.prefill
        prefill.info.queued_prompt_tokens -= seq.num_prompt_tokens
        prefill.info.active_requests -= 1
        transfer_s = prefill.profile.transfer_s(seq.num_prompt_tokens, self.spec.codec_ratio)
        if self.policy.hybrid is not None:
            self.policy.hybrid.observe_transfer(seq.num_prompt_tokens, transfer_s)
        self.loop.after(transfer_s, self._first_token, flight)

    def _first_token(self, flight: _InFlight) -> None:
        seq = flight.decode_seq
        if flight.pushed is not None:  # a split prefill: D takes the prefix's KV and prefills the rest
            flight.decode.add_after_prefix(flight.pushed, seq)
            return
        flight.record.chunk_s.append(self.loop.now)
        flight.decode.admit_prefilled(seq)
        if seq.is_finished:  # max_tokens 1: done with the first token
            self._finish(flight, seq, self.loop.now)

    def _finish(self, flight: _InFlight, seq: Sequence, now: float) -> None:
        record = flight.record
        record.status, record.end_s = "ok", now
        record.prompt_tokens, record.output_tokens = seq.num_prompt_tokens, seq.num_output_tokens
        self._release(flight.decode, seq)
        del self._flights[seq.request_id]

    def _release(self, pod: SimPod, seq: Sequence) -> None:
        """The request's last token: the router's hold on D ends (at that step, also inside a span)."""
        flight = self._flights[seq.request_id]
        if not flight.released:
            flight.released = True
            pod.info.active_requests -= 1


@dataclass
class _Prompt:
    """What the policies read of a request (``RouterRequest.prompt_token_ids``)."""

    prompt_token_ids: list[int]
    may_split_prefill: bool = True  # generated, greedy, no prompt logprobs: as bench serve's requests


def _hold(pod: PodInfo, prompt_tokens: int = 0, kv_tokens: int = 0) -> None:
    """``RequestRun.hold``: the request counted on ``pod`` before the pod's next report shows it."""
    pod.active_requests += 1
    pod.queued_prompt_tokens += prompt_tokens
    pod.blocks_since_report += -(-kv_tokens // pod.load.block_size) if kv_tokens else 0
