"""The model runtime shared by the prefill and decode pods, and the offline API.

    from splitserve.engine import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
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
