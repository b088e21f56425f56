"""Speculative decoding: ``proposer.py`` (the proposers, n-gram and response cache, and the verification of their
drafts in one model step) and ``draft_model.py`` (the ``draft`` method's smaller model on its own paged KV cache).
"""
