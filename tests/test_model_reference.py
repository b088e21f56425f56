"""``LlamaForCausalLM`` over the paged cache against Hugging Face ``transformers`` (eager attention), in float32.

Tiny random-weight HF models (GQA Llama with tied and untied embeddings, Llama-3 rope scaling, Qwen2 with QKV
bias) run each sequence whole; our model runs the same tokens as an engine would: varlen prefill batches,
step-by-step decode through shuffled blocks of 4 slots, chunked prefill, and mixed prefill + decode steps.
Every logit we compute must be within 1e-4 of HF's at the same position, on both of our CPU paths: the native
kernels (packed weights, in-place paged decode attention) and plain PyTorch ops.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from splitserve.engine.config import ModelConfig
from splitserve.engine.kernels import cpu_kernels
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.model import llama as model_module
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.model.layers import Linear
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.weights.hf_checkpoint import fuse_hf_state_dict
from splitserve.engine.weights.parameter_layout import parameter_shapes, random_state_dict

BLOCK_SIZE = 4
NUM_BLOCKS = 64
TOLERANCE = 1e-4
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-6, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
VARIANTS = {
    "llama_gqa_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                       dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "llama3_rope_untied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                           dict(num_hidden_layers=3, tie_word_embeddings=False, rope_theta=500000.0,
                                rope_scaling=LLAMA3_ROPE)),
    "qwen2_qkv_bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                       dict(num_hidden_layers=2, tie_word_embeddings=False, rope_theta=1000000.0)),
}


def _hf_model(variant: str):
    config_cls, model_cls, extra = VARIANTS[variant]
    hf = model_cls(config_cls(**SIZES, **extra, attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger than HF's init so that logits and attention patterns are far from uniform
        for name, p in hf.named_parameters():
            noise = 0.05 if name.endswith("bias") else 0.1
            centre = 1.0 if "norm" in name else 0.0  # norm weights around 1, so a wrong mapping still shows
            p.copy_(torch.randn(p.shape, generator=gen) * noise + centre)
    return hf


def _our_config(variant: str) -> ModelConfig:
    _, _, extra = VARIANTS[variant]
    return ModelConfig(
        vocab_size=SIZES["vocab_size"], hidden_size=SIZES["hidden_size"], intermediate_size=SIZES["intermediate_size"],
        num_layers=extra["num_hidden_layers"], num_heads=SIZES["num_attention_heads"],
        num_kv_heads=SIZES["num_key_value_heads"], rms_norm_eps=SIZES["rms_norm_eps"],
        rope_theta=extra.get("rope_theta", 10000.0), rope_scaling=extra.get("rope_scaling"),
        max_position_embeddings=SIZES["max_position_embeddings"],
        tie_word_embeddings=extra["tie_word_embeddings"], qkv_bias=variant.startswith("qwen2"),
    )


class _Engine:
    """Just enough of an engine to drive the model: sequences of known tokens, shuffled blocks, one step at a time."""

    def __init__(self, variant: str, cpu_kernels: bool = True):
        self.hf = _hf_model(variant)
        config = _our_config(variant)
        self.model = LlamaForCausalLM.from_state_dict(config, fuse_hf_state_dict(self.hf.state_dict(), config),
                                                      cpu_kernels=cpu_kernels)
        self.cache = PagedKVCache(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
        self.free_blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    @torch.inference_mode()
    def step(self, work: list[tuple[list[int], int]]) -> list[torch.Tensor]:
        """work: (sequence's tokens, new tokens to run) per sequence -> logits [new tokens, V] per sequence."""
        ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for tokens, n in work:
            key = id(tokens)
            start = self.computed.get(key, 0)
            table = self.tables.setdefault(key, [])
            while len(table) * BLOCK_SIZE < start + n:
                table.append(self.free_blocks.pop())
            ids += tokens[start : start + n]
            positions += range(start, start + n)
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            self.computed[key] = start + n
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.cache, meta)
        return list(self.model.compute_logits(hidden).split(query_lens))

    @torch.inference_mode()
    def reference(self, tokens: list[int]) -> torch.Tensor:
        """HF logits at every position of the whole sequence, [len(tokens), V]."""
        return self.hf(torch.tensor([tokens])).logits[0].float()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, SIZES["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape and ours.dtype == torch.float32
    assert reference.std() > 0.3  # a real signal, so that 1e-4 is a tight bound
    assert (ours - reference).abs().max().item() <= TOLERANCE


@pytest.fixture(params=[(v, path) for v in VARIANTS for path in ("native", "torch")], ids="-".join)
def engine(request) -> _Engine:
    variant, path = request.param
    if path == "native":
        request.getfixturevalue("native_kernels")  # built, or the reason they cannot be
    engine = _Engine(variant, cpu_kernels=path == "native")
    assert (engine.model.kernels is not None) == (path == "native")
    return engine


def test_varlen_prefill_batch(engine):
    prompts = [_tokens(7, 1), _tokens(30, 2), _tokens(3, 3)]
    logits = engine.step([(p, len(p)) for p in prompts])
    for prompt, ours in zip(prompts, logits):
        _assert_close(ours, engine.reference(prompt))


def test_decode_step_by_step_through_scattered_blocks(engine):
    # Two sequences of different lengths decode together (key-padding mask), spanning several blocks each.
    seqs = [_tokens(5, 4) + _tokens(10, 5), _tokens(2, 6) + _tokens(10, 7)]
    refs = [engine.reference(s) for s in seqs]
    engine.step([(seqs[0], 5), (seqs[1], 2)])
    for step in range(10):
        logits = engine.step([(seqs[0], 1), (seqs[1], 1)])
        _assert_close(logits[0][0], refs[0][5 + step])
        _assert_close(logits[1][0], refs[1][2 + step])


def test_chunked_prefill_then_decode(engine):
    seq = _tokens(16, 8)
    ref = engine.reference(seq)
    position = 0
    for n in (5, 6, 2, 1, 1, 1):  # chunks end mid-block; the last three are decode steps
        (ours,) = engine.step([(seq, n)])
        _assert_close(ours, ref[position : position + n])
        position += n


def test_mixed_step_decodes_and_prefills_together(engine):
    decoding, fresh, chunked = _tokens(10, 9), _tokens(6, 10), _tokens(12, 11)
    engine.step([(decoding, 9), (chunked, 5)])
    # One step: a fresh prompt, a decode, and the rest of a chunked prefill (cached prefix of 5).
    out_fresh, out_decode, out_chunk = engine.step([(fresh, 6), (decoding, 1), (chunked, 7)])
    _assert_close(out_fresh, engine.reference(fresh))
    _assert_close(out_decode, engine.reference(decoding)[9:])
    _assert_close(out_chunk, engine.reference(chunked)[5:])


def test_layer_done_called_once_per_layer_in_order():
    engine = _Engine("llama3_rope_untied")
    seen: list[int] = []
    prompt = _tokens(4, 12)
    ids, positions = torch.tensor(prompt), torch.arange(4)
    meta = AttentionMetadata.build([4], [4], [[0]], BLOCK_SIZE)
    with torch.inference_mode():
        engine.model(ids, positions, engine.cache, meta, layer_done=seen.append)
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("tied", [True, False])
def test_random_state_dict_matches_the_model_and_is_seeded(tied):
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                         num_kv_heads=2, tie_word_embeddings=tied, qkv_bias=True)
    state = random_state_dict(config, seed=3)
    model = LlamaForCausalLM.from_state_dict(config, state)  # strict: names and shapes agree
    assert set(model.state_dict()) == set(state) == set(parameter_shapes(config))
    assert ("lm_head.weight" in state) is not tied
    assert state["layers.1.attn.qkv_proj.weight"].shape == (32, 16)  # (4 + 2 * 2) heads of 4
    assert torch.equal(state["norm.weight"], torch.ones(16))
    assert 0.015 < state["layers.0.mlp.gate_up_proj.weight"].std().item() < 0.025
    again = random_state_dict(config, seed=3)
    assert all(torch.equal(state[k], again[k]) for k in state)
    assert not torch.equal(random_state_dict(config, seed=4)["embed_tokens.weight"], state["embed_tokens.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_compute_stays_within_its_rounding(dtype):
    engine = _Engine("llama_gqa_tied")
    config = engine.model.config
    low = LlamaForCausalLM.from_state_dict(config, engine.model.state_dict(), dtype)
    cache = PagedKVCache(config, NUM_BLOCKS, BLOCK_SIZE, dtype)
    prompt = _tokens(9, 13)
    meta = AttentionMetadata.build([9], [9], [[5, 2, 9]], BLOCK_SIZE)
    with torch.inference_mode():
        logits = low.compute_logits(low(torch.tensor(prompt), torch.arange(9), cache, meta))
    assert logits.dtype == torch.float32
    # bfloat16 keeps 8 significant bits (float16: 11); logits are O(1) after two layers of such rounding.
    bound = 0.1 if dtype == torch.bfloat16 else 0.02
    assert (logits - engine.reference(prompt)).abs().max().item() <= bound


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 25, 32, 33])
@pytest.mark.parametrize("out_features", [16, 36, 64, 100])
def test_native_linear_is_f_linear(rows, out_features, native_kernels):
    # Tiles of 6 rows x 1 panel (AVX2) or 12 rows x 2 panels (AVX-512) of 16 outputs: row counts around a tile,
    # outputs that fill the last panel or not, an odd or even number of panels.
    gen = torch.Generator().manual_seed(rows * 100 + out_features)
    x, weight, bias = (torch.randn(shape, generator=gen) for shape in ((rows, 48), (out_features, 48), (out_features,)))
    for with_bias in (True, False):
        layer = Linear(48, out_features, with_bias, torch.float32, torch.device("cpu"), native_kernels)
        layer.load_state_dict({"weight": weight, "bias": bias} if with_bias else {"weight": weight})
        expected = torch.nn.functional.linear(x, weight, bias if with_bias else None)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-5)
        # A row's result does not depend on the rows around it: the same bits alone as in the batch.
        assert torch.equal(layer(x[-1:]), layer(x)[-1:])


