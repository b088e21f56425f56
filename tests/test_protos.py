"""The protocol package: generated modules match the .proto files, and they work on a real gRPC server."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
GENERATION_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def run_check(repo_root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(repo_root / "protos" / "generate.py"), "--check"], cwd=repo_root, capture_output=True,
        text=True
    )


def test_generated_modules_match_the_protos():
    result = run_check(REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("mutation", ["edit a proto", "leave a stale module"])
def test_drift_check_fails_on_a_stale_tree(tmp_path, mutation):
    # A copy, so that the repository's own files stay untouched; the copy's generate.py checks the copy.
    shutil.copytree(REPO_ROOT / "protos", tmp_path / "protos", ignore=shutil.ignore_patterns("__pycache__"))
    package_dir = tmp_path / "protos" / "splitserve" / "v1"
    if mutation == "edit a proto":
        with open(package_dir / "common.proto", "a") as f:
            f.write("\nmessage DriftProbe { int32 x = 1; }\n")
        expected = "common_pb2.py (differs)"
    else:
        (package_dir / "removed_pb2.py").write_text("# generated from a .proto that is gone\n")
        expected = "removed_pb2.py (stale"
    result = run_check(tmp_path)
    assert result.returncode == 1
    assert expected in result.stdout


def test_optional_fields_tell_unset_from_zero():
    params = common_pb2.SamplingParams(temperature=0.0, seed=0)
    assert params.HasField("temperature") and params.HasField("seed")  # greedy, seed 0: both meaningful
    assert not params.HasField("top_p") and not params.HasField("max_tokens") and not params.HasField("logprobs")


class EchoGeneration(generate_pb2_grpc.GenerationServicer):
    """Streams the prompt's token ids back as one chunk, then completes."""

    def Generate(self, request, context):
        ids = list(request.token_ids.ids)
        yield generate_pb2.GenerateResponse(request_id=request.request_id, chunk=generate_pb2.Chunk(token_ids=ids))
        yield generate_pb2.GenerateResponse(
            request_id=request.request_id,
            complete=generate_pb2.Complete(
                finish_reason=common_pb2.FINISH_REASON_STOP,
                stop_token_id=ids[-1],
                usage=common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(ids)),
            ),
        )


@pytest.fixture
def channel():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    generate_pb2_grpc.add_GenerationServicer_to_server(EchoGeneration(), server)
    health_servicer = health.HealthServicer()
    health_servicer.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
        yield chan
    server.stop(grace=None)


def test_generated_code_serves_streaming_health_and_reflection(channel):
    request = generate_pb2.GenerateRequest(request_id="r1", token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]))
    responses = list(generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=10))
    assert [r.WhichOneof("response") for r in responses] == ["chunk", "complete"]
    assert list(responses[0].chunk.token_ids) == [5, 6, 7]
    assert responses[1].complete.WhichOneof("stop_reason") == "stop_token_id"
    assert responses[1].complete.usage.prompt_tokens == 3

    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE))
    assert check.status == health_pb2.HealthCheckResponse.SERVING

    # Reflection serves the descriptors with their imports: a client resolves the service from them alone.
    reflection_db = ProtoReflectionDescriptorDatabase(channel)
    assert GENERATION_SERVICE in reflection_db.get_services()
    service = descriptor_pool.DescriptorPool(reflection_db).FindServiceByName(GENERATION_SERVICE)
    assert service.methods_by_name["Generate"].output_type.fields_by_name["complete"].message_type.name == "Complete"
