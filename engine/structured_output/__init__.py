"""Structured outputs (guided decoding): ``grammar.py`` (a request's grammar, compiled, and one matcher per sequence)
and ``masks.py`` (a step's token masks, computed while the model runs).
"""