@pytest.mark.parametrize("variant", ["llama3_rope_untied", "qwen2_qkv_bias"])
def test_avx2_and_avx512_builds_give_the_same_bits(variant, native_kernels, monkeypatch):
    """Where the CPU has AVX-512 the products run on 512-bit tiles; the AVX2 build (SPLITSERVE_CPU_KERNELS=avx2)
    must give the same logits bit for bit, through a batched prefill and decode steps, so that pods built either
    way agree and greedy answers do not depend on the machine's vector width."""
    if native_kernels.isa != "avx512":
        pytest.skip("this CPU has no AVX-512: the kernels have one build here")
    avx2 = cpu_kernels.build(avx512=False)
    assert avx2.isa == "avx2"
    logits = []
    for kernels in (native_kernels, avx2):
        monkeypatch.setattr(model_module, "choose_kernels",
                            lambda device, dtype, enabled, kernels=kernels: cpu_kernels.KernelChoice(kernels))
        engine = _Engine(variant)
        assert engine.model.kernels is kernels
        first, second = _tokens(29, seed=1), _tokens(13, seed=2)
        steps = [engine.step([(first, 29), (second, 13)])]  # 42 rows: 12-row tiles and a remainder
        for i in range(3):  # decode steps: each sequence grows by a token
            first.append(i + 7)
            second.append(i + 11)
            steps.append(engine.step([(first, 1), (second, 1)]))
        logits.append(torch.cat([t for step in steps for t in step]))
    assert logits[0].shape == (42 + 3 * 2, SIZES["vocab_size"])
    assert torch.equal(logits[0], logits[1])


