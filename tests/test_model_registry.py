"""The model registry (engine/model/architectures/): every served architecture from a tiny random checkpoint that
``transformers`` builds and saves, through the offline ``LLM``, against ``transformers`` on the same weights; and the
architectures and configs that are refused at load, in one line.

Each checkpoint has 2 layers and its family's real head_dim and GQA ratio (Llama 3.2-1B: 64 and 4, tied, llama3 RoPE
scaling over a 128k context; Qwen2.5-0.5B: 64 and 7, tied; Qwen3-0.6B: 128 and 2, head_dim independent of the hidden
size, tied; Mistral-7B v0.3: 128 and 4, untied, no sliding window; SmolLM2: 64 and 3, the plain Llama path), a
vocabulary of 256 and a byte-level tokenizer. Everything computes in float32 over a float32 KV cache: prompt logprobs
within 1e-4 of transformers', greedy tokens identical over 32 steps, and a prompt's results the same bits alone, beside
other prompts and in chunks.
"""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch
import transformers
from tiny_checkpoints import (
    GREEDY_STEPS,
    OTHERS,
    PROMPT,
    TOLERANCE,
    VOCAB,
    Checkpoint,
    Shape,
    save_checkpoint,
    scored,
)

from splitserve.engine import LLM
from splitserve.engine.model.architectures import registry
from splitserve.engine.model.rotary import rope_inv_freq
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.weights.hf_checkpoint import load_hf_checkpoint

# Llama 3.2's scaling, over a short original context so that its three bands all fall within head_dim 64 at theta
# 500000 (with 8192, a test's positions would barely turn the scaled frequencies).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
SHAPES = {  # model type -> its tiny checkpoint's shape, the family's real head_dim and GQA
    "llama": Shape(transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(hidden_size=192, num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                        intermediate_size=256, tie_word_embeddings=True, rope_theta=100000.0,
                        max_position_embeddings=2048)),
    "llama3": Shape(transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                         intermediate_size=384, tie_word_embeddings=True, rope_theta=500000.0,
                         rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072)),
    "qwen2": Shape(transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                   dict(hidden_size=448, num_attention_heads=7, num_key_value_heads=1, intermediate_size=320,
                        tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=4096)),
    "qwen3": Shape(transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                   dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                        intermediate_size=256, tie_word_embeddings=True, rope_theta=1000000.0,
                        max_position_embeddings=4096)),
    "mistral": Shape(transformers.MistralConfig, transformers.MistralForCausalLM,
                     dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                          intermediate_size=384, tie_word_embeddings=False, rope_theta=1000000.0, sliding_window=None,
                          max_position_embeddings=4096)),
}
REAL_HEADS = {"llama": (64, 3), "llama3": (64, 4), "qwen2": (64, 7), "qwen3": (128, 2), "mistral": (128, 4)}  # D, GQA


@pytest.fixture(scope="module", params=list(SHAPES))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return Checkpoint(tmp_path_factory.mktemp(request.param), SHAPES[request.param], request.param)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return checkpoint.llm()


def test_the_registry_entry_reads_the_checkpoint(checkpoint):
    config, state = load_hf_checkpoint(checkpoint.directory)
    hf = checkpoint.hf.config
    entry = registry.ARCHITECTURES[hf.model_type]
    assert config.architecture == hf.model_type and entry.hf_class == type(checkpoint.hf).__name__
    assert (config.head_dim, config.num_heads // config.num_kv_heads) == REAL_HEADS[checkpoint.name]
    assert config.qkv_bias is (hf.model_type == "qwen2") and config.qk_norm is (hf.model_type == "qwen3")
    assert config.tie_word_embeddings is hf.tie_word_embeddings
    assert (config.num_layers, config.vocab_size) == (2, VOCAB)
    assert ("layers.1.attn.q_norm.weight" in state) is config.qk_norm


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["default-path", "torch-path"])
def test_prompt_logprobs_match_transformers(checkpoint, cpu_kernels):
    llm = checkpoint.llm(cpu_kernels=cpu_kernels)
    (out,) = scored(llm, [PROMPT], max_tokens=0)
    reference = checkpoint.logprobs(PROMPT)
    assert reference.std(dim=-1).min() > 0.5  # a real spread of logprobs at every position: 1e-4 is a tight bound
    for position in range(1, len(PROMPT)):
        entry, expected = out.prompt_logprobs[position], reference[position - 1]
        assert entry.token_id == PROMPT[position]
        assert abs(entry.logprob - expected[PROMPT[position]].item()) <= TOLERANCE, position
        top = expected.topk(5)
        assert list(entry.top) == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(entry.top.values(), top.values.tolist())) <= TOLERANCE


def test_greedy_tokens_match_transformers_over_32_steps(checkpoint, llm):
    (out,) = scored(llm, [PROMPT])
    assert out.token_ids == checkpoint.greedy(PROMPT, GREEDY_STEPS)


