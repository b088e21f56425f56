"""Mixtures of experts (engine/model/moe.py): Qwen3-MoE, Mixtral and Qwen2-MoE from tiny random checkpoints that
``transformers`` builds and saves, through the offline ``LLM``, against ``transformers`` on the same weights
(tests/tiny_checkpoints.py).

Qwen3-MoE: Qwen3-30B-A3B's head_dim 128 and GQA 2 (here 4 query heads over 2 KV heads), 8 experts of width 64, top 4
renormalized, layer 0 dense (``mlp_only_layers``) and layer 1 routed. Mixtral: head_dim 128, GQA 4, 8 experts of width
96, top 2, both layers routed. Qwen2-MoE: head_dim 128 without GQA (Qwen1.5-MoE's), q/k/v biases, 8 experts of
width 64, top 4 not renormalized, a gated shared expert of width 128, layer 0 dense by ``decoder_sparse_step`` 2.
Everything in float32 over a float32 KV cache: prompt logprobs within 1e-4 of
transformers' on both compute paths, greedy tokens identical over 32 steps, routing the same experts as
transformers', a prompt's bits the same alone, beside others, chunked and from the prefix cache (the per-expert
grouping must not leak into a token's bits), the hub's and transformers' stacked names loaded and exported back;
(``e2e``) expert parallelism over 2 tensor-parallel ranks, pipeline ranks, and a prefill and a decode pod.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from tiny_checkpoints import (
    OTHERS,
    PROMPT,
    TOLERANCE,
    Checkpoint,
    PrefillDecodeCluster,
    Shape,
    architecture_fixtures,
    check_export,
    check_greedy_tokens,
    check_prompt_logprobs,
    check_ranks_agree,
    check_same_bits,
    scored,
)

from splitserve.engine.model.layers import fused_layers_refusal
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.moe import MoE, tokens_routed
from splitserve.engine.weights.hf_checkpoint import fuse_hf_state_dict, load_hf_checkpoint

SHAPES = {
    "qwen3_moe": Shape(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                       dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                            intermediate_size=256, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=4,
                            norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=True,
                            rope_theta=1000000.0, max_position_embeddings=4096)),
    "mixtral": Shape(transformers.MixtralConfig, transformers.MixtralForCausalLM,
                     dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                          intermediate_size=96, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                          rope_theta=1000000.0, sliding_window=None, max_position_embeddings=4096)),
    "qwen2_moe": Shape(transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                       dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
                            moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=8,
                            num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=2,
                            tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=4096)),
}
ROUTED = {"qwen3_moe": [1], "mixtral": [0, 1], "qwen2_moe": [1]}  # the layers whose MLP is the experts


checkpoint, llm = architecture_fixtures(SHAPES)


def test_the_entry_reads_the_experts_from_the_hub_names_and_from_transformers_stacked_ones(checkpoint):
    """``save_pretrained`` writes the hub's per-expert names (Mixtral's ``block_sparse_moe.experts.E.w1``); a
    transformers 5.x model's own state dict stacks them (``mlp.experts.gate_up_proj`` [E, 2 I, H]): both give the same
    fused state dict."""
    config, state = load_hf_checkpoint(checkpoint.directory)
    hf = checkpoint.hf.config
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == (hf.model_type, 8,
                                                                                     hf.num_experts_per_tok)
    assert config.moe_layers == ROUTED[checkpoint.name]
    assert config.norm_topk_prob is getattr(hf, "norm_topk_prob", True)  # Mixtral's always
    assert config.shared_expert_intermediate_size == getattr(hf, "shared_expert_intermediate_size", 0)
    assert state["layers.1.mlp.router.weight"].shape == (8, config.hidden_size)
    assert state["layers.1.mlp.experts.7.down_proj.weight"].shape == (config.hidden_size, config.moe_intermediate_size)
    assert ("layers.0.mlp.gate_up_proj.weight" in state) is (0 not in config.moe_layers)  # Qwen3-MoE's dense layer
    stacked = checkpoint.hf.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in stacked)
    from_memory = fuse_hf_state_dict(stacked, config)
    assert from_memory.keys() == state.keys() and all(torch.equal(from_memory[n], state[n]) for n in state)


def test_moe_layers_compose_in_pytorch_around_the_native_products(checkpoint, llm, native_kernels):
    """The fused native layer kernels have no router: refused with a reason, so each layer runs its PyTorch
    composition with every product (router and experts included) native, and ``auto`` prefills in float32."""
    model = llm.engine.runner.model
    assert "mixture-of-experts" in fused_layers_refusal(model.config)
    assert all(layer.kernels is None for layer in model.layers)
    moe = model.layers[1].mlp
    assert isinstance(moe, MoE) and moe.router.kernels is native_kernels
    assert all(expert.gate_up_proj.kernels is native_kernels for expert in moe.experts.values())
    assert checkpoint.llm(prefill_compute_dtype="auto").engine.runner.model.prefill_dtype == "float32"


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["default-path", "torch-path"])
def test_prompt_logprobs_match_transformers(checkpoint, cpu_kernels):
    check_prompt_logprobs(checkpoint, cpu_kernels=cpu_kernels)


def test_greedy_tokens_match_transformers_over_32_steps(checkpoint, llm):
    check_greedy_tokens(checkpoint, llm)


def test_tokens_go_to_the_experts_transformers_routes_them_to_and_routing_matters(checkpoint):
    """Every routed layer picks, for every prompt token, the same set of experts as transformers' router; the three
    prompts' tokens spread over all 8 experts in different combinations (a router that always chose the same experts,
    or a model whose answer did not depend on the choice, would pass the logprob tests for the wrong reason)."""
    llm = checkpoint.llm(enable_prefix_caching=False)
    model = llm.engine.runner.model
    ours, theirs = {}, {}  # layer -> [T, k] experts, the first call's (the prompt's)

    def ours_of(i):  # the engine's router on its layer's input
        def hook(module, args):
            ours.setdefault(i, module.route(args[0])[0])  # returning nothing keeps the input
        return hook

    def theirs_of(i):  # transformers' router's choice
        def hook(module, args, out):
            theirs.setdefault(i, out[2])
        return hook

    hooks = [model.layers[i].mlp.register_forward_pre_hook(ours_of(i)) for i in ROUTED[checkpoint.name]]
    hooks += [checkpoint.hf.model.layers[i].mlp.gate.register_forward_hook(theirs_of(i))
              for i in ROUTED[checkpoint.name]]
    try:
        scored(llm, [PROMPT], max_tokens=1)
        checkpoint.logprobs(PROMPT)
    finally:
        for hook in hooks:
            hook.remove()
    for i in ROUTED[checkpoint.name]:
        assert ours[i].sort().values.tolist() == theirs[i].sort().values.tolist(), i
        assert len({tuple(sorted(row)) for row in ours[i].tolist()}) >= 4
    scored(llm, OTHERS, max_tokens=1)
    routed = tokens_routed(model.layers)
    k = model.config.num_experts_per_tok
    assert sorted(routed) == ROUTED[checkpoint.name]
    for counts in routed.values():  # the prompts, and no decode step (max_tokens=1)
        assert min(counts) > 0 and sum(counts) == k * sum(map(len, [PROMPT, *OTHERS]))
    # The experts' weights change the answer: with one expert's weights zeroed, the prompt scores otherwise.
    expert = model.layers[1].mlp.experts[str(max(range(8), key=routed[1].__getitem__))]
    saved = expert.down_proj.weight.clone()
    expert.down_proj.weight.zero_()
    try:
        changed = scored(llm, [PROMPT], max_tokens=1)[0]
    finally:
        expert.down_proj.weight.copy_(saved)
    again = scored(llm, [PROMPT], max_tokens=1)[0]
    assert _prompt_logprobs(changed) != _prompt_logprobs(again)


def _prompt_logprobs(out) -> list[float]:
    return [entry.logprob for entry in out.prompt_logprobs[1:]]


def test_a_prompt_gets_the_same_bits_alone_beside_others_in_chunks_and_from_the_prefix_cache(checkpoint, llm):
    """Each run on an engine of its own without prefix caching, but the last: the module's engine, which has run
    PROMPT before, so its blocks come from the prefix cache. Beside other prompts an expert's product takes rows of
    several sequences and in chunks fewer rows: a token's bits must not move."""
    check_same_bits(checkpoint, llm)