def test_packed_weights_round_trip_through_the_state_dict(native_kernels):
    engine = _Engine("llama_gqa_tied")
    layer = engine.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.shape == (16, 64, 16)  # [256, 64] in 16 panels of 16 outputs
    hf_state = fuse_hf_state_dict(engine.hf.state_dict(), engine.model.config)
    ours = engine.model.state_dict()
    assert set(ours) == set(hf_state)
    assert all(torch.equal(ours[k], hf_state[k]) for k in ours)
    ids = torch.tensor([0, 17, 255, 3])  # the tied head doubles as the embedding table: its rows, unpacked
    assert torch.equal(engine.model.embed_tokens.rows(ids), hf_state["embed_tokens.weight"][ids])


def test_packing_reports_a_wrong_shape_by_name(native_kernels):
    layer = Linear(48, 36, False, torch.float32, torch.device("cpu"), native_kernels)
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        layer.load_state_dict({"weight": torch.zeros(36, 47)})


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_16_bit_cache_on_the_native_path_matches_the_pytorch_path(cache_dtype, native_kernels):
    # With a bfloat16 / float16 cache the native layers write rounded K/V and widen them back to float32 as they
    # attend, which is what the PyTorch path does with the same cache: a chunked prefill, then decode steps (all
    # layers in one native call) agree within float32 noise, and stay within the cache's rounding of HF.
    config = _our_config("llama_gqa_tied")
    state = fuse_hf_state_dict(_hf_model("llama_gqa_tied").state_dict(), config)
    prompt = _tokens(12, 14)
    logits = []
    for cpu_kernels in (True, False):
        model = LlamaForCausalLM.from_state_dict(config, state, cpu_kernels=cpu_kernels)
        cache = PagedKVCache(config, NUM_BLOCKS, BLOCK_SIZE, cache_dtype)
        table, steps = [5, 2, 9], [(0, 5), (5, 8), (8, 9), (9, 10), (10, 11)]
        with torch.inference_mode():
            for start, end in steps:
                meta = AttentionMetadata.build([end - start], [end], [table[: -(-end // BLOCK_SIZE)]], BLOCK_SIZE)
                if end - start == 1:
                    assert model._decodes_natively(cache, meta) == cpu_kernels
                hidden = model(torch.tensor(prompt[start:end]), torch.arange(start, end), cache, meta)
                logits.append(model.compute_logits(hidden)[-1])
    native, torch_path = logits[: len(steps)], logits[len(steps) :]
    for ours, theirs in zip(native, torch_path):
        assert (ours - theirs).abs().max().item() <= 1e-4
    reference = _Engine("llama_gqa_tied").reference(prompt)
    for (start, end), ours in zip(steps, native):
        error = (ours - reference[end - 1]).abs().max().item()
        # Every step, the fresh prefill included, attends over the K/V as the cache holds them: rounded.
        assert 1e-6 < error <= 0.1


def test_native_decode_step_in_one_call_equals_layer_by_layer(native_kernels):
    # A decode-only step runs all layers in one native call; with a layer_done hook (the prefill pod's KV export)
    # it goes layer by layer. Same kernels, same order: the same bits, the same cache contents.
    engine = _Engine("qwen2_qkv_bias")
    seqs = [_tokens(7, 20), _tokens(13, 21)]
    engine.step([(seqs[0], 6), (seqs[1], 12)])
    tables = [engine.tables[id(s)] for s in seqs]
    tables[1].append(engine.free_blocks.pop())  # position 12 starts a new block
    meta = AttentionMetadata.build([1, 1], [7, 13], tables, BLOCK_SIZE)
    ids, positions = torch.tensor([seqs[0][6], seqs[1][12]]), torch.tensor([6, 12])
    outs, caches = [], []
    for hook in (None, lambda layer: None):
        with torch.inference_mode():
            outs.append(engine.model(ids, positions, engine.cache, meta, layer_done=hook))
        caches.append([k.clone() for k in engine.cache.k_blocks] + [v.clone() for v in engine.cache.v_blocks])
    assert engine.model._decodes_natively(engine.cache, meta)
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*caches))
    _assert_close(engine.model.compute_logits(outs[0])[1:], engine.reference(seqs[1])[12:13])


def test_heads_the_attention_kernels_do_not_take_run_on_pytorch_around_native_products(native_kernels):
    # head_dim 12 is not a multiple of 8: the layers run on PyTorch ops (products still native) and give the
    # PyTorch path's logits, prefill and decode.
    config = ModelConfig(vocab_size=64, hidden_size=36, intermediate_size=40, num_layers=2, num_heads=3,
                         num_kv_heads=1, tie_word_embeddings=True)
    state = random_state_dict(config, seed=5)
    models = [LlamaForCausalLM.from_state_dict(config, state, cpu_kernels=flag) for flag in (True, False)]
    assert models[0].kernels is not None and models[0].layers[0].kernels is None and models[1].kernels is None
    logits = []
    for model in models:
        cache = PagedKVCache(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
        with torch.inference_mode():
            prefill = AttentionMetadata.build([5], [5], [[1, 2]], 4)
            model(torch.tensor([3, 9, 27, 4, 8]), torch.arange(5), cache, prefill)
            meta = AttentionMetadata.build([1], [6], [[1, 2]], 4)
            logits.append(model.compute_logits(model(torch.tensor([11]), torch.tensor([5]), cache, meta)))
    assert not models[0]._decodes_natively(cache, meta)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-5)


def test_a_state_dict_that_does_not_fit_the_layout_is_refused_by_name():
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                         num_kv_heads=2, tie_word_embeddings=True)
    state = random_state_dict(config, seed=0)
    del state["layers.1.mlp.down_proj.weight"]
    state["lm_head.weight"] = torch.zeros(32, 16)  # tied: there is no head
    state["norm.weight"] = torch.ones(15)
    with pytest.raises(ValueError, match=r"missing: layers\.1\.mlp\.down_proj\.weight; unexpected: lm_head\.weight; "
                                         r"wrong shape: norm\.weight \(15,\) \(expected \(16,\)\)"):
        LlamaForCausalLM.from_state_dict(config, state)
