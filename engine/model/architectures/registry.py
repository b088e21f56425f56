"""The table of served architectures and the look-ups the loaders call: ``for_hf_config`` (a ``config.json``) and
``for_gguf`` (a GGUF file's ``general.architecture``). Anything else is refused in one line naming what is served:
an engineer who brings a Gemma or a DeepSeek learns at load, not from wrong tokens."""

from __future__ import annotations

from splitserve.engine.model.architectures.architecture import Architecture, HFConfig
from splitserve.engine.model.architectures.gemma import GEMMA2, GEMMA3_TEXT
from splitserve.engine.model.architectures.llama import LLAMA
from splitserve.engine.model.architectures.mistral import MISTRAL
from splitserve.engine.model.architectures.mixtral import MIXTRAL
from splitserve.engine.model.architectures.phi3 import PHI3
from splitserve.engine.model.architectures.qwen2 import QWEN2
from splitserve.engine.model.architectures.qwen2_moe import QWEN2_MOE
from splitserve.engine.model.architectures.qwen3 import QWEN3
from splitserve.engine.model.architectures.qwen3_moe import QWEN3_MOE

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3_TEXT, QWEN3_MOE, MIXTRAL, QWEN2_MOE)}
# By a GGUF file's general.architecture and whether it has experts: llama.cpp writes Mixtral as ``llama`` with
# ``llama.expert_count``.
GGUF_ARCHITECTURES: dict[tuple[str, bool], Architecture] = {
    (a.gguf_name, a.experts is not None): a for a in ARCHITECTURES.values() if a.gguf_name}


class UnsupportedArchitecture(ValueError):
    """A checkpoint of an architecture the registry has no entry for."""


def for_hf_config(hf: HFConfig, source: str) -> Architecture:
    """The entry of a ``config.json``, by its ``model_type`` (as vLLM by ``architectures``, transformers by
    ``model_type``; the two agree for every entry)."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        named = " ".join(hf.get("architectures") or [])
        raise UnsupportedArchitecture(
            f"{source}: unsupported architecture {model_type!r}{f' ({named})' if named else ''}; splitserve serves "
            f"model types {', '.join(sorted(ARCHITECTURES))} (docs/models.md)")
    return ARCHITECTURES[model_type]


def for_gguf(name: str, source: str, experts: bool = False) -> Architecture:
    """The entry of a GGUF file's ``general.architecture`` (``experts``: the file has ``{name}.expert_count``)."""
    if (name, experts) not in GGUF_ARCHITECTURES:
        served = ", ".join(sorted(f"{n}{' with experts' if e else ''}" for n, e in GGUF_ARCHITECTURES))
        what = f"{name!r}{' with experts' if experts else ''}"
        raise UnsupportedArchitecture(f"{source}: unsupported GGUF architecture {what}; splitserve reads GGUF "
                                      f"architectures {served} (docs/models.md)")
    return GGUF_ARCHITECTURES[name, experts]


def for_model_config(architecture: str) -> Architecture:
    """The entry a loaded ``ModelConfig`` came from (its ``architecture``), e.g. to export it back."""
    return ARCHITECTURES[architecture]
