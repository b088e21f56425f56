"""The bf16 prefill's kernels (engine/kernels/bf16_kernels.py, csrc/bf16_tiles.h): each ISA's products against a
float64 reference of the same bf16 operands, a row's bits alone, in any batch and at any thread count, the AVX2 path's
bits equal to avx512_bf16's, the weights' packing, the ISA each CPU feature set gets, and the prefill attention
against dense causal attention. The model-level contract (chunks, batches, threads: identical K/V and logits) is
tests/test_prefill_invariance.py's.

The ISAs tested are those this CPU runs, and always AMX's tiling with emulated tiles (``amx-emulated``), so that a
CPU without AMX checks the AMX path's tiles, padding and remainders; the cases only an AMX CPU can exercise carry
``@pytest.mark.amx``.
"""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.kernels import bf16_kernels
from splitserve.engine.kernels.bf16_kernels import BF16_ISAS, Bf16Kernels, pack, pack_gate_up
from splitserve.engine.kernels.build import KernelsUnavailable
from splitserve.engine.kernels.cpu_features import bf16_isas
from tests.test_prefill_compute_format import AMX, AVX2_ONLY, AVX512_BF16, AVX512_NO_BF16

RUNNABLE = [*bf16_isas(), "amx-emulated"]
SHAPES = [(37, 576, 960), (5, 100, 37), (70, 1536, 576), (1, 64, 16)]  # rows, in, out: odd sizes pad


@pytest.fixture(scope="module", params=RUNNABLE)
def kernels(request, native_kernels) -> Bf16Kernels:
    return Bf16Kernels(native_kernels, request.param)


def _operands(rows: int, inputs: int, outputs: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=g).bfloat16()
    weight = torch.randn(outputs, inputs, generator=g)
    return x, weight, torch.randn(outputs, generator=g)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_product_is_its_bf16_operands_product_summed_in_float32(kernels, shape):
    x, weight, bias = _operands(*shape)
    y = kernels.linear(x, pack(weight), shape[2], bias)
    reference = x.double() @ weight.bfloat16().double().T + bias.double()
    assert y.dtype == torch.float32 and y.shape == reference.shape
    # float32 sums of `in` exact products of N(0, 1) values: rounding errors of a random walk of sums ~sqrt(in)
    assert torch.allclose(y.double(), reference, rtol=0, atol=2e-5 * shape[1] ** 0.5)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_a_row_has_the_same_bits_alone_in_any_batch_and_at_any_thread_count(kernels, shape):
    x, weight, bias = _operands(*shape)
    packed = pack(weight)
    whole = kernels.linear(x, packed, shape[2], bias)
    for a, b in [(0, 1), (3, 4), (1, shape[0]), (2, shape[0] - 1)]:
        assert torch.equal(kernels.linear(x[a:b], packed, shape[2], bias), whole[a:b]), (a, b)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            assert torch.equal(kernels.linear(x, packed, shape[2], bias), whole), threads
    finally:
        torch.set_num_threads(before)


def test_the_avx2_path_gets_the_avx512_bf16_bits(native_kernels):
    """vdpbf16ps adds each pair's odd product, then its even one, rounding each sum (Intel's definition, which Zen 4
    follows bit for bit): two fused multiply-adds per pair on AVX2 give the same float32 sums."""
    if "avx512_bf16" not in bf16_isas():
        pytest.skip("needs a CPU with avx512_bf16 to compare against")
    fma, avx512 = Bf16Kernels(native_kernels, "fma"), Bf16Kernels(native_kernels, "avx512_bf16")
    for shape in SHAPES:
        x, weight, bias = _operands(*shape, seed=1)
        packed = pack(weight)
        assert torch.equal(fma.linear(x, packed, shape[2], bias), avx512.linear(x, packed, shape[2], bias)), shape


