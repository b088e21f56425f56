"""Structured outputs (guided decoding): grammars compiled per request and the token masks they put on each step."""
