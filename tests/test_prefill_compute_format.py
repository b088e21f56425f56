"""The prefill compute format (issue 34): the CPU's flags read through one function, the format ``auto`` resolves to
per feature set, and bf16 prefill (engine/model/bf16_prefill.py) on a tiny random model: close to float32, and in a step
mixed with decodes, the decode rows keep float32's bits and the prompt's K/V do not depend on the decodes beside it.
The real model's agreement with float32 is in tests/test_bf16_prefill_smollm2.py."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.kernels.cpu_features import matrix_features, parse_cpuinfo, prefill_compute_dtype
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.model.bf16_prefill import copied_weights
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.weights.model_files import tiny_random_config
from splitserve.engine.weights.parameter_layout import random_state_dict

AVX2_ONLY = {"sse4_2", "avx", "avx2", "fma", "f16c"}  # AMD Zen 3
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}  # Skylake-SP, Cascade Lake
AVX512_BF16 = AVX512_NO_BF16 | {"avx512_bf16"}  # AMD Zen 4/5, Cooper Lake
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}  # Sapphire Rapids


@pytest.mark.parametrize(("flags", "expected"), [
    (AVX2_ONLY, "float32"),  # bf16 products emulated: 26 GFLOP/s against float32's 94
    (AVX512_NO_BF16, "float32"),  # converted to float32: 86 against 98
    (AVX512_BF16, "bfloat16"),  # vdpbf16ps: 494 against 107
    (AMX, "bfloat16"),  # tiles: 1,125 against 143
    (set(), "float32"),  # flags unreadable
])
def test_auto_per_cpu_feature_set(flags, expected):
    assert prefill_compute_dtype("auto", "cpu", flags) == expected


def test_explicit_settings_and_other_devices():
    assert prefill_compute_dtype("float32", "cpu", AMX) == "float32"
    assert prefill_compute_dtype("bfloat16", "cpu", AVX2_ONLY) == "bfloat16"
    assert prefill_compute_dtype("auto", "cuda:0", AMX) == "float32"
    with pytest.raises(ValueError, match="prefill_compute_dtype must be one of auto, float32, bfloat16"):
        prefill_compute_dtype("int8", "cpu", AMX)
    with pytest.raises(ValueError, match="prefill_compute_dtype"):
        EngineConfig(prefill_compute_dtype="bf16")


def test_flags_from_cpuinfo_text():
    text = ["processor\t: 0\n", "model name\t: AMD EPYC\n", "flags\t\t: fpu avx2 avx512f avx512_bf16\n",
            "processor\t: 1\n", "flags\t\t: fpu\n"]
    flags = parse_cpuinfo(text)
    assert flags == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert matrix_features(flags) == "avx2,avx512f,avx512_bf16"
    assert matrix_features(set()) == "none"


BLOCK = 4


def _models():
    config = tiny_random_config()
    state = random_state_dict(config, 0)
    reference = LlamaForCausalLM.from_state_dict(config, state)
    bf16 = LlamaForCausalLM.from_state_dict(config, state, prefill_compute_dtype="bfloat16")
    return config, reference, bf16


def _run(model, config, steps, cache_dtype="float32"):
    """Run ``steps`` (query_lens, seq_lens, block_tables, tokens, positions) on a fresh cache -> (hidden of the
    last step, cache)."""
    cache = PagedKVCache(config, 32, BLOCK, cache_dtype)
    for query_lens, seq_lens, tables, tokens, positions in steps:
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
        hidden = model(torch.tensor(tokens), torch.tensor(positions), cache, meta)
    return hidden, cache


PROMPT = [5, 17, 99, 3, 42, 7, 250, 11, 64, 9, 31]  # 11 tokens: blocks 4..6 of the second sequence
OTHER = [8, 2, 77, 120, 6]


def test_bf16_prefill_is_close_to_float32_and_not_its_bits():
    config, reference, bf16 = _models()
    assert (reference.prefill_dtype, bf16.prefill_dtype) == ("float32", "bfloat16")
    assert bf16.bf16_prefill.nbytes == sum(t.nbytes for layer in bf16.bf16_prefill.layers
                                           for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    step = [([len(PROMPT)], [len(PROMPT)], [[1, 2, 3]], PROMPT, list(range(len(PROMPT))))]
    ref, _ = _run(reference, config, step)
    got, _ = _run(bf16, config, step)
    logits_ref, logits = reference.compute_logits(ref), bf16.compute_logits(got)
    assert not torch.equal(logits, logits_ref)  # the prefill really ran in bf16
    assert (logits.argmax(-1) == logits_ref.argmax(-1)).float().mean() >= 0.9
    assert torch.allclose(logits, logits_ref, atol=0.1 * logits_ref.abs().max().item())


@pytest.mark.parametrize("cache_dtype", ["float32", "float16"])
def test_mixed_step_decode_rows_keep_float32_and_prompt_kv_ignores_them(cache_dtype):
    config, _, bf16 = _models()
    other_prefill = ([len(OTHER)], [len(OTHER)], [[1, 2]], OTHER, list(range(len(OTHER))))
    n = len(PROMPT)
    # Step 2: OTHER decodes one token while PROMPT prefills whole.
    mixed = ([1, n], [len(OTHER) + 1, n], [[1, 2], [4, 5, 6]], [13] + PROMPT, [len(OTHER)] + list(range(n)))
    hidden, cache = _run(bf16, config, [other_prefill, mixed], cache_dtype)
    alone_hidden, alone_cache = _run(bf16, config, [([n], [n], [[4, 5, 6]], PROMPT, list(range(n)))], cache_dtype)
    # The prompt's K/V and hidden rows are those of its prefill alone, bit for bit.
    for layer in range(config.num_layers):
        for mine, alone in ((cache.k_blocks, alone_cache.k_blocks), (cache.v_blocks, alone_cache.v_blocks)):
            assert torch.equal(mine[layer][4:7].flatten(0, 1)[:n], alone[layer][4:7].flatten(0, 1)[:n])
    assert torch.equal(hidden[1:], alone_hidden)
    # The decode row is the float32 model's decode of OTHER over the same (bf16-prefilled) context.
    decode = ([1], [len(OTHER) + 1], [[1, 2]], [13], [len(OTHER)])
    decoded, _ = _run(bf16, config, [other_prefill, decode], cache_dtype)
    assert torch.equal(hidden[:1], decoded)


def test_every_pod_takes_the_setting_as_a_flag_and_an_environment_variable():
    from splitserve.decode_service.config import DecodeConfig
    from splitserve.prefill_service.config import PrefillConfig
    from splitserve.runtime.config import parse_config

    prefill = parse_config(PrefillConfig, ["--prefill-compute-dtype", "auto"], env={})
    assert prefill.engine_config().prefill_compute_dtype == "auto"
    decode = parse_config(DecodeConfig, [], env={"SPLITSERVE_PREFILL_COMPUTE_DTYPE": "bfloat16"})
    assert decode.engine_config().prefill_compute_dtype == "bfloat16"
    assert parse_config(DecodeConfig, [], env={}).engine_config().prefill_compute_dtype == "auto"  # the default


def test_splitserve_up_passes_the_setting_to_every_pod():
    from splitserve.decode_service.config import DecodeConfig
    from splitserve.prefill_service.config import PrefillConfig
    from splitserve.runtime.config import parse_config, passed_on
    from splitserve.up_config import UpConfig

    up = parse_config(UpConfig, ["--prefill-compute-dtype", "bfloat16"], env={})
    for cls, role in ((PrefillConfig, "prefill"), (DecodeConfig, "decode"), (DecodeConfig, "mixed")):
        flags = passed_on(up, cls, scope=role)
        assert flags[flags.index("--prefill-compute-dtype") + 1] == "bfloat16", role


def test_engine_reports_the_resolved_format():
    from splitserve.engine import LLM

    assert LLM(model="tiny-random", num_blocks=16).engine.prefill_compute == prefill_compute_dtype("auto")
    assert LLM(model="tiny-random", num_blocks=16, prefill_compute_dtype="float32").engine.prefill_compute == "float32"
    bf16 = LLM(model="tiny-random", num_blocks=16, prefill_compute_dtype="bfloat16")
    assert bf16.engine.prefill_compute == "bfloat16"


def test_a_prompt_position_has_the_same_bits_however_the_prompt_is_chunked():
    """bf16 prefill's products run on one tiling whatever the rows (csrc/bf16_tiles.h; oneDNN's chose its kernel by
    shape: on AMX a position's bits followed its chunk), so a prefix-cache hit's last token or a 1-token last chunk
    gets a whole prefill's bits. tests/test_prefill_invariance.py checks batches and threads too, on every ISA."""
    config = ModelConfig(vocab_size=1000, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9,
                         num_kv_heads=3, max_position_embeddings=1024)  # SmolLM2's layer shapes
    model = LlamaForCausalLM.from_state_dict(config, random_state_dict(config, 0), prefill_compute_dtype="bfloat16")
    n, table = 300, list(range(20))
    for seed in range(4):
        tokens = torch.randint(5, 990, (n,), generator=torch.Generator().manual_seed(seed))
        runs = []
        for chunks in ([n], [n - 1, 1], [1, n - 1], [128, 171, 1]):
            cache, start, hidden = PagedKVCache(config, 20, 16, "float16"), 0, []
            for size in chunks:
                meta = AttentionMetadata.build([size], [start + size], [table], 16,
                                               one_row_prefills=frozenset({0}) if size == 1 else frozenset())
                hidden.append(model(tokens[start: start + size], torch.arange(start, start + size), cache, meta))
                start += size
            runs.append((torch.cat(hidden), cache))
        (whole, whole_cache), *others = runs
        for hidden, cache in others:
            assert torch.equal(hidden, whole)
            assert all(torch.equal(a, b) for a, b in zip(cache.k_blocks + cache.v_blocks,
                                                         whole_cache.k_blocks + whole_cache.v_blocks))


