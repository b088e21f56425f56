"""Speculative decoding: proposers (n-gram, response cache, a draft model) and the verification of their drafts."""