def test_experts_quantized_at_load_give_the_widened_weights_logprobs(checkpoint, native_kernels):
    """int8 at load keeps every expert's products in Q8_0 blocks on the native kernels and the router in float32 (a
    rounded routing logit would choose other experts): the same logprobs as those weights widened on PyTorch."""
    native_llm = checkpoint.llm(quantization="int8")
    moe = native_llm.engine.runner.model.layers[1].mlp
    assert {e.down_proj.weight_format for e in moe.experts.values()} == {"q8_0"}
    assert moe.router.weight_format == "float32"
    native, widened = (scored(llm, [PROMPT], max_tokens=0)[0]
                       for llm in (native_llm, checkpoint.llm(quantization="int8", cpu_kernels=False)))
    assert max(abs(a - b) for a, b in zip(_prompt_logprobs(native), _prompt_logprobs(widened))) <= TOLERANCE


def _write_moe_gguf(path, hf, qtype, model_type: str = "qwen3_moe") -> None:
    """``hf`` (the checkpoint's transformers state dict, stacked experts) as llama.cpp's converter writes the model
    type's file: each routed layer's experts stacked [E, rows, cols], matrices in ``qtype``, the router F32. Qwen3-MoE
    as ``qwen3moe``; Mixtral as ``llama`` with experts: Q and K rows interleaved, the experts' width as
    ``feed_forward_length``."""
    import gguf
    import numpy as np

    from tests.test_weights import GGUF_TOKENS, llama_cpp_permute

    c, mixtral = SHAPES[model_type].config, model_type == "mixtral"
    width = c["intermediate_size"] if mixtral else c["moe_intermediate_size"]
    writer = gguf.GGUFWriter(path, "llama" if mixtral else "qwen3moe")
    for key, value in (("block_count", 2), ("context_length", 4096), ("embedding_length", c["hidden_size"]),
                       ("feed_forward_length", c["intermediate_size"]), ("head_count", c["num_attention_heads"]),
                       ("head_count_kv", c["num_key_value_heads"]), ("key_length", c["head_dim"]),
                       ("rope_dimension_count", c["head_dim"]),
                       ("expert_count", c["num_local_experts" if mixtral else "num_experts"]),
                       ("expert_used_count", c["num_experts_per_tok"])):
        getattr(writer, f"add_{key}")(value)
    if not mixtral:
        writer.add_expert_feed_forward_length(width)
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(GGUF_TOKENS)
    writer.add_token_merges(["a b"])
    h = "model.layers.{i}."
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not c["tie_word_embeddings"]:  # llama.cpp drops the head that is the embedding
        names["output.weight"] = "lm_head.weight"
    for i in range(2):
        for g, t in (("attn_norm", "input_layernorm"), ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                     ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                     ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                     ("ffn_norm", "post_attention_layernorm"), ("ffn_gate", "mlp.gate_proj"),
                     ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"), ("ffn_gate_inp", "mlp.gate")):
            names[f"blk.{i}.{g}.weight"] = (h + t + ".weight").format(i=i)
    tensors = {g: hf[t].numpy() for g, t in names.items() if t in hf}
    for i in ROUTED[model_type]:
        gate_up = hf[h.format(i=i) + "mlp.experts.gate_up_proj"].numpy()
        tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"] = np.split(gate_up, 2, axis=1)
        tensors[f"blk.{i}.ffn_down_exps.weight"] = hf[h.format(i=i) + "mlp.experts.down_proj"].numpy()
    for name, w in tensors.items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if mixtral and (".attn_q." in name or ".attn_k." in name):
            w = llama_cpp_permute(w, c["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"])
        if w.ndim >= 2 and "ffn_gate_inp" not in name and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_qwen3moe_gguf_gives_each_expert_its_matrix_in_the_files_blocks(tmp_path, native_kernels):
    """llama.cpp stacks a layer's experts in one tensor ([E, I, H] as ``ffn_gate_exps``...): the loader splits it per
    expert. In F32, the weights of the checkpoint it was converted from, exactly; in Q8_0 with ``keep_blocks``
    (``quantization="gguf"``), each expert's matrices stay in the file's blocks, within Q8_0's rounding."""
    import gguf

    from splitserve.engine.weights.gguf_file import load_gguf
    from splitserve.engine.weights.quantized_weights import BlockQuantized

    checkpoint = Checkpoint(tmp_path / "hf", SHAPES["qwen3_moe"])
    config, state = load_hf_checkpoint(checkpoint.directory)
    hf = checkpoint.hf.state_dict()
    _write_moe_gguf(tmp_path / "f32.gguf", hf, gguf.GGMLQuantizationType.F32)
    from_gguf, f32 = load_gguf(tmp_path / "f32.gguf")[:2]
    assert (from_gguf.architecture, from_gguf.moe_layers, from_gguf.num_experts, from_gguf.num_experts_per_tok,
            from_gguf.moe_intermediate_size, from_gguf.norm_topk_prob) == ("qwen3_moe", [1], 8, 4, 64, True)
    assert f32.keys() == state.keys() and all(torch.equal(f32[n], state[n]) for n in state)
    _write_moe_gguf(tmp_path / "q8.gguf", hf, gguf.GGMLQuantizationType.Q8_0)
    q8_config, q8 = load_gguf(tmp_path / "q8.gguf", keep_blocks=True)[:2]
    for e in range(8):
        for part in ("gate_up_proj", "down_proj"):
            name = f"layers.1.mlp.experts.{e}.{part}.weight"
            assert isinstance(q8[name], BlockQuantized) and q8[name].format == "q8_0"
            assert (q8[name].dequantize() - state[name]).abs().max() <= state[name].abs().max() * 0.6 / 127
    assert isinstance(q8["layers.1.mlp.router.weight"], torch.Tensor)  # F32 in the file, as llama.cpp keeps it
    model = LlamaForCausalLM.from_state_dict(q8_config, q8)  # the native products run the experts' blocks
    assert model.layers[1].mlp.experts["5"].gate_up_proj.weight_format == "q8_0"


def test_a_mixtral_gguf_reads_as_mixtral_with_the_checkpoints_weights(tmp_path):
    """llama.cpp writes Mixtral as ``llama`` with ``llama.expert_count``: read as the mixtral entry (every layer
    routed, Q and K rows unpermuted), its F32 weights the checkpoint's exactly (so its answers are too)."""
    import gguf

    from splitserve.engine.weights.gguf_file import load_gguf

    checkpoint = Checkpoint(tmp_path / "hf", SHAPES["mixtral"])
    config, state = load_hf_checkpoint(checkpoint.directory)
    _write_moe_gguf(tmp_path / "mixtral.gguf", checkpoint.hf.state_dict(), gguf.GGMLQuantizationType.F32, "mixtral")
    from_gguf, f32 = load_gguf(tmp_path / "mixtral.gguf")[:2]
    assert (from_gguf.architecture, from_gguf.moe_layers, from_gguf.num_experts, from_gguf.num_experts_per_tok,
            from_gguf.moe_intermediate_size, from_gguf.norm_topk_prob) == ("mixtral", [0, 1], 8, 2, 96, True)
    assert f32.keys() == state.keys() and all(torch.equal(f32[n], state[n]) for n in state)


@pytest.mark.parametrize("gelu", [False, True], ids=["swiglu", "geglu"])
def test_an_experts_gated_row_has_the_same_bits_in_any_number_of_rows(gelu):
    """An expert's product takes as many rows as the batch routes to it, and PyTorch splits an elementwise op of
    32768+ elements over threads at any element: act(gate) * up runs in calls of whole rows, so a row's bits are
    its own (a plain F.silu over 343 rows of 96 changes one row's bits on 2 threads). Gemma's GeGLU likewise."""
    from splitserve.engine.model.layers import _gated_by_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gate_up = torch.randn(343, 192, generator=torch.Generator().manual_seed(0))
        gate, up = gate_up[:, :96], gate_up[:, 96:]
        rows = torch.cat([_gated_by_rows(gate[i : i + 1], up[i : i + 1], gelu) for i in range(343)])
        assert torch.equal(_gated_by_rows(gate, up, gelu), rows)
    finally:
        torch.set_num_threads(threads)


def test_export_writes_what_transformers_loads_with_the_same_logits(tmp_path, checkpoint):
    config = check_export(checkpoint, tmp_path)
    assert replace(load_hf_checkpoint(tmp_path)[0], name=config.name) == config  # experts, routing, dense layers


def test_the_pod_exports_tokens_per_expert(llm):
    from prometheus_client.parser import text_string_to_metric_families

    from splitserve.runtime.metrics import PodMetrics

    metrics = PodMetrics("mixed", "moe")
    model = llm.engine.runner.model
    metrics.count_expert_tokens(lambda: tokens_routed(model.layers))
    scored(llm, [OTHERS[1]], max_tokens=2)
    text = metrics.exposition()[0].decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "splitserve_moe_expert_tokens"]
    samples = {(s.labels["layer"], s.labels["expert"]): s.value for s in family.samples if s.name.endswith("_total")}
    routed = tokens_routed(model.layers)
    assert samples == {(str(i), str(e)): n for i, counts in routed.items() for e, n in enumerate(counts)}
    assert sum(samples.values()) > 0


