"""A pod's speed in a handful of fitted numbers: the profile file ``bench phases --profile-out`` writes and
``splitserve simulate`` (``simulator/``) runs on.

The step-time forms are DistServe's (OSDI 2024, section 4), per engine step of one pod:

  prefill  a + b * sum(n) + c * sum(n * (s + n))   over the step's prompt chunks of n tokens after s computed
           ones (one whole prompt: a + b * len + c * len^2, DistServe's form; the quadratic term is attention);
  decode   a + b * sum(ctx) + c * batch             over the step's decoding sequences (ctx: tokens in the context).

A step holding both (a mixed pod's chunked prefill beside running decodes, Sarathi-Serve's batches) costs the
prefill part plus the decode part's b and c terms: the weights are read once per step, by whichever part is there.

Beyond the model's compute, a real run pays what a bench does not see (llm-d's BLIS found that leaving it out
under-predicts TTFT by 17-56%): ``step_overhead_s`` per step (the pod's loop: streaming tokens out, load reports,
the asyncio hand-offs) and ``router_s`` per request before its first token (HTTP, tokenizing, placing, the
prefill call and the hand-off to the decode stream), both fitted from a real run (``simulator/calibrate.py``).
The KV cache moves from a prefill pod to a decode pod in ``kv_bytes_per_token * tokens * codec ratio /
link bandwidth``, of which the share ``1 - transfer_overlap`` is exposed (the rest is hidden behind the prefill
layer by layer).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class StepFit:
    """``a + b * x1 + c * x2`` seconds, coefficients >= 0 (what each form's x1 and x2 are: the module docstring)."""

    a: float
    b: float
    c: float
    rms_error: float = 0.0  # of the fit over its points, seconds

    def __call__(self, x1: float, x2: float) -> float:
        return self.a + self.b * x1 + self.c * x2


def fit_step(points: list[tuple[float, float, float]]) -> StepFit:
    """Least squares of ``seconds = a + b * x1 + c * x2`` over ``points`` (x1, x2, seconds), every coefficient
    >= 0: the best of the fits over each subset of the three terms whose coefficients all come out >= 0 (with
    three terms, trying the seven subsets is exact non-negative least squares)."""
    if len(points) < 1:
        raise ValueError("no points to fit")
    data = np.array(points, dtype=float)
    columns = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    y = data[:, 2]
    best: tuple[float, np.ndarray] | None = None
    for size in (1, 2, 3):
        for terms in itertools.combinations(range(3), size):
            coefs, *_ = np.linalg.lstsq(columns[:, terms], y, rcond=None)
            if (coefs < 0).any():
                continue
            full = np.zeros(3)
            full[list(terms)] = coefs
            error = float(np.sqrt(np.mean((columns @ full - y) ** 2)))
            if best is None or error < best[0] - 1e-15:
                best = (error, full)
    error, (a, b, c) = best if best is not None else (float(np.sqrt(np.mean(y ** 2))), np.zeros(3))
    return StepFit(float(a), float(b), float(c), error)


@dataclass(frozen=True)
class PhaseProfile:
    """One pod configuration's speed (a model on a machine at a thread count), as fitted step times."""

    model: str
    threads: int
    prefill: StepFit
    decode: StepFit
    kv_bytes_per_token: int  # of the KV cache as the pod stores it
    step_overhead_s: float = 0.0
    router_s: float = 0.0
    link_gbps: float = 10.0  # between a prefill and a decode pod
    transfer_overlap: float = 0.9  # share of the push hidden behind the prefill (docs/PERFORMANCE.md: KV transfer)
    note: str = ""  # where and how it was measured
    # What its prefill steps' products computed in (float32, bfloat16: the pods' resolved --prefill-compute-dtype);
    # the simulator picks its default profile by the format its pods would resolve (simulator/run.py).
    prefill_compute: str = "float32"
    # The pod's size when measured: its ranks (--tensor-parallel-size; older profiles: 1) and the CPUs it ran on (the
    # ranks share them out, engine/parallel/workers.py; 0, older profiles: threads x ranks). A simulated pod of this
    # profile occupies ``pod_cpus``; the figures hold only for pods of this size.
    tensor_parallel_size: int = 1
    cpus: int = 0
    points: dict = field(default_factory=dict, compare=False)  # the measurements fitted, for the record

    @property
    def pod_cpus(self) -> int:
        """The CPUs one pod of this profile occupies: those it was measured on, at least one per rank."""
        return max(self.cpus or self.threads * self.tensor_parallel_size, self.tensor_parallel_size)

    def prefill_s(self, tokens: int, attention: int) -> float:
        """A prefill step's seconds: ``tokens`` = sum(n), ``attention`` = sum(n * (s + n)) over its chunks."""
        return self.prefill(tokens, attention)

    def decode_s(self, context: int, batch: int) -> float:
        return self.decode(context, batch)

    def transfer_s(self, tokens: int, codec_ratio: float = 1.0) -> float:
        """Exposed seconds of pushing ``tokens`` tokens' KV at ``codec_ratio`` (wire / raw bytes)."""
        wire = tokens * self.kv_bytes_per_token * codec_ratio
        return (1.0 - self.transfer_overlap) * wire / (self.link_gbps * 1e9)

    def scaled(self, speed: float, **changes) -> "PhaseProfile":
        """This profile ``speed`` times faster in compute (a what-if: a projection, not a measurement)."""
        fits = {name: StepFit(f.a / speed, f.b / speed, f.c / speed, f.rms_error / speed)
                for name, f in (("prefill", self.prefill), ("decode", self.decode))}
        return dataclasses.replace(self, **fits, **changes)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "PhaseProfile":
        data = dict(data)
        for name in ("prefill", "decode"):
            data[name] = StepFit(**data[name])
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "PhaseProfile":
        return cls.from_json(json.loads(Path(path).read_text()))


def profile_from_phases(results: dict, threads: int, note: str) -> PhaseProfile:
    """The profile of a ``bench phases`` run: its prefill steps and decode points fitted to the two forms."""
    prefill_points = [(n, n * (s + n), seconds) for steps in results["prefill_steps"].values()
                      for s, n, seconds in steps]
    decode_points = [(r["batch"] * r["context"], r["batch"], r["ms_per_step"] / 1e3)
                     for r in results["decode"].values()]
    return PhaseProfile(model=results["model"], threads=threads, prefill=fit_step(prefill_points),
                        decode=fit_step(decode_points), kv_bytes_per_token=results["kv_bytes_per_token"], note=note,
                        prefill_compute=results.get("prefill_compute", "float32"),
                        tensor_parallel_size=results.get("tensor_parallel_size", 1), cpus=results.get("cpus", 0),
                        points={"prefill": prefill_points, "decode": decode_points})
