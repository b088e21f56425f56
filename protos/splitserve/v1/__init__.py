"""Package ``splitserve.v1``: the ``.proto`` files and their generated ``*_pb2.py``, ``*_pb2.pyi`` and
``*_pb2_grpc.py`` modules (written by ``python -m splitserve.protos.generate``, never by hand).

- ``common.proto``: SamplingParams, logprobs, FinishReason, Usage, Timings, PodLoad, Abort/GetLoad shapes
- ``generate.proto``: service ``Generation`` (the router's client-facing streaming API)
- ``prefill.proto``: service ``Prefill`` (prefill pods)
- ``kv_transfer.proto``: service ``KVTransfer`` (decode pods take in prompt KV from prefill pods)
- ``decode.proto``: service ``Decode`` (decode and mixed pods)
- ``pod_status.proto``: service ``PodStatus`` (a pod's load and health, pushed to the router)
"""
