"""``splitserve generate "text"``: stream an answer from a running router over gRPC (``splitserve.v1.Generation``).

Text is printed as it streams; a last line gives the finish reason, token counts, TTFT and the decode rate.
The prompt is sent as one user turn of a chat (the router applies the model's chat template); ``--raw`` sends it
as plain text to be continued. ``--tls-ca-file`` (and, for mutual TLS, ``--tls-cert-file`` / ``--tls-key-file``)
connects over TLS; ``--api-key`` (or ``SPLITSERVE_API_KEY``) authenticates to a router that requires a key.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import grpc

from splitserve.runtime.transport import TLSConfig, open_blocking_channel
from splitserve.v1 import common_pb2, generate_pb2, generate_pb2_grpc


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="splitserve generate", description="Stream an answer from a router.")
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--router", default="127.0.0.1:50051", help="router gRPC address host:port")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--raw", action="store_true", help="send the text as is, without the ChatML user turn")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before DEADLINE_EXCEEDED")
    parser.add_argument("--tls-ca-file", default="", help="connect over TLS, verifying the router with this CA")
    parser.add_argument("--tls-cert-file", default="", help="client certificate, for mutual TLS")
    parser.add_argument("--tls-key-file", default="", help="the client certificate's private key")
    parser.add_argument("--api-key", default=os.environ.get("SPLITSERVE_API_KEY", ""),
                        help="API key of the router (default: $SPLITSERVE_API_KEY)")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = _parse(argv)
    params = common_pb2.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, stop=args.stop)
    if args.seed is not None:
        params.seed = args.seed
    if args.raw:
        request = generate_pb2.GenerateRequest(text=args.prompt, sampling_params=params)
    else:
        chat = generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user", content=args.prompt)])
        request = generate_pb2.GenerateRequest(chat=chat, sampling_params=params)
    start = time.perf_counter()
    first_token_at = None
    tokens = 0
    tls = TLSConfig(args.tls_cert_file, args.tls_key_file, args.tls_ca_file)
    try:
        tls.check(serves=False)
    except ValueError as err:
        sys.exit(f"error: {err}")
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    with open_blocking_channel(args.router, tls) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    first_token_at = first_token_at or time.perf_counter()
                    tokens += len(response.chunk.token_ids)
                    print(response.chunk.text, end="", flush=True)
                elif kind == "complete":
                    _summary(response.complete, start, first_token_at, tokens)
                else:
                    sys.exit(f"\nerror {grpc.StatusCode(_code(response.error.code)).name}: {response.error.message}")
        except grpc.RpcError as err:
            sys.exit(f"error {err.code().name}: {err.details()}")


def _code(number: int):
    return next(c for c in grpc.StatusCode if c.value[0] == number)


def _summary(complete, start: float, first_token_at: float | None, tokens: int) -> None:
    end = time.perf_counter()
    reason = common_pb2.FinishReason.Name(complete.finish_reason).removeprefix("FINISH_REASON_").lower()
    ttft = (first_token_at or end) - start
    rate = (tokens - 1) / (end - first_token_at) if first_token_at and tokens > 1 and end > first_token_at else 0.0
    print(f"\n[{reason}; {complete.usage.prompt_tokens} prompt + {complete.usage.completion_tokens} output tokens; "
          f"TTFT {ttft * 1e3:.0f} ms; {rate:.1f} tok/s]", file=sys.stderr)
