"""splitserve's gRPC protocol: the ``.proto`` files of package ``splitserve.v1`` and the Python modules
generated from them, side by side in ``protos/splitserve/v1/``.

- ``convert.py``: the engine's objects <-> the ``splitserve.v1`` messages (sampling parameters, logprobs, finish
  reasons);
- ``generate.py``: regenerates the generated modules, or checks that they are current.

Import the generated modules as ``from splitserve.v1 import generate_pb2, generate_pb2_grpc``.
Regenerate them with ``python -m splitserve.protos.generate`` (``make protos``) after editing a ``.proto``;
``python -m splitserve.protos.generate --check`` fails when the committed modules are stale.
"""
