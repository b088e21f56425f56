"""Sampling: ``params.py`` (``SamplingParams``: what a request asks for, and when it stops) and ``sampler.py`` (the
``Sampler`` that turns one step's logits into one token per sequence).
"""
