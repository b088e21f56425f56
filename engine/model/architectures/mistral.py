"""Mistral: the Llama core, with a sliding window in the config. Where the window is at least the context (or null,
as from v0.2 on) attention is full and the core serves it; a window a sequence can outgrow is refused until the
paged cache frees blocks that leave it. llama.cpp writes Mistral files as its ``llama`` architecture, so a Mistral
GGUF loads through that entry."""

from splitserve.engine.model.architectures.architecture import Architecture, refuse_sliding_window

MISTRAL = Architecture("mistral", "MistralForCausalLM", refuse=(refuse_sliding_window,))
