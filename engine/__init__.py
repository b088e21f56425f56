"""The model runtime shared by the prefill and decode pods, and the offline API.

    from splitserve.engine import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

The core, in the order a request meets it:

- ``llm.py``: the offline API (``LLM.generate`` / ``.chat``), text at the edge;
- ``llm_engine.py``: the engine loop (``add_request``, ``step``), and the hand-off hooks the pods use;
- ``engine_loop.py``: one engine on its own thread, talking to the asyncio servers;
- ``sequence.py``: a request inside the engine: its tokens, blocks and state;
- ``scheduler.py``: continuous batching, which sequences run next and how many of their tokens;
- ``prefill_budget.py``: how many prompt tokens a step may prefill beside decodes that keep their TPOT;
- ``step_time.py``: the step-time model, fitted online on the pod;
- ``block_manager.py``: the paged KV block pool and its prefix cache;
- ``kv_groups.py``: the two block pools of a model that mixes sliding-window and full-attention layers, as one;
- ``kv_cache.py``: the K and V pools per layer (``PagedKVCache``), their rows in one of ``kv_formats/``'s formats;
- ``model_runner.py``: a scheduled batch into tensors, the model run, the sampling;
- ``model/``: the Llama core decoder (``llama.py``, ``layers.py``), the registry of architectures built on it
  (``architectures/``: Llama, Mistral, Qwen2, Qwen3 and their MoEs, Mixtral), paged attention and its metadata
  (``attention.py``), RoPE (``rotary.py``), and prefill in bfloat16 where the CPU multiplies it natively, on the
  kernels' own tiling (``bf16_prefill.py``);
- ``config.py``: the engine's config dataclasses (model, cache, scheduler, engine).

Around it, a subpackage per concept: ``weights/`` (checkpoint formats and quantized weights), ``text/`` (tokenizer,
detokenizer, stop strings), ``sampling/`` (``SamplingParams``, ``Sampler``), ``speculative/`` (proposers and
verification), ``structured_output/`` (grammars and token masks), ``kernels/`` (native CPU kernels, CPU features),
``parallel/`` (tensor parallelism: the model split over rank processes), ``kv_formats/`` (K/V in fewer bytes: the pool's
int8 rows, float16 scales).
"""

from splitserve.engine.sampling.params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # The engine pulls in torch and the model code; import it only when asked, so that light users of
    # `engine` (SamplingParams in the router) stay light.
    if name in ("LLM", "RequestOutput"):
        from splitserve.engine import llm

        return getattr(llm, name)
    if name == "LLMEngine":
        from splitserve.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
