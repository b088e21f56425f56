"""A prompt position's bits do not depend on how its prompt was chunked, what shared its step, or how many threads ran
it: the same prompt chunked [n], [n - 1, 1], [1, n - 1] and [128, rest], batched beside 0, 1 and 7 other prompts, and
run at 1 and 2 threads gives identical K/V blocks and logits, in float32 and in bf16 on every bf16 ISA this CPU runs
(and AMX's tiling, emulated). The contract holds by construction (one tiling, one summation order per output:
csrc/bf16_tiles.h), so these tests, passing here, check the structure that every CPU class runs.

The checks can fail: with the products replaced by one whose summation follows its rows and threads (a split-K
product, as oneDNN's kernel choice by shape and thread count made on AMX CPUs), every one of them does
(``test_each_check_fails_for_a_product_whose_sums_follow_its_rows_and_threads``).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels.bf16_kernels import Bf16Kernels, padded_inputs
from splitserve.engine.kernels.cpu_features import bf16_isas
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.model.bf16_prefill import Bf16Prefill
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.weights.model_files import tiny_random_config
from splitserve.engine.weights.parameter_layout import random_state_dict

BLOCK = 16
# SmolLM2's layer shapes, two layers; the AMX emulation (scalar tiles) runs the tiny model's.
SMOLLM2_SHAPES = ModelConfig(vocab_size=1000, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9,
                             num_kv_heads=3, max_position_embeddings=1024)
N = 300  # prompt tokens
OTHERS = [37, 5, 130, 1, 64, 17, 90]  # the prompts batched beside it (the 1-token one: a one-row prefill)
SETUPS = ["float32", *(f"bfloat16/{isa}" for isa in bf16_isas()), "bfloat16/amx-emulated"]


@functools.cache
def _model(setup: str) -> LlamaForCausalLM:
    fmt, _, isa = setup.partition("/")
    config = tiny_random_config() if isa == "amx-emulated" else SMOLLM2_SHAPES
    state = random_state_dict(config, 0)
    model = LlamaForCausalLM.from_state_dict(config, state, prefill_compute_dtype="float32")
    if fmt == "bfloat16":
        if model.kernels is None:
            pytest.skip(f"the native kernels do not run here: {model.compute_path.reason}")
        model.bf16_prefill = Bf16Prefill.from_state_dict(config, state, Bf16Kernels(model.kernels, isa))
    return model


@pytest.fixture(params=SETUPS)
def model(request) -> LlamaForCausalLM:
    return _model(request.param)


def _tokens(model: LlamaForCausalLM, n: int, seed: int) -> torch.Tensor:
    return torch.randint(5, model.config.vocab_size - 5, (n,), generator=torch.Generator().manual_seed(seed))


class Run:
    """The prompt's (first sequence's) rows of one run: hidden states [n, H], logits [n, V], and per layer its K and V
    as the cache holds them."""

    def __init__(self, model: LlamaForCausalLM, hidden: torch.Tensor, cache: PagedKVCache, n: int):
        self.hidden, self.logits = hidden, model.compute_logits(hidden)
        blocks = slice(0, -(-n // BLOCK))
        self.kv = [c[blocks].flatten(0, 1)[:n].clone() for c in cache.k_blocks + cache.v_blocks]

    def check_equal(self, other: Run) -> None:
        assert torch.equal(self.hidden, other.hidden), "hidden states differ"
        assert torch.equal(self.logits, other.logits), "logits differ"
        assert all(torch.equal(a, b) for a, b in zip(self.kv, other.kv)), "K/V differ"


def run_steps(model: LlamaForCausalLM, steps: list[list[torch.Tensor]], starts: list[list[int]],
              pool: str = "float16") -> Run:
    """Runs steps of prompt chunks on a fresh cache of ``pool`` rows: step s holds chunk ``steps[s][i]`` of prompt i,
    at positions from ``starts[s][i]``; prompt i's blocks are its own. The first prompt's rows of every step, in
    order, make the run."""
    per_prompt = -(-N // BLOCK)
    cache = PagedKVCache(model.config, per_prompt * len(steps[0]), BLOCK, pool)
    tables = [list(range(per_prompt * i, per_prompt * (i + 1))) for i in range(len(steps[0]))]
    hidden = []
    for chunks, begins in zip(steps, starts):
        lens = [len(c) for c in chunks]
        meta = AttentionMetadata.build(lens, [b + n for b, n in zip(begins, lens)], tables, BLOCK,
                                       one_row_prefills=frozenset(i for i, n in enumerate(lens) if n == 1))
        positions = torch.cat([torch.arange(b, b + n) for b, n in zip(begins, lens)])
        hidden.append(model(torch.cat(chunks), positions, cache, meta)[: lens[0]])
    return Run(model, torch.cat(hidden), cache, sum(len(s[0]) for s in steps))


def alone(model: LlamaForCausalLM, prompt: torch.Tensor, pool: str = "float16") -> Run:
    return run_steps(model, [[prompt]], [[0]], pool)


def chunked(model: LlamaForCausalLM, prompt: torch.Tensor, sizes: list[int], pool: str = "float16") -> Run:
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    return run_steps(model, [[prompt[a:b]] for a, b in zip(bounds, bounds[1:])], [[a] for a in bounds[:-1]], pool)


def beside(model: LlamaForCausalLM, prompt: torch.Tensor, others: list[int]) -> Run:
    chunks = [prompt, *(_tokens(model, n, 100 + i) for i, n in enumerate(others))]
    return run_steps(model, [chunks], [[0] * len(chunks)])


def at_threads(threads: int, run, *args) -> Run:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run(*args)
    finally:
        torch.set_num_threads(before)


CHUNKINGS = {"n-1,1": [N - 1, 1], "1,n-1": [1, N - 1], "128,rest": [128, N - 128]}


@pytest.mark.parametrize("pool", ["float16", "int8"])
@pytest.mark.parametrize("chunks", CHUNKINGS)
def test_the_same_bits_however_the_prompt_is_chunked(model, chunks, pool):
    prompt = _tokens(model, N, 0)
    chunked(model, prompt, CHUNKINGS[chunks], pool).check_equal(alone(model, prompt, pool))


@pytest.mark.parametrize("others", [1, 7])  # beside 0: alone, the reference
def test_the_same_bits_whatever_is_batched_beside_it(model, others):
    prompt = _tokens(model, N, 1)
    beside(model, prompt, OTHERS[:others]).check_equal(alone(model, prompt))


def test_the_same_bits_at_one_and_two_threads(model):
    prompt = _tokens(model, N, 2)
    at_threads(1, alone, model, prompt).check_equal(at_threads(2, alone, model, prompt))


def test_bf16_prefill_computes_in_bf16_on_the_isa_asked():
    """The bf16 setups are not float32 in disguise: each ISA's answer differs from float32's, and the AMX
    emulation's from the avx512_bf16/AVX2 arithmetic (its tiles sum 32 inputs their own way)."""
    prompt = _tokens(_model("float32"), N, 3)
    f32 = alone(_model("float32"), prompt)
    for isa in bf16_isas():
        assert not torch.equal(alone(_model(f"bfloat16/{isa}"), prompt).logits, f32.logits), isa
        assert _model(f"bfloat16/{isa}").bf16_prefill.kernels.isa == isa


