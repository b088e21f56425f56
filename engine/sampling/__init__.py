"""Sampling: what a request asks for (``SamplingParams``) and the ``Sampler`` that turns logits into tokens."""
