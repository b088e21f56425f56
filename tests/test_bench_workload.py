"""What ``bench serve`` sends and when: arrival processes (rate and burstiness of generated schedules, over many
samples with fixed seeds), synthetic Azure-shaped lengths (the published quantiles), trace parsing, replay with time
scaling and caps, and prompts of exact token length.
"""

from __future__ import annotations

import math
import statistics

import pytest

from splitserve.bench.serve.prompts import PromptFactory, ordinary_token_ids
from splitserve.engine.text.tokenizer_files import load_tokenizer
from splitserve.measure.workload import (
    AZURE_CODE,
    AZURE_CONV,
    AZURE_LENGTHS,
    LengthDistribution,
    RequestSpec,
    WorkloadConfig,
    arrival_times,
    build_workload,
    read_trace,
)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


# ------------------------------------------------------------------------------------------- arrivals


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_have_the_asked_rate_and_the_gamma_coefficient_of_variation(burstiness):
    times = arrival_times(40_000, rate=5.0, burstiness=burstiness, seed=7)
    assert times[0] == 0.0 and times == sorted(times)
    g = gaps(times)
    assert len(g) / times[-1] == pytest.approx(5.0, rel=0.03)
    # Poisson: exponential gaps, CV 1; gamma with shape b: CV 1 / sqrt(b) (2 for 0.25: burstier; 0.5 for 4).
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_are_seeded_and_scale_with_the_rate():
    assert arrival_times(100, 2.0, 1.0, seed=1) == arrival_times(100, 2.0, 1.0, seed=1)
    assert arrival_times(100, 2.0, 1.0, seed=1) != arrival_times(100, 2.0, 1.0, seed=2)
    # Every rate of a sweep gets the same schedule, compressed: the gaps are unit-rate draws divided by the rate.
    slow, fast = arrival_times(50, 1.0, 0.5, seed=3), arrival_times(50, 4.0, 0.5, seed=3)
    assert fast == pytest.approx([t / 4 for t in slow])
    assert arrival_times(5, math.inf) == [0.0] * 5


# ------------------------------------------------------------------------------------- synthetic lengths


def test_random_workload_lengths_are_exact_or_spread_within_the_range_and_capped():
    fixed = build_workload(WorkloadConfig(num_prompts=20, input_len=64, output_len=8))
    assert [(s.index, s.prompt_len, s.output_len, s.arrival_s) for s in fixed] == [(i, 64, 8, 0.0) for i in range(20)]
    spread = build_workload(WorkloadConfig(num_prompts=500, input_len=100, output_len=40, range_ratio=0.5, seed=1))
    assert {s.prompt_len for s in spread} <= set(range(50, 151))
    assert {s.output_len for s in spread} <= set(range(20, 61))
    assert len({s.prompt_len for s in spread}) > 50  # spread, not a constant
    capped = build_workload(WorkloadConfig(num_prompts=500, input_len=100, output_len=40, range_ratio=0.5, seed=1,
                                           max_prompt_tokens=80, max_output_tokens=30))
    assert [min(s.prompt_len, 80) for s in spread] == [s.prompt_len for s in capped]
    assert [min(s.output_len, 30) for s in spread] == [s.output_len for s in capped]
    assert build_workload(WorkloadConfig(num_prompts=500, input_len=100, output_len=40, range_ratio=0.5, seed=1)) \
        == spread


def test_length_distribution_passes_through_its_three_quantiles():
    dist = LengthDistribution(1020, 2734, 4142)
    assert dist.quantile(0.5) == 1020 and dist.quantile(0.9) == 2734 and dist.quantile(0.99) == 4142
    assert dist.quantile(0.1) == round(1020 ** 2 / 2734)  # lognormal below the median: p10 * p90 = median^2
    assert LengthDistribution(10, 20, 30, maximum=25).quantile(0.999) == 25
    assert LengthDistribution(10, 20, 30, minimum=5).quantile(1e-9) == 5


@pytest.mark.parametrize("name", sorted(AZURE_LENGTHS))
def test_azure_shaped_workloads_reproduce_the_published_quantiles(name):
    published = {"azure-conv": ((1020, 2734, 4142), (129, 424, 601)),
                 "azure-code": ((1469, 5186, 7436), (13, 55, 249))}[name]
    specs = build_workload(WorkloadConfig(workload=name, num_prompts=20_000, seed=5))
    for lengths, quantiles in (([s.prompt_len for s in specs], published[0]),
                               ([s.output_len for s in specs], published[1])):
        ordered = sorted(lengths)
        for q, expected in zip((0.5, 0.9, 0.99), quantiles):
            assert ordered[int(q * len(ordered))] == pytest.approx(expected, rel=0.06), (q, expected)


# ---------------------------------------------------------------------------------------------- traces

AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
2023-11-16 18:15:56.0000000,4000,700
"""


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(AZURE_CSV)
    return str(path)


def test_read_trace_parses_the_azure_format(trace, tmp_path):
    rows = read_trace(trace)
    assert [(r.prompt_tokens, r.output_tokens) for r in rows] == [(374, 44), (396, 109), (879, 55), (91, 16),
                                                                  (4000, 700)]
    assert [r.timestamp_s - rows[0].timestamp_s for r in rows] == pytest.approx(
        [0.0, 4.314579, 4.541877, 4.710427, 9.31941], abs=1e-6)
    numeric = tmp_path / "numeric.csv"
    numeric.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2.5,10,3\n0.5,20,4\n")
    assert [(r.timestamp_s, r.prompt_tokens) for r in read_trace(numeric)] == [(0.5, 20), (2.5, 10)]  # time order
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt,output\n1,2,3\n")
    with pytest.raises(ValueError, match="ContextTokens"):
        read_trace(bad)
    broken = tmp_path / "broken.csv"
    broken.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,many,3\n")
    with pytest.raises(ValueError, match="line 2"):
        read_trace(broken)


@pytest.mark.parametrize("path, rows, prompt, output", [
    (AZURE_CONV, 19366, (1020, 2734, 4142), (129, 424, 601)),
    (AZURE_CODE, 8819, (1469, 5186, 7436), (13, 55, 249)),
])
def test_the_shipped_azure_traces_hold_their_published_rows_and_quantiles(path, rows, prompt, output):
    """The package's own copies (measure/traces/), read with nothing beside the checkout: the rows and the
    median / p90 / p99 that their README (and the trace's publishers) state."""
    trace = read_trace(path)
    assert len(trace) == rows
    for lengths, published in (([r.prompt_tokens for r in trace], prompt), ([r.output_tokens for r in trace], output)):
        ordered = sorted(lengths)
        assert [ordered[int(q * (len(ordered) - 1))] for q in (0.5, 0.9, 0.99)] == list(published)


def test_trace_replay_scales_time_caps_lengths_and_takes_the_first_rows(trace):
    specs = build_workload(WorkloadConfig(workload=trace, num_prompts=4, time_scale=10.0, max_prompt_tokens=512,
                                          max_output_tokens=100))
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 43.14579, 45.41877, 47.10427])
    assert [(s.prompt_len, s.output_len) for s in specs] == [(374, 44), (396, 100), (512, 55), (91, 16)]
    # With a request rate, the trace gives the lengths and the arrival process the times.
    poisson = build_workload(WorkloadConfig(workload=trace, num_prompts=5, request_rate=2.0, seed=4))
    assert [s.arrival_s for s in poisson] == arrival_times(5, 2.0, 1.0, seed=4)
    assert [s.prompt_len for s in poisson] == [374, 396, 879, 91, 4000]


@pytest.mark.parametrize("bad", [dict(workload="sharegpt"), dict(num_prompts=0), dict(request_rate=0),
                                 dict(burstiness=0), dict(range_ratio=1.0), dict(time_scale=0),
                                 dict(max_prompt_tokens=0)])
def test_workload_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        WorkloadConfig(**bad)


# ---------------------------------------------------------------------------------------------- prompts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random")  # ChatML control tokens, then one token per byte


def test_prompts_have_the_exact_length_from_ordinary_tokens_and_differ_per_request(tokenizer):
    vocabulary = set(ordinary_token_ids(tokenizer))
    assert not vocabulary & {0, 1, 2}  # <|endoftext|>, <|im_start|>, <|im_end|>
    factory = PromptFactory(tokenizer, seed=0)
    specs = [RequestSpec(i, 0.0, n, 1) for i, n in enumerate([1, 17, 300, 300])]
    prompts = [factory.token_ids(s) for s in specs]
    assert [len(p) for p in prompts] == [1, 17, 300, 300]
    assert all(set(p) <= vocabulary for p in prompts)
    assert prompts[2][:16] != prompts[3][:16]  # no shared first block: no accidental prefix-cache hit
    assert PromptFactory(tokenizer, seed=0).token_ids(specs[2]) == prompts[2]  # seeded
    assert PromptFactory(tokenizer, seed=1).token_ids(specs[2]) != prompts[2]


def test_shared_prefix_is_common_to_every_prompt(tokenizer):
    factory = PromptFactory(tokenizer, seed=0, shared_prefix=32)
    a, b = (factory.token_ids(RequestSpec(i, 0.0, 100, 1)) for i in (0, 1))
    assert a[:32] == b[:32] and a[32:] != b[32:] and len(a) == len(b) == 100
    assert factory.token_ids(RequestSpec(2, 0.0, 10, 1)) == a[:10]  # shorter than the prefix: its start


def test_text_prompts_encode_to_the_asked_length(tokenizer):
    factory = PromptFactory(tokenizer, seed=0)
    for i, n in enumerate([1, 5, 64, 333]):
        text = factory.text(RequestSpec(i, 0.0, n, 1))
        assert isinstance(text, str) and len(tokenizer.encode(text)) == n


def test_each_run_of_a_sweep_draws_its_own_prompts_of_the_same_lengths():
    """A sweep sends the same lengths at every rate; were the ids the same too, every run after the first would hit
    the prefix cache the first filled (found in a sweep whose TTFT fell 8x from its first rate to its second)."""
    factory = PromptFactory(load_tokenizer("tiny-random"), seed=3)
    spec = RequestSpec(0, 0.0, 40, 8)
    first, second = factory.token_ids(spec, run=1), factory.token_ids(spec, run=2)
    assert len(first) == len(second) == 40
    assert first[:16] != second[:16]  # not one shared cache block
    assert factory.token_ids(spec, run=1) == first  # seeded: a run can be repeated