def test_auto_is_the_default_of_every_entry_point():
    """As vLLM's ``dtype=auto``: ``LLM(...)``, the engine, every pod, ``splitserve up`` and the chart; float32 stays a
    setting (the bit-exact reference)."""
    import inspect

    import yaml

    from splitserve.deploy.chart_schema import CHART
    from splitserve.engine import LLM
    from splitserve.runtime.pod_server import PodConfig
    from splitserve.up_config import UpConfig

    assert inspect.signature(LLM).parameters["prefill_compute_dtype"].default == "auto"
    assert EngineConfig().prefill_compute_dtype == PodConfig().prefill_compute_dtype == "auto"
    assert UpConfig().prefill_compute_dtype == "auto"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert {role: values[role]["config"]["prefillComputeDtype"] for role in ("prefill", "decode", "mixed")} == \
        dict.fromkeys(("prefill", "decode", "mixed"), "auto")


def test_the_engine_reports_the_memory_of_both_forms():
    from splitserve.engine import LLM

    bf16 = LLM(model="tiny-random", num_blocks=16, prefill_compute_dtype="bfloat16").engine
    copies = sum(t.numel() * t.element_size() for layer in bf16.runner.model.bf16_prefill.layers
                 for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert bf16.weight_bytes == {"model": sum(p.numel() * p.element_size() for p in bf16.runner.model.parameters()),
                                 "bf16_prefill": copies} and copies > 0
    f32 = LLM(model="tiny-random", num_blocks=16, prefill_compute_dtype="float32").engine
    assert f32.weight_bytes == {"model": bf16.weight_bytes["model"], "bf16_prefill": 0}


def test_the_simulator_runs_the_profile_of_the_pods_resolved_format():
    from splitserve.measure.phase_profile import PhaseProfile
    from splitserve.simulator.run import FORMAT_PROFILES, SimulateConfig

    for fmt, path in FORMAT_PROFILES.items():  # each shipped profile measured its prefill steps in its format
        assert PhaseProfile.load(path).prefill_compute == fmt
    assert SimulateConfig(prefill_compute_dtype="float32").profile == str(FORMAT_PROFILES["float32"])
    assert SimulateConfig(prefill_compute_dtype="bfloat16").profile == str(FORMAT_PROFILES["bfloat16"])
    assert SimulateConfig().profile == str(FORMAT_PROFILES[prefill_compute_dtype("auto")])  # as the pods resolve


def test_the_router_reads_the_format_from_load_reports_and_redis_records_and_the_handshake_carries_it(caplog):
    import dataclasses
    import logging

    from splitserve.kvtransfer.handshake import KVLayout, note_formats
    from splitserve.router.pods.registry import PodLoad
    from splitserve.v1 import common_pb2

    load = PodLoad.from_proto(common_pb2.PodLoad(prefill_compute_dtype="bfloat16", cpu_features=["avx2", "amx_bf16"]))
    assert (load.prefill_compute_dtype, load.cpu_features) == ("bfloat16", ("avx2", "amx_bf16"))
    assert PodLoad.from_dict({"prefill_compute_dtype": "float32", "num_running": 1}).prefill_compute_dtype == "float32"
    here = KVLayout("m", 2, 2, 16, 16, "float16", prefill_compute_dtype="float32", cpu_features=("avx2",))
    peer = dataclasses.replace(here, prefill_compute_dtype="bfloat16", cpu_features=("avx2", "avx512_bf16"))
    assert KVLayout.from_proto(peer.to_proto()) == peer
    assert peer.compat_hash == here.compat_hash  # interchangeable KV: the format is not in the hash
    with caplog.at_level(logging.INFO, logger="splitserve.kvtransfer.handshake"):
        note_formats(here, peer, "decode pod d:1")
    assert "decode pod d:1 prefills in bfloat16 (CPU features: avx2,avx512_bf16), this pod in float32" in caplog.text


# ---- each role holds the forms it computes with ------------------------------------------------------------------

def test_a_prefill_only_model_holds_the_bf16_form_only_and_prefills_the_same_bits():
    config = tiny_random_config()
    state = random_state_dict(config, 0)
    both = LlamaForCausalLM.from_state_dict(config, state, prefill_compute_dtype="bfloat16")
    only = LlamaForCausalLM.from_state_dict(config, state, prefill_compute_dtype="bfloat16", prefill_only=True)
    held = {n for n, p in only.named_parameters() if p.numel()}
    assert held == {n for n, _ in both.named_parameters()} - set(copied_weights(config))
    assert all(not n.startswith("layers.") or "norm" in n or n.endswith(".bias") for n in held)  # no layer products
    step = [([len(PROMPT)], [len(PROMPT)], [[1, 2, 3]], PROMPT, list(range(len(PROMPT))))]
    (hidden, cache), (hidden_both, cache_both) = _run(only, config, step), _run(both, config, step)
    assert torch.equal(hidden, hidden_both)
    assert torch.equal(only.compute_logits(hidden[-1:]), both.compute_logits(hidden_both[-1:]))
    assert all(torch.equal(a, b) for a, b in zip(cache.k_blocks + cache.v_blocks, cache_both.k_blocks +
                                                 cache_both.v_blocks))
    decode = ([1], [len(PROMPT) + 1], [[1, 2, 3]], [13], [len(PROMPT)])
    with pytest.raises(RuntimeError, match="runs no decode rows"):
        _run(only, config, [step[0], decode])
    # Prefill in float32 computes from the model's own weights: prefill_only keeps them all.
    f32 = LlamaForCausalLM.from_state_dict(config, state, prefill_compute_dtype="float32", prefill_only=True)
    assert f32.decodes and all(p.numel() for p in f32.parameters())


def test_a_prefill_only_engine_keeps_no_quantized_layer_blocks_and_reports_the_bf16_form():
    from splitserve.engine.llm_engine import LLMEngine

    def engine(prefill_only: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(model="tiny-random", quantization="int8", prefill_compute_dtype="bfloat16",
                                      prefill_only=prefill_only))

    only, both = engine(True), engine(False)
    model = only.runner.model
    assert model.kernels is None or any(layer.attn.qkv_proj.weight_format != "float32"
                                        for layer in both.runner.model.layers)  # the blocks a decode pod keeps
    assert not any(p.numel() for layer in model.layers for p in (layer.attn.qkv_proj.weight,
                   layer.attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight))
    # The embeddings (the first token's lookup), the head that samples it, the norms and the QKV biases.
    small = sum(p.nbytes for n, p in model.named_parameters()
                if n.startswith(("embed_tokens.", "lm_head.", "norm.")) or "norm" in n or n.endswith(".bias"))
    assert only.weight_bytes == {"model": small, "bf16_prefill": both.weight_bytes["bf16_prefill"]}
    assert only.weight_bytes["model"] < both.weight_bytes["model"]
    firsts = []
    for e in (only, both):  # a prefill pod's step: a whole prompt, one token sampled with its logprobs
        seq = e.add_request("r", list(range(5, 40)), SamplingParams(temperature=0, max_tokens=1, logprobs=3))
        while e.has_unfinished_requests():
            e.step()
        firsts.append((seq.output_token_ids, seq.output_logprobs))
    assert firsts[0] == firsts[1] and len(firsts[0][0]) == 1


def test_the_prefill_pod_alone_is_prefill_only():
    from splitserve.decode_service.config import DecodeConfig
    from splitserve.prefill_service.config import PrefillConfig
    from splitserve.runtime.config import parse_config

    assert parse_config(PrefillConfig, [], env={}).engine_config().prefill_only
    for role in ("decode", "mixed"):  # they decode, and prefill short, cached, lent or split prompts
        assert not parse_config(DecodeConfig, ["--role", role], env={}).engine_config().prefill_only


def test_auto_keeps_float32_where_bf16_products_are_emulated(monkeypatch):
    """On an AVX2-only CPU (or AVX-512 without bf16) auto builds no bf16 copy, and a prefill pod keeps the model."""
    from splitserve.engine.kernels import cpu_features

    config = tiny_random_config()
    state = random_state_dict(config, 0)
    for flags, expected in ((AVX2_ONLY, "float32"), (AVX512_NO_BF16, "float32"), (AVX512_BF16, "bfloat16")):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda flags=flags: frozenset(flags))
        model = LlamaForCausalLM.from_state_dict(config, state, prefill_compute_dtype="auto", prefill_only=True)
        assert model.prefill_dtype == expected
        assert (model.bf16_prefill is None) == (expected == "float32") and model.decodes == (expected == "float32")