# ---- expert parallelism ----------------------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("model_type, parallel", [("qwen2_moe", "tensor"), ("qwen3_moe", "pipeline")])
def test_two_ranks_give_one_process_answer(tmp_path, model_type, parallel):
    """Qwen2-MoE over 2 tensor-parallel ranks, expert-parallel in its routed layer: attention heads split, each rank
    holding 4 of the 8 experts and computing their rows for every token, and half of the shared expert's width (as the
    dense layer's MLP), the all-reduce summing the two halves. Qwen3-MoE over 2 pipeline ranks: the second's one layer
    is the routed one (renumbered 0 on its stage). The same greedy tokens as one process, prompt logprobs within 1e-4
    (the sums round in another order)."""
    def inspect(llm) -> None:
        if parallel == "tensor":
            moe = llm.engine.runner.model.layers[1].mlp
            assert sorted(moe.experts, key=int) == ["0", "1", "2", "3"]
            assert moe.shared_expert.intermediate_size == 64

    check_ranks_agree(Checkpoint(tmp_path, SHAPES[model_type], model_type), {f"{parallel}_parallel_size": 2},
                      inspect=inspect)


@pytest.mark.e2e
@pytest.mark.parametrize("model_type", ["qwen2_moe", "mixtral"])
def test_tokens_sent_to_their_experts_ranks_give_one_process_answer(tmp_path, model_type):
    """``moe_dispatch="all_to_all"`` over 2 tensor-parallel ranks: each rank routes half the tokens, sends their rows
    to the rank holding each expert and gets the outputs back, and the ranks gather the tokens (Qwen2-MoE's shared
    expert summed by the all-reduce); the same greedy tokens as one process, prompt logprobs within 1e-4. The
    collectives it ran are gloo's all-to-alls and all-gathers, counted beside the attention's all-reduces."""
    def inspect(llm) -> None:
        model = llm.engine.runner.model
        assert all(layer.mlp.dispatch is not None for layer in model.layers if isinstance(layer.mlp, MoE))
        assert model.group.counts.calls > 0

    check_ranks_agree(Checkpoint(tmp_path, SHAPES[model_type], model_type),
                      {"tensor_parallel_size": 2, "moe_dispatch": "all_to_all"}, inspect=inspect)


# ---- disaggregated ---------------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_prefill_and_a_decode_pod_answer_as_the_offline_engine(tmp_path, start_cluster):
    """``splitserve up`` of the Qwen3-MoE checkpoint with one prefill and one decode pod: every prompt prefills on the
    prefill pod, its KV crosses to the decode pod, the greedy tokens are the offline engine's, each pod counts the
    tokens its routed layer sent to every expert, and every block is free after."""
    from tests.reliability.live_cluster import pod_counter

    with PrefillDecodeCluster(start_cluster, tmp_path / "up", Checkpoint(tmp_path / "qwen3_moe",
                                                                         SHAPES["qwen3_moe"])) as up:
        for pod in up.cluster.pods:
            routed = [pod_counter(up.cluster, pod, "splitserve_moe_expert_tokens_total", layer="1", expert=str(e))
                      for e in range(8)]
            assert min(routed) > 0, (pod.name, routed)
