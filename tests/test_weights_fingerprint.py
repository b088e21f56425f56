"""The peer's identity in the KV handshake (issue 35): beside its boot id (a restart) and its weights' format, each pod
names the checkpoint its weights came from (``weights_fingerprint``), and a peer loaded from other weights of the very
same shape is refused with FAILED_PRECONDITION naming it, never fed KV it did not compute the same way."""

import dataclasses

import grpc
import pytest

from splitserve.kvtransfer.handshake import FINGERPRINT_SAMPLE_BYTES, KVLayout, check_compatible, weights_fingerprint
from splitserve.runtime.errors import StatusError
from splitserve.v1 import kv_transfer_pb2
from tests.test_pods import pods as real_pods  # noqa: F401  (the fixture: a prefill and a decode pod, in-process)
from tests.test_pods import rpc_error


@pytest.mark.model
def test_the_fingerprint_names_the_checkpoint_not_its_format_and_reads_little_of_it(tmp_path):
    assert weights_fingerprint("tiny-random", seed=0) == weights_fingerprint("tiny-random", seed=0)
    assert weights_fingerprint("tiny-random", seed=0) != weights_fingerprint("tiny-random", seed=1)
    assert weights_fingerprint("smollm2-135m") not in (weights_fingerprint("tiny-random"), "")
    one, other = tmp_path / "one", tmp_path / "other"
    for directory, last_byte in ((one, 0), (other, 1)):  # two checkpoints differing in their last weight byte
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(bytes(3 * FINGERPRINT_SAMPLE_BYTES) + bytes([last_byte]))
        (directory / "config.json").write_text("{}")
    assert weights_fingerprint(str(one)) != weights_fingerprint(str(other))


def test_layouts_that_differ_only_in_their_weights_are_incompatible():
    layout = KVLayout("m", 2, 2, 16, 16, "float32", weights_fingerprint="aaaa")
    other = dataclasses.replace(layout, weights_fingerprint="bbbb")
    assert other.compat_hash != layout.compat_hash  # a push header after a restart with other weights fails too
    with pytest.raises(StatusError) as caught:
        check_compatible(layout, other, other.compat_hash, "none", ["none"])
    assert (caught.value.code, caught.value.message) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                         "weights_fingerprint: sender 'bbbb', receiver 'aaaa'")
    quantized = dataclasses.replace(layout, quantization="int8")  # the format may differ, the weights may not
    check_compatible(layout, quantized, quantized.compat_hash, "none", ["none"])


def test_a_decode_pod_refuses_a_prefill_pod_loaded_from_other_weights(real_pods):  # noqa: F811
    pods = real_pods
    layout = KVLayout.of_engine(pods.prefill_pod.engine)
    assert layout.weights_fingerprint == weights_fingerprint("tiny-random", seed=0)
    reseeded = dataclasses.replace(layout, weights_fingerprint=weights_fingerprint("tiny-random", seed=1))
    error = rpc_error(pods.kv.Handshake, kv_transfer_pb2.HandshakeRequest(
        layout=reseeded.to_proto(), compat_hash=reseeded.compat_hash, codec="none"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details() == (f"weights_fingerprint: sender {reseeded.weights_fingerprint!r}, "
                               f"receiver {layout.weights_fingerprint!r}")