def test_the_packed_layout_pairs_inputs_per_panel_and_interleaves_gate_and_up():
    weight = torch.randn(40, 70)
    packed = pack(weight)
    assert packed.shape == (3, 48, 16, 2) and packed.dtype == torch.bfloat16  # 40 -> 3 panels, 70 -> 96 inputs
    expected = torch.zeros(48, 96)
    expected[:40, :70] = weight
    for p, j, o, e in [(0, 0, 0, 0), (0, 0, 0, 1), (1, 5, 3, 1), (2, 34, 7, 0), (2, 47, 15, 1)]:
        assert packed[p, j, o, e] == expected[16 * p + o, 2 * j + e].bfloat16()
    fused = torch.randn(64, 96)  # gate rows 0..31, up rows 32..63: two panels each
    interleaved = pack_gate_up(fused)
    gate, up = pack(fused[:32]), pack(fused[32:])
    assert torch.equal(interleaved, torch.stack([gate[0], up[0], gate[1], up[1]]))


@pytest.mark.parametrize(("flags", "expected"), [
    (AVX2_ONLY, ("fma",)),
    (AVX512_NO_BF16, ("fma",)),
    (AVX512_BF16, ("avx512_bf16", "fma")),
    (AMX, ("amx", "avx512_bf16", "fma")),
    (set(), ()),
])
def test_each_cpu_feature_set_gets_its_isas_best_first(flags, expected):
    assert bf16_isas(flags) == expected


def test_an_isa_the_cpu_refuses_gives_way_to_the_next(native_kernels):
    """Told the CPU has AMX (flags as tests feed them), the engine takes the first ISA the library confirms: on a CPU
    without AMX, or where Linux refuses the tiles, the next one; unknown or unrunnable ISAs are refused by name."""
    first_runnable = bf16_isas()[0]
    assert bf16_kernels.choose(native_kernels, AMX).isa == first_runnable
    for isa in set(BF16_ISAS) - set(RUNNABLE):
        with pytest.raises(KernelsUnavailable, match=f"bf16 products on {isa} do not run on this CPU"):
            Bf16Kernels(native_kernels, isa)
    with pytest.raises(ValueError, match="bf16 ISA must be one of"):
        Bf16Kernels(native_kernels, "avx10")
    with pytest.raises(KernelsUnavailable, match="no ISA for bf16 products"):
        bf16_kernels.choose(native_kernels, set())


@pytest.mark.parametrize(("prefix", "n"), [(0, 45), (21, 12), (33, 1), (0, 1)])
def test_the_prefill_attention_is_causal_attention_of_the_bf16_operands(kernels, prefix, n):
    from tests.test_attention import _dense_reference

    num_heads, num_kv_heads, head_dim, block = 6, 2, 40, 8  # head_dim 40: padded to 64 inputs
    g = torch.Generator().manual_seed(prefix + n)
    keys, values = (torch.randn(prefix + n, num_kv_heads, head_dim, generator=g).half() for _ in range(2))
    q = torch.randn(n, num_heads, head_dim, generator=g)
    blocks = torch.randperm(12, generator=g)[: -(-(prefix + n) // block)]
    k_cache, v_cache = (torch.zeros(12, block, num_kv_heads, head_dim, dtype=torch.float16) for _ in range(2))
    slots = torch.stack([blocks[j // block] * block + j % block for j in range(prefix + n)])
    k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots] = keys, values
    out = torch.full((n, num_heads * head_dim + 16), 7.0, dtype=torch.bfloat16)  # a wider row: the rest untouched
    kernels.prefill_attention(q, k_cache, v_cache, blocks, prefix, head_dim**-0.5, out)
    reference = _dense_reference(q.bfloat16(), keys.bfloat16(), values.bfloat16(), prefix, head_dim**-0.5)
    got = out[:, : num_heads * head_dim].view(n, num_heads, head_dim).double()
    assert torch.allclose(got, reference, atol=0.02), (got - reference).abs().max()  # bf16 weights and outputs
    assert torch.all(out[:, num_heads * head_dim :] == 7.0)


@pytest.mark.amx
def test_amx_tiles_compute_what_the_emulated_tiles_do(native_kernels):
    """The hardware's tiles against their emulation (Intel's pseudo-code): the same tiling, padding and remainders;
    the sums may round apart (the hardware's own summation order), so close, not equal."""
    amx, emulated = Bf16Kernels(native_kernels, "amx"), Bf16Kernels(native_kernels, "amx-emulated")
    for shape in SHAPES:
        x, weight, bias = _operands(*shape, seed=2)
        packed = pack(weight)
        assert torch.allclose(amx.linear(x, packed, shape[2], bias), emulated.linear(x, packed, shape[2], bias),
                              rtol=1e-5, atol=1e-4), shape
