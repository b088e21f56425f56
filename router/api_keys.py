"""API keys: which clients may use the router's APIs. One check for both: the HTTP API reads the key from the
``Authorization: Bearer <key>`` header, the gRPC API from the ``authorization`` metadata entry of the same form.

Keys come from ``RouterConfig.api_keys`` (in production the ``SPLITSERVE_API_KEYS`` environment variable,
comma-separated, from a Kubernetes Secret). A presented key is compared with every configured key in constant
time, so that neither the answer nor its timing tells how much of a key was right or which key came close.
"""

from __future__ import annotations

import hmac


class APIKeys:
    """The keys clients may present; empty: no authentication."""

    def __init__(self, keys: list[str]):
        self._keys = [key.encode() for key in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def problem(self, authorization: str | None) -> str | None:
        """None when ``authorization`` ("Bearer <key>") carries a valid key, else what is wrong with it, for the
        client (never the key itself)."""
        if authorization is None:
            return "an API key is required: send 'Authorization: Bearer <key>'"
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "the authorization must be 'Bearer <key>'"
        return None if self.matches(key.strip().encode()) else "the API key is not valid"

    def matches(self, key: bytes) -> bool:
        matched = False
        for candidate in self._keys:  # every key, every time: no early exit
            matched |= hmac.compare_digest(key, candidate)
        return matched