# ---- the checks can fail ----------------------------------------------------------------------------------------


def _split_k_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ weight^T in float32, the inputs summed in parts whose count follows the rows and the threads:
    the tiling of a library that picks its kernel by shape and thread count."""
    parts = 1 + len(x) % 3 + torch.get_num_threads()
    bounds = torch.linspace(0, x.shape[1], parts + 1).long().tolist()
    return sum(F.linear(x[:, a:b].float(), weight[:, a:b].float()) for a, b in zip(bounds, bounds[1:]))


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """bf16_kernels.pack's inverse: [out (padded to 16), kp]."""
    panels, pairs, panel, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * panel, pairs * 2)


class SplitKLayer:
    """A bf16 layer (engine/model/bf16_prefill.py's Bf16Layer) whose products are ``_split_k_product``: its attention
    is the real kernels', the rest the same steps in torch."""

    def __init__(self, layer, model: LlamaForCausalLM):
        self.layer, self.model = layer, model

    def __call__(self, x, rotary, k_cache, v_cache, meta):
        layer, cfg = self.layer, self.model.config
        t, q_size, kv_size = len(x), layer.q_size, cfg.num_kv_heads * cfg.head_dim

        def norm(v, weight):
            return F.rms_norm(v, weight.shape, weight, cfg.rms_norm_eps).bfloat16()

        def product(v, packed, out):
            return _split_k_product(F.pad(v, (0, packed.shape[1] * 2 - v.shape[1])), _unpack(packed))[:, :out]

        qkv = product(norm(x, layer.input_norm), layer.qkv, q_size + 2 * kv_size)
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias
        qk = rotary.apply(qkv[:, : q_size + kv_size].view(t, -1, cfg.head_dim))  # [T, Hq + Hkv, D]
        q, k = qk[:, : cfg.num_heads].contiguous(), qk[:, cfg.num_heads :]
        k_cache.flatten(0, 1)[meta.slot_mapping] = k.to(k_cache.dtype)
        v_cache.flatten(0, 1)[meta.slot_mapping] = qkv[:, q_size + kv_size :].view(t, -1, cfg.head_dim).to(
            v_cache.dtype)
        attn = torch.zeros(t, padded_inputs(q_size), dtype=torch.bfloat16)
        for seg in meta.prefills:
            rows = slice(seg.start, seg.end)
            layer.kernels.prefill_attention(q[rows], k_cache, v_cache, seg.blocks, seg.prefix, cfg.head_dim**-0.5,
                                            attn[rows])
        x += product(attn, layer.o, cfg.hidden_size)
        gate_up = product(norm(x, layer.post_attn_norm), layer.gate_up, layer.gate_up.shape[0] * 16)
        gate, up = gate_up.view(t, -1, 2, 16).unbind(2)  # panels interleave gate and up
        act = (F.silu(gate) * up).reshape(t, -1)[:, : cfg.intermediate_size].bfloat16()
        x += product(act, layer.down, cfg.hidden_size)
        return x


def test_each_check_fails_for_a_product_whose_sums_follow_its_rows_and_threads(monkeypatch):
    model = _model(f"bfloat16/{bf16_isas()[0]}")
    prompt = _tokens(model, N, 4)
    kernels_run = alone(model, prompt)
    split_k_layers = [SplitKLayer(layer, model) for layer in model.bf16_prefill.layers]
    monkeypatch.setattr(model.bf16_prefill, "layers", split_k_layers)
    split_k_run = alone(model, prompt)  # the same bf16 prefill, summed otherwise: close, not equal
    assert not torch.equal(split_k_run.logits, kernels_run.logits)
    assert torch.allclose(split_k_run.logits, kernels_run.logits, atol=0.02 * kernels_run.logits.abs().max().item())
    checks = [*(functools.partial(test_the_same_bits_however_the_prompt_is_chunked, model, c, "float16")
                for c in CHUNKINGS),
              *(functools.partial(test_the_same_bits_whatever_is_batched_beside_it, model, o) for o in (1, 7)),
              functools.partial(test_the_same_bits_at_one_and_two_threads, model)]
    for check in checks:
        with pytest.raises(AssertionError, match="differ"):
            check()
