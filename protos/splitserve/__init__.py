"""Namespace of the splitserve protocol's versioned packages (``protos.splitserve.v1``)."""
