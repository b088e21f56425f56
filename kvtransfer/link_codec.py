"""``kv_codec=auto``: the prefill pod picks, per decode pod, the codec that moves a prompt's KV soonest over that
link, among the codecs whose measured quality clears ``kv_min_agreement`` (as CacheGen adapts its bitrate to the
link).

A request's path through this module, on the prefill pod:

    QualityTable.load(path)                 once: the shipped table (kvtransfer/quality/<model>.json, written by
                                            ``bench codecs --quality-table``): per cache dtype, per codec, the
                                            teacher-forced top-1 agreement with the lossless path (every scored
                                            position of 1024-token contexts; a table written before it had the
                                            greedy agreement until the first divergence) and the encode/decode
                                            speed
    LinkCodecChooser.choose(address, T, accepted)   per request with kv_codec "auto": for each codec that clears the
                                            floor and the decode pod accepts (its handshake says which),
                                            expected seconds = wire bytes of T tokens / the link's measured
                                            throughput + raw bytes / encode speed + raw bytes / decode speed;
                                            the least wins. A link not measured yet counts as infinitely fast (so
                                            the first push goes uncompressed, and measures it)
    LinkCodecChooser.observe(address, bytes, seconds)   after each push: the bytes on the wire and the seconds the
                                            link took to carry them (write backpressure and the wait for the
                                            acknowledgement), folded into the link's seconds per byte (EWMA)

Wire bytes are exact for the codecs with a fixed layout (``encoded_nbytes`` of the prompt's shape) and the inner
codec's for ``+zstd`` (an upper bound). Codecs the decode pod does not accept fail its handshake, as any codec.

On a pool that stores a codec's form (an int8 pool and the ``int8`` codec: ``KVCodec.pool_dtype``), that codec is a
lossless candidate that costs no encoding or decoding: it carries the pool's rows as they lie, and it is the smallest,
so it wins on every link (on a link not measured yet, by name among the free). It is also what ``none`` sends from
such a pool (``lossless``): ``none`` asks for the pool's KV without further loss, and its rows as they lie are that,
where the pool's values as float32 would be four times the bytes.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.kvtransfer.codecs import get_codec
from splitserve.kvtransfer.codecs.base import CACHE_DTYPES, dtype_name
from splitserve.kvtransfer.handshake import KVLayout
from splitserve.runtime.kv_codecs import KV_CODECS, ZSTD_SUFFIX

QUALITY_DIR = Path(__file__).resolve().parent / "quality"
# Weight of the newest measurement in a link's seconds per byte (averaged, not bytes per second: the time a push
# takes is linear in it, and one slow push then counts at once).
THROUGHPUT_SMOOTHING = 0.7
LOSSLESS_CODECS = ("none", "none+zstd")  # always eligible, whatever the table says


@dataclass(frozen=True)
class CodecQuality:
    # Share of positions whose next token is the lossless path's (teacher-forced top-1): a few near ties, which
    # any rounding flips, cost a fraction of a point here, where greedy decoding until the first divergence lost
    # the rest of each continuation to them (bf16 rounding alone kept 90%).
    agreement: float
    encode_mb_s: float  # MB of cache-dtype KV per second, as bench codecs measured them
    decode_mb_s: float


class QualityTable:
    """Per cache dtype, per codec, what ``bench codecs`` measured."""

    def __init__(self, model: str, by_dtype: dict[str, dict[str, CodecQuality]]):
        self.model = model
        self._by_dtype = by_dtype

    @classmethod
    def load(cls, path: str | Path) -> "QualityTable":
        data = json.loads(Path(path).read_text())
        return cls(data["model"], {
            dtype: {name: CodecQuality(f.get("top1_agreement", f["agreement"]), f.get("encode_mb_s", 0.0),
                                       f.get("decode_mb_s", 0.0))
                    for name, f in codecs.items()}
            for dtype, codecs in data["cache_dtypes"].items()})

    @classmethod
    def shipped(cls, model: str) -> "QualityTable | None":
        """The table shipped for ``model`` (kvtransfer/quality/<model>.json), if any."""
        path = QUALITY_DIR / f"{model}.json"
        return cls.load(path) if path.is_file() else None

    def eligible(self, cache_dtype: str, min_agreement: float) -> dict[str, CodecQuality]:
        """The codecs measured on ``cache_dtype`` whose agreement is at least ``min_agreement``."""
        measured = self._by_dtype.get(cache_dtype, {})
        return {name: quality for name, quality in measured.items() if quality.agreement >= min_agreement}


class LinkCodecChooser:
    """Picks a codec per decode pod from its link's measured throughput. Thread-safe (pushes finish on the event
    loop, encoding threads do not touch it, but the lock keeps it honest)."""

    def __init__(self, layout: KVLayout, table: QualityTable | None, min_agreement: float):
        self.layout = layout
        self.min_agreement = min_agreement
        eligible = table.eligible(layout.cache_dtype, min_agreement) if table is not None else {}
        # Lossless codecs are always allowed; speeds unknown (0) count as free. So is a codec that carries this
        # pool's rows as they lie.
        pool = kv_rows.pool_dtype(layout.cache_dtype)
        self.value_dtype = dtype_name(kv_rows.value_dtype(pool))  # what the pool's KV decodes to
        self.stored = [name for name in KV_CODECS if get_codec(name).pool_dtype == pool]  # carry the pool's rows
        self.candidates = {name: eligible.get(name, CodecQuality(1.0, 0.0, 0.0)) for name in LOSSLESS_CODECS}
        self.candidates.update(eligible)
        self.candidates.update({name: CodecQuality(1.0, 0.0, 0.0) for name in self.stored})
        self._seconds_per_byte: dict[str, float] = {}  # by decode address
        self._lock = threading.Lock()

    def throughput(self, address: str) -> float | None:
        """The link's measured bytes per second; None before its first push."""
        with self._lock:
            seconds_per_byte = self._seconds_per_byte.get(address)
        return None if seconds_per_byte is None else 1.0 / seconds_per_byte

    def observe(self, address: str, wire_bytes: int, seconds: float) -> None:
        """A push to ``address`` carried ``wire_bytes`` in ``seconds`` of link time."""
        if wire_bytes <= 0 or seconds <= 0:
            return
        measured = seconds / wire_bytes
        with self._lock:
            previous = self._seconds_per_byte.get(address)
            self._seconds_per_byte[address] = measured if previous is None else (
                THROUGHPUT_SMOOTHING * measured + (1 - THROUGHPUT_SMOOTHING) * previous)

    def choose(self, address: str, num_tokens: int, accepted: list[str]) -> str:
        """The candidate ``address`` accepts with the least expected transfer seconds for a ``num_tokens`` prompt
        ("none" when it accepts no candidate: its handshake then refuses, naming what it accepts)."""
        link = self.throughput(address)
        usable = [name for name in self.candidates if name in accepted] or ["none"]
        return min(usable, key=lambda name: (self.expected_seconds(name, num_tokens, link), name))

    def lossless(self, accepted: list[str]) -> str:
        """What ``none`` sends: on a pool whose rows a codec carries as they lie (an int8 pool), that codec, which
        is the pool's own bytes, exact, at a quarter of its float32 values' (where ``accepted``); else ``none``."""
        return next((name for name in self.stored if name in accepted), "none")

    def expected_seconds(self, name: str, num_tokens: int, link_bytes_s: float | None) -> float:
        raw = self.raw_bytes(num_tokens)
        quality = self.candidates[name]
        seconds = sum(raw / (speed * 1e6) for speed in (quality.encode_mb_s, quality.decode_mb_s) if speed > 0)
        if link_bytes_s is not None:
            seconds += self.wire_bytes(name, num_tokens) / link_bytes_s
        return seconds

    def raw_bytes(self, num_tokens: int) -> int:
        layout = self.layout
        itemsize = CACHE_DTYPES[self.value_dtype].itemsize
        return 2 * layout.num_layers * num_tokens * layout.num_kv_heads * layout.head_dim * itemsize

    def wire_bytes(self, name: str, num_tokens: int) -> int:
        """Payload + scales of a whole prompt's KV (every layer, K and V) with codec ``name``."""
        layout = self.layout
        codec = get_codec(name.removesuffix(ZSTD_SUFFIX))  # zstd: its inner codec's size, an upper bound
        shape = (num_tokens, layout.num_kv_heads, layout.head_dim)
        per_layer = sum(sum(codec.encoded_nbytes(shape, kind, self.value_dtype)) for kind in ("k", "v"))
        return layout.num_layers * per_layer

