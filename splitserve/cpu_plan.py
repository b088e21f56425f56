"""The CPU plan of ``splitserve up``: which CPUs each process runs on and how many torch threads it starts.

    plan_cpus(pods, allowed, given, ranks)  ->  {process name: CpuAssignment}

Rules, in order:

1. A role given a set (``--prefill-cpus``, ``--decode-cpus``, ``--mixed-cpus``) runs on it.
2. The roles given none share out the CPUs the given sets left (all the allowed CPUs if they left none): in contiguous
   slices in the order prefill, decode, mixed, sized by their pods' ranks (a pod of tensor- or pipeline-parallel size N
   counts N, ``ranks``), at least one CPU each; with fewer CPUs than such roles, those roles all share the CPUs.
3. The pods of a role split its set into contiguous slices sized by their ranks (the first pods take the
   remainder) when the set has a CPU for each of them, and otherwise all share it. A pod of N ranks pins each rank
   to its own share of its slice (engine/parallel/workers.py), or, with fewer CPUs than ranks, one CPU each in turn.
4. A pod starts one torch thread per CPU of its set, divided by the pods sharing that same set (at least one per
   rank), so the threads on a set never outnumber its CPUs unless its ranks do.
5. The router runs on ``--router-cpus``, else it floats over every allowed CPU (ROUTER_FLOATS below says why).
   redis-server and Prometheus float over every allowed CPU too: they are light and mostly asleep.

On 2 CPUs: 1 prefill + 1 decode pod -> prefill-0 on CPU 0, decode-0 on CPU 1, one thread each, the router
floating; 2 mixed pods -> mixed-0 on CPU 0, mixed-1 on CPU 1; 1 mixed pod -> CPUs 0-1, two threads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve.runtime.cpus import format_cpu_list
from splitserve.runtime.roles import POD_ROLES, Role

# The router floats rather than sharing the decode pods' CPUs (measured with scripts/router_placement.py on the
# 2-core development machine; docs/architecture.md, "CPU plan"): it spends ~1.5 ms of CPU per generated token,
# ~6% of the decode pod's ~25 ms, which pinned next to decode lands on decode's only CPU, while floating it takes
# whichever CPU is idle (the prefill CPU between prompts). TPOT pinned / floating: median 1.07 over 8 paired rounds.
ROUTER_FLOATS = True


@dataclass(frozen=True)
class CpuAssignment:
    """Where one process runs. ``threads`` 0: it computes nothing with torch (router, redis, Prometheus)."""

    process: str
    role: str
    cpus: frozenset[int]
    threads: int  # all its ranks' together
    pinned: bool  # False: the process may run on any allowed CPU (``cpus`` lists them)
    ranks: int = 1  # tensor- or pipeline-parallel ranks, each a process of its own on its share of ``cpus``


def plan_cpus(pods: Sequence[tuple[str, Role]], allowed: frozenset[int], given: Mapping[Role, frozenset[int]],
              ranks: Mapping[str, int] | None = None) -> dict[str, CpuAssignment]:
    """Placements of ``pods`` ((name, role) in start order) and of the router, within ``allowed``. ``given``:
    the sets the operator named, by role (Role.ROUTER for the router); empty or missing sets are planned.
    ``ranks``: each pod's tensor- or pipeline-parallel size (1 where missing)."""
    size = {name: (ranks or {}).get(name, 1) for name, _ in pods}
    weight = Counter()
    for name, role in pods:
        weight[role] += size[name]
    role_sets = {role: given[role] for role in POD_ROLES if weight[role] and given.get(role)}
    planned = [role for role in POD_ROLES if weight[role] and role not in role_sets]
    left = sorted(allowed - frozenset().union(*role_sets.values())) or sorted(allowed)
    role_sets.update(zip(planned, _split(left, [weight[role] for role in planned])))

    pod_sets: dict[str, frozenset[int]] = {}
    for role, role_set in role_sets.items():
        names = [name for name, pod_role in pods if pod_role is role]
        pod_sets.update(zip(names, _split(sorted(role_set), [size[name] for name in names])))
    sharers = Counter(pod_sets.values())
    placements = {name: CpuAssignment(name, role, pod_sets[name],
                                      max(size[name], len(pod_sets[name]) // sharers[pod_sets[name]]), True,
                                      size[name])
                  for name, role in pods}
    router_set = given.get(Role.ROUTER) or (allowed if ROUTER_FLOATS else _decode_cpus(placements))
    placements["router"] = CpuAssignment("router", Role.ROUTER, router_set, 0, router_set != allowed)
    return placements


def floating(process: str, allowed: frozenset[int]) -> CpuAssignment:
    """A helper process left to the OS scheduler (redis-server, Prometheus)."""
    return CpuAssignment(process, process, allowed, 0, False)


def _decode_cpus(placements: Mapping[str, CpuAssignment]) -> frozenset[int]:
    return frozenset().union(*(p.cpus for p in placements.values() if Role(p.role).can_decode))


def _split(cpus: list[int], weights: list[int]) -> list[frozenset[int]]:
    """``cpus`` cut into contiguous slices sized by ``weights`` (largest remainder, at least one CPU each), or the
    whole of ``cpus`` for everyone when there are fewer CPUs than weights."""
    if not weights:
        return []
    if len(cpus) < len(weights):
        return [frozenset(cpus)] * len(weights)
    total = sum(weights)
    ideal = [len(cpus) * w / total for w in weights]
    sizes = [max(1, int(share)) for share in ideal]
    while sum(sizes) < len(cpus):  # the largest shortfall gets the next CPU (the first on a tie)
        sizes[max(range(len(sizes)), key=lambda i: (ideal[i] - sizes[i], -i))] += 1
    while sum(sizes) > len(cpus):  # the minimum of one CPU overshot: take from the largest excess that can give
        sizes[max((i for i in range(len(sizes)) if sizes[i] > 1), key=lambda i: (sizes[i] - ideal[i], -i))] -= 1
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [frozenset(cpus[start:start + size]) for start, size in zip(starts, sizes)]


def format_plan(placements: Sequence[CpuAssignment]) -> str:
    """The table ``splitserve up`` prints at start."""
    rows = [("process", "role", "CPUs", "threads")]
    for p in placements:
        cpus = format_cpu_list(p.cpus) + ("" if p.pinned else " (any)")
        threads = (str(p.threads) + (f" ({p.ranks} ranks)" if p.ranks > 1 else "")) if p.threads else "-"
        rows.append((p.process, str(p.role), cpus, threads))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