def test_a_prompt_gets_the_same_bits_alone_beside_others_in_chunks_and_from_the_prefix_cache(checkpoint, llm):
    """Each run on an engine of its own without prefix caching, but the last: the module's engine, which has run
    PROMPT before, so its blocks come from the prefix cache (asking no prompt logprobs, which are computed anew)."""
    uncached = {"enable_prefix_caching": False}
    (alone,) = scored(checkpoint.llm(**uncached), [PROMPT])
    beside = scored(checkpoint.llm(**uncached), [OTHERS[0], PROMPT, OTHERS[1]])[1]
    (chunked,) = scored(checkpoint.llm(long_prefill_token_threshold=8, **uncached), [PROMPT])
    for other in (beside, chunked):
        assert other.token_ids == alone.token_ids
        assert other.logprobs == alone.logprobs and other.prompt_logprobs == alone.prompt_logprobs
    scored(llm, [PROMPT])
    (cached,) = scored(llm, [PROMPT], prompt_logprobs=None)
    assert cached.num_cached_tokens == 32  # its two full blocks
    assert (cached.token_ids, cached.logprobs) == (alone.token_ids, alone.logprobs)


def test_weights_quantized_at_load_give_the_widened_weights_logprobs(checkpoint, native_kernels):
    """int8 weights (quantized at load; docs/quantization.md): the native products over the blocks give the logprobs
    of the same weights widened to float32 on the PyTorch path, and stay within int8's rounding of transformers."""
    native, widened = (scored(checkpoint.llm(quantization="int8", cpu_kernels=flag), [PROMPT], max_tokens=0)[0]
                       for flag in (True, False))
    reference = checkpoint.logprobs(PROMPT)
    for position in range(1, len(PROMPT)):
        ours, theirs = native.prompt_logprobs[position].logprob, widened.prompt_logprobs[position].logprob
        assert abs(ours - theirs) <= TOLERANCE
        assert abs(ours - reference[position - 1, PROMPT[position]].item()) <= 0.2  # measured 0.07-0.09


def test_llama3_rope_scaling_is_in_force():
    """The llama3 checkpoint's frequencies differ from unscaled RoPE's in all three bands (kept, interpolated,
    slowed), so its agreement with transformers tests the scaling itself."""
    hf = SHAPES["llama3"].hf_config().to_dict()
    config = registry.for_hf_config(hf, "llama3").model_config(hf, "llama3")
    assert config.rope_scaling == LLAMA3_ROPE and config.max_position_embeddings == 131072
    scaled = rope_inv_freq(config)
    unscaled = 1.0 / (config.rope_theta ** (torch.arange(0, 64, 2).float() / 64))
    ratio = scaled / unscaled
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(1 / 32) and ((ratio < 1) & (ratio > 1 / 32)).any()


def test_every_entry_runs_the_fused_native_layers_and_the_bf16_prefill(checkpoint, llm, native_kernels):
    """Every entry's layers run the fused native calls (Qwen3's per-head q/k norms inside ``ss_attention_input``,
    before RoPE), decode steps the one-call native decode, and ``auto`` prefills in bf16 where the CPU has the
    kernels for it."""
    model = llm.engine.runner.model
    assert model.kernels is native_kernels
    assert all(layer.kernels is native_kernels for layer in model.layers)
    assert checkpoint.llm(prefill_compute_dtype="auto").engine.runner.model.prefill_dtype == (
        "bfloat16" if _has_bf16_kernels(native_kernels) else "float32")


def _has_bf16_kernels(kernels) -> bool:
    from splitserve.engine.kernels import bf16_kernels
    from splitserve.engine.kernels.build import KernelsUnavailable
    from splitserve.engine.kernels.cpu_features import prefill_compute_dtype

    try:
        bf16_kernels.choose(kernels)
    except KernelsUnavailable:
        return False
    return prefill_compute_dtype("auto", "cpu") == "bfloat16"


# ---- what is refused ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "phi3", "deepseek_v3", "llava", "t5"])
def test_an_unserved_architecture_is_refused_in_one_line_naming_the_served_ones(tmp_path, model_type):
    transformers.AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(registry.UnsupportedArchitecture) as refused:
        LLM(model=str(tmp_path))
    message = str(refused.value)
    assert "\n" not in message and f"unsupported architecture {model_type!r}" in message
    assert f"serves model types {', '.join(sorted(registry.ARCHITECTURES))}" in message


def test_splitserve_up_refuses_an_unserved_architecture_before_starting_anything(tmp_path):
    """``splitserve up --model DIR`` checks the checkpoint's config when its config is built: one usage line, where
    otherwise every pod would fail its start with a traceback."""
    from splitserve.up_config import UpConfig

    transformers.AutoConfig.for_model("gemma2").save_pretrained(tmp_path / "gemma2")
    served = f"serves model types {', '.join(sorted(registry.ARCHITECTURES))}"
    with pytest.raises(registry.UnsupportedArchitecture, match=served):
        UpConfig(model=str(tmp_path / "gemma2"), run_dir=str(tmp_path / "up"))
    save_checkpoint(tmp_path / "qwen3", SHAPES["qwen3"])
    assert UpConfig(model=str(tmp_path / "qwen3"), run_dir=str(tmp_path / "up")).model == str(tmp_path / "qwen3")


