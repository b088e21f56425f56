"""Speculative decoding: ``proposer.py`` (the proposers, n-gram and response cache, and the verification of their
drafts in one model step), ``state.py`` (a request's speculation state, ``DraftState``, as its sequence carries it:
its n-gram index and draft length) and ``draft_model.py`` (the ``draft`` method's smaller model on its own paged KV
cache).
"""
