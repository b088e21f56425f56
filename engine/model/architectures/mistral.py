"""Mistral: the Llama core, with a sliding window in the config. Where the window is at least the context (or null,
as from v0.2 on) attention is full; a window a sequence can outgrow (v0.1: 4096 of 32768) windows every layer
(``ModelConfig.layer_windows``, attention.py), its blocks all kept in the paged cache. llama.cpp writes Mistral files
as its ``llama`` architecture, so a Mistral GGUF loads through that entry."""

from splitserve.engine.model.architectures.architecture import Architecture, configure_sliding_windows

MISTRAL = Architecture("mistral", "MistralForCausalLM", configure=configure_sliding_windows)