@pytest.mark.parametrize("model_type, overrides, named", [
    ("mistral", dict(sliding_window=1024), "sliding_window 1024 below its context of 4096"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=512, max_window_layers=1), "sliding-window layers"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}),
     "unsupported rope scaling type 'yarn'"),
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_a_config_asking_for_what_is_not_built_is_refused_at_load(tmp_path, model_type, overrides, named):
    SHAPES[model_type].hf_config(**overrides).save_pretrained(tmp_path)  # refused before any weight is read
    with pytest.raises(ValueError, match=named) as refused:
        load_hf_checkpoint(tmp_path)
    assert "\n" not in str(refused.value) and "is not supported" in str(refused.value)


def test_a_mistral_window_as_long_as_the_context_is_full_attention(tmp_path):
    SHAPES["mistral"].hf_config(sliding_window=4096).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):  # accepted: it goes on to read the weights
        load_hf_checkpoint(tmp_path)


def test_gguf_architectures_go_through_the_registry():
    assert registry.for_gguf("qwen3", "f.gguf").qk_norm and registry.for_gguf("llama", "f.gguf").gguf_qk_permuted
    assert not registry.for_gguf("qwen2", "f.gguf").gguf_qk_permuted
    with pytest.raises(registry.UnsupportedArchitecture, match="unsupported GGUF architecture 'gemma2'.*llama, "
                                                               "qwen2, qwen3"):
        registry.for_gguf("gemma2", "f.gguf")


def test_export_writes_the_architecture_it_was_loaded_as(tmp_path, checkpoint):
    from splitserve.engine.weights.hf_checkpoint import export_hf_checkpoint

    config, state = load_hf_checkpoint(checkpoint.directory)
    export_hf_checkpoint(config, state, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == checkpoint.hf.config.model_type
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(checkpoint.hf)
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        assert torch.equal(reloaded(ids).logits, checkpoint.hf(ids).logits)


# ---- parallelism -----------------------------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("model_type", ["qwen3", "mistral"])
def test_tensor_and_pipeline_parallel_ranks_give_one_process_answer(tmp_path, model_type):
    """2 ranks (the second a process of its own) against 1, tensor- or pipeline-parallel. Tensor: Qwen3's q/k norm
    weights are replicated and each rank normalizes its own heads (2 query heads, 1 KV head each); Mistral's one KV
    head is on both ranks, its 4 query heads split 2 + 2. Pipeline: a layer per rank. The same greedy tokens, prompt
    logprobs within 1e-4 (the row-parallel sums round in another order)."""
    checkpoint = Checkpoint(tmp_path, SHAPES[model_type])
    mask = os.sched_getaffinity(0)
    answers = []
    for settings in ({}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        llm = checkpoint.llm(**settings)
        answers.append(scored(llm, [PROMPT])[0])
        del llm
        gc.collect()  # a parallel engine's ranks stop, and this thread's CPU mask comes back, when it is collected
    assert os.sched_getaffinity(0) == mask  # the later modules' clusters plan over every CPU again
    one, *split = answers
    for other in split:
        assert other.token_ids == one.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(one.prompt_logprobs[1:], other.prompt_logprobs[1:])) \
            <= TOLERANCE


# ---- disaggregated ---------------------------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("model_type, kv_codec", [*((m, "none") for m in SHAPES), ("qwen3", "int8")])
def test_a_prefill_and_a_decode_pod_answer_as_the_offline_engine(tmp_path, start_cluster, model_type, kv_codec):
    """``splitserve up --model DIR`` of each checkpoint with one prefill and one decode pod: every prompt prefills on
    the prefill pod, its KV crosses to the decode pod through ``kv_codec`` (lossless; and int8, lossy, for Qwen3, the
    entry on its own compute path, with heads of 128), and the greedy tokens are the offline engine's (float16 KV on
    both, the pods' default); every block is free after."""
    from tests.reliability.live_cluster import START_S, TINY, stream, wait_every_block_free
    from tests.test_tp_cluster import kv_loaded

    checkpoint = Checkpoint(tmp_path / model_type, SHAPES[model_type])
    prompts = [PROMPT, *OTHERS]
    offline = LLM(model=str(checkpoint.directory), prefill_compute_dtype="float32").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=GREEDY_STEPS, ignore_eos=True))
    cluster = start_cluster(tmp_path / "up", **{**TINY, "model": str(checkpoint.directory), "prefill": 1,
                                                "decode": 1, "kv_codec": kv_codec, "conditional_prefill_threshold": 0,
                                                "decode_pod_wait_s": START_S})
    try:
        answers = [stream(cluster, prompt, GREEDY_STEPS, timeout_s=START_S) for prompt in prompts]
        assert [(a.finish, a.error) for a in answers] == [("FINISH_REASON_LENGTH", "")] * len(prompts)
        assert [a.token_ids for a in answers] == [out.token_ids for out in offline]
        assert kv_loaded(cluster, cluster.pods[1]) == len(prompts)  # each prompt's KV came from the prefill pod
        wait_every_block_free(cluster)
    finally:
        cluster.stop()
