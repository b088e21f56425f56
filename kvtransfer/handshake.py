"""The handshake: do a prefill pod and a decode pod hold interchangeable KV?

A prefill pod calls ``KVTransfer.Handshake`` once per (decode pod, codec) before its first push there:

    sender:   HandshakeRequest(layout, compat_hash(layout), codec)
    receiver: check_compatible(receiver's layout, request, accepted codecs)
                -> FAILED_PRECONDITION naming the first field that differs ("num_kv_heads: sender 4, receiver 2"),
                   or the codec it does not accept
              -> HandshakeResponse(its layout, accepted codecs, its compat hash)

KV is interchangeable when the model, its weights and its attention shape agree: model name, layers, KV heads, head
dim and the weights' fingerprint (``COMPAT_FIELDS``, digested into ``compat_hash``; ``weights_fingerprint``: a digest
of the checkpoint the weights came from, so that pods of one shape loaded from other weights, a fine-tune or another
revision, refuse each other). Block size and cache dtype may differ: chunks address tokens,
not blocks, and the receiver converts dtypes. So may the tensor-parallel degree (``tensor_parallel_size``, and
``rank_kv_heads``, the KV heads each rank holds, engine/parallel/layout.py): a tensor-parallel sender streams each
rank's KV heads as chunks of their own (``KVChunk.heads``; one process's chunks carry every head) and a receiver
writes each chunk's heads into the ranks that own them, splitting or assembling ranges as its degree needs
(engine/parallel/sharded_kv_cache.py), so any two degrees map; a layout whose ranges do not hold every KV head
exactly (missing, overlapping other than a replicated group's, out of range) is refused. The
weights' format (``quantization``) may differ too: each side learns the
other's from the handshake and says so in its log, since answers may then differ from a single-format
deployment's (docs/quantization.md). Each push's header repeats the hash, which catches a decode pod restarted with
another model since the handshake, and both pods' ``BOOT_ID``s, which catch a decode pod restarted at all: the push
fails FAILED_PRECONDITION and the sender handshakes again. The handshake also tells the sender whether the two pods
share a host and a shared-memory directory (kvtransfer/shm.py), which picks the link's transport.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import grpc

from splitserve.engine.block_manager import window_start
from splitserve.engine.kernels.cpu_features import matrix_flags
from splitserve.engine.kv_groups import pushed_window
from splitserve.engine.parallel.layout import plan_shards
from splitserve.engine.text.tokenizer_files import resolve_model_name
from splitserve.runtime.errors import StatusError
from splitserve.v1 import kv_transfer_pb2

logger = logging.getLogger(__name__)

COMPAT_FIELDS = ("model_name", "num_layers", "num_kv_heads", "head_dim", "weights_fingerprint")
_COMPAT_HASH_VERSION = "splitserve-kv-v2"  # bump when the digest's input changes
FINGERPRINT_SAMPLE_BYTES = 1 << 16  # read from each end of each weights file: a different checkpoint differs there
BOOT_ID = uuid.uuid4().hex  # this process's: new at every start, so a peer tells a restarted pod from the one it knew


@dataclass(frozen=True)
class KVLayout:
    """The shape of a pod's KV cache, and the format of the weights that computed it."""

    model_name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    cache_dtype: str  # "float32", "bfloat16", "float16"
    quantization: str = "none"  # the weights' format (engine/config.py QUANTIZATIONS); not in the compat hash
    weights_fingerprint: str = ""  # ``weights_fingerprint()`` of the checkpoint; in the compat hash
    # What the pod's prompt tokens' products compute in (float32, bfloat16: ``LLMEngine.prefill_compute``) and the
    # CPU features that chose it (engine/kernels/cpu_features.py); not in the compat hash: the KV is interchangeable,
    # its bits are not float32's where a side prefills in bf16.
    prefill_compute_dtype: str = ""
    cpu_features: tuple[str, ...] = ()
    tensor_parallel_size: int = 1  # the engine's ranks; not in the compat hash: any degrees map
    rank_kv_heads: tuple[tuple[int, int], ...] = ()  # each rank's KV heads [start, end); () from one process
    # The sliding window under which it keeps a pushed prompt's KV from ``window_start`` on, and in which layers
    # (engine/kv_groups.py ``pushed_window``; 0 and (): all of it): the sender pushes only that. Not in the hash.
    kv_window: int = 0
    kv_window_layers: tuple[int, ...] = ()

    @classmethod
    def of_engine(cls, engine) -> "KVLayout":
        """The layout of an ``LLMEngine``'s cache."""
        model = engine.model_config
        cache = engine.config.cache
        size = engine.config.tensor_parallel_size
        window, window_layers = pushed_window(engine.block_manager, engine.runner.kv_cache)
        return cls(model.name, model.num_layers, model.num_kv_heads, model.head_dim, cache.block_size,
                   cache.cache_dtype, engine.config.quantization,
                   weights_fingerprint(engine.config.model, engine.config.seed),
                   prefill_compute_dtype=engine.prefill_compute, cpu_features=matrix_flags(),
                   tensor_parallel_size=size,
                   rank_kv_heads=tuple(shard.kv_heads for shard in plan_shards(model, size)),
                   kv_window=window, kv_window_layers=window_layers)

    @classmethod
    def from_proto(cls, message: kv_transfer_pb2.KVLayout) -> "KVLayout":
        return cls(message.model_name, message.num_layers, message.num_kv_heads, message.head_dim,
                   message.block_size, message.cache_dtype, message.quantization, message.weights_fingerprint,
                   prefill_compute_dtype=message.prefill_compute_dtype, cpu_features=tuple(message.cpu_features),
                   tensor_parallel_size=message.tensor_parallel_size or 1,
                   rank_kv_heads=tuple((r.start, r.end) for r in message.rank_kv_heads),
                   kv_window=message.kv_window, kv_window_layers=tuple(message.kv_window_layers))

    def to_proto(self) -> kv_transfer_pb2.KVLayout:
        return kv_transfer_pb2.KVLayout(model_name=self.model_name, num_layers=self.num_layers,
                                        num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                        block_size=self.block_size, cache_dtype=self.cache_dtype,
                                        quantization=self.quantization,
                                        weights_fingerprint=self.weights_fingerprint,
                                        prefill_compute_dtype=self.prefill_compute_dtype,
                                        cpu_features=self.cpu_features,
                                        tensor_parallel_size=self.tensor_parallel_size,
                                        rank_kv_heads=[kv_transfer_pb2.KVHeadRange(start=a, end=b)
                                                       for a, b in self.rank_kv_heads],
                                        kv_window=self.kv_window, kv_window_layers=self.kv_window_layers)

    def kept_from(self, num_tokens: int) -> tuple[int, frozenset[int]]:
        """Where this layout's pod keeps a pushed prompt of ``num_tokens`` from, and in which layers: a push there
        carries [that token, num_tokens) in those layers, the whole prompt in the others ((0, none): all of it)."""
        if not self.kv_window:
            return 0, frozenset()
        return window_start(num_tokens, self.kv_window, self.block_size), frozenset(self.kv_window_layers)

    @property
    def compat_hash(self) -> str:
        """Hex digest of ``COMPAT_FIELDS``: equal hashes, interchangeable KV."""
        text = "\n".join([_COMPAT_HASH_VERSION, *(f"{name}={getattr(self, name)}" for name in COMPAT_FIELDS)])
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def weights_fingerprint(model: str, seed: int = 0) -> str:
    """A digest of the checkpoint ``model`` names (engine/weights/model_files.py's names), the same in every format
    its weights are kept in: each weights file's name, size and first and last ``FINGERPRINT_SAMPLE_BYTES`` (a
    whole-file hash would read hundreds of megabytes at every start); the seed of a random-weight model."""
    kind, path = resolve_model_name(model)
    digest = hashlib.sha256(f"{kind}\n".encode())
    if path is None:
        digest.update(f"seed={seed}".encode())
        return digest.hexdigest()[:16]
    weight_files = (".safetensors", ".bin")
    files = [path] if path.is_file() else sorted(p for p in Path(path).iterdir() if p.suffix in weight_files)
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}\n".encode())
        with file.open("rb") as weights:
            digest.update(weights.read(FINGERPRINT_SAMPLE_BYTES))
            weights.seek(max(0, size - FINGERPRINT_SAMPLE_BYTES))
            digest.update(weights.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def check_compatible(receiver: KVLayout, sender: KVLayout, sender_hash: str, codec: str,
                     accepted_codecs: Iterable[str]) -> None:
    """Raise FAILED_PRECONDITION naming the first mismatch: a layout field, the hash, or the codec (an empty
    codec checks the layout only)."""
    for name in COMPAT_FIELDS:
        mine, theirs = getattr(receiver, name), getattr(sender, name)
        if mine != theirs:
            raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{name}: sender {theirs!r}, receiver {mine!r}")
    if sender_hash != receiver.compat_hash:
        # Same fields, different digest: the two pods run different versions of the handshake.
        raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"compat_hash: sender {sender_hash!r}, receiver {receiver.compat_hash!r}")
    unmapped = unmapped_heads(sender)
    if unmapped:
        raise StatusError(grpc.StatusCode.FAILED_PRECONDITION, f"rank_kv_heads: the sender's {unmapped}")
    accepted = list(accepted_codecs)
    if codec and codec not in accepted:
        raise StatusError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"codec: {codec!r} is not accepted by the receiver; accepted: {', '.join(accepted)}")


def unmapped_heads(layout: KVLayout) -> str:
    """Why ``layout``'s ranks' KV heads cannot be mapped to the model's (empty: they can): the ranges must be one
    per rank, within [0, num_kv_heads), and hold every head, each in one contiguous run of ranks (a replicated group,
    more ranks than KV heads, holds its head on consecutive ranks)."""
    ranges = layout.rank_kv_heads or ((0, layout.num_kv_heads),)
    if len(ranges) != layout.tensor_parallel_size:
        return f"{len(ranges)} ranges for {layout.tensor_parallel_size} ranks"
    bad = [r for r in ranges if not 0 <= r[0] < r[1] <= layout.num_kv_heads]
    if bad:
        return f"ranges {bad} are not within the model's {layout.num_kv_heads} KV heads"
    held = [h for a, b in ranges for h in range(a, b)]
    runs = [h for i, h in enumerate(held) if i == 0 or h != held[i - 1]]  # a replicated head counts once
    if runs != list(range(layout.num_kv_heads)):
        return f"ranges {list(ranges)} do not hold KV heads 0..{layout.num_kv_heads - 1} once each, in order"
    return ""


def note_formats(here: KVLayout, peer: KVLayout, peer_name: str) -> None:
    """Log, at each handshake, a peer whose weights are in another format than this pod's: allowed (the KV layout
    is what must match), but its answers may then differ from a single-format deployment's."""
    if peer.quantization != here.quantization:
        logger.info("%s keeps its weights as %r, this pod as %r: KV is interchangeable, answers may differ from "
                    "those of pods of one format (docs/quantization.md)", peer_name, peer.quantization,
                    here.quantization)
    if peer.prefill_compute_dtype != here.prefill_compute_dtype:
        logger.info("%s prefills in %s (CPU features: %s), this pod in %s: KV is interchangeable, a prompt's K/V "
                    "and answers depend on which pod prefilled it", peer_name, peer.prefill_compute_dtype or "?",
                    ",".join(peer.cpu_features) or "none", here.prefill_compute_dtype)
