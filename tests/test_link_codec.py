"""kv_codec=auto: the LinkCodecChooser's pick on hand-made link throughputs and quality tables, its wire sizes
against real encodings, and the quality table the prefill pods ship."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.kvtransfer.codecs import get_codec
from splitserve.kvtransfer.handshake import KVLayout
from splitserve.kvtransfer.link_codec import QUALITY_DIR, CodecQuality, LinkCodecChooser, QualityTable
from splitserve.kvtransfer.wire import encode_chunks
from splitserve.runtime.kv_codecs import kv_codec_names

LAYOUT = KVLayout("smollm2-135m", 30, 3, 64, block_size=16, cache_dtype="float16")
ALL = kv_codec_names()
MB = 1e6


def table(**agreements: float) -> QualityTable:
    """Every quantizing codec at 1 GB/s each way, with the agreements given; none a copy (10 and 30 GB/s),
    none+zstd slow (400 and 650 MB/s), as bench codecs measures them."""
    codecs = {name: CodecQuality(agreement, 1000.0, 1000.0) for name, agreement in agreements.items()}
    codecs |= {"none": CodecQuality(1.0, 10000.0, 30000.0), "none+zstd": CodecQuality(1.0, 400.0, 650.0)}
    return QualityTable("smollm2-135m", {"float16": codecs})


def chooser(min_agreement: float = 0.9, **agreements: float) -> LinkCodecChooser:
    return LinkCodecChooser(LAYOUT, table(**agreements), min_agreement)


def test_an_unmeasured_or_fast_link_goes_uncompressed():
    pick = chooser(int8=0.99, kivi4=0.95, kivi2=0.92)
    assert pick.choose("decode-a", 1000, ALL) == "none"  # not measured yet: counts as infinitely fast
    pick.observe("decode-a", 100 * MB, 0.1)  # 1 GB/s
    assert pick.choose("decode-a", 1000, ALL) == "none"


def test_a_slow_link_takes_the_smallest_codec_that_clears_the_floor():
    pick = chooser(int8=0.99, kivi4=0.95, kivi2=0.92, fp8=0.5)
    pick.observe("decode-a", 1 * MB, 1.0)  # 1 MB/s
    assert pick.choose("decode-a", 1000, ALL) == "kivi2"
    strict = chooser(0.96, int8=0.99, kivi4=0.95, kivi2=0.92)
    strict.observe("decode-a", 1 * MB, 1.0)
    assert strict.choose("decode-a", 1000, ALL) == "int8"
    assert pick.choose("decode-a", 1000, ["none", "int8", "kivi4"]) == "kivi4"  # what the decode pod accepts


def test_links_are_measured_apart_and_smoothed():
    pick = chooser(kivi2=0.92)
    pick.observe("slow", 1 * MB, 1.0)
    pick.observe("fast", 1000 * MB, 1.0)
    assert (pick.choose("slow", 500, ALL), pick.choose("fast", 500, ALL)) == ("kivi2", "none")
    pick.observe("slow", 1000 * MB, 1.0)  # the link got faster: seconds per byte averaged, 0.7 for the new one
    assert pick.throughput("slow") == pytest.approx(1 / (0.7 / (1000 * MB) + 0.3 / MB))
    assert pick.choose("slow", 500, ALL) == "kivi2"  # one fast push does not outweigh a slow one
    for _ in range(5):  # each fast push leaves 0.3 of the slow past: 0.3^6 of 1 us/byte is below 1 ns/byte
        pick.observe("slow", 1000 * MB, 1.0)
    assert pick.choose("slow", 500, ALL) == "none"


def test_the_crossover_follows_codec_speed_and_link_throughput():
    """kivi2 moves 2 bytes/element as ~0.35 and costs 2 / (1 GB/s) per raw byte; none costs 1/10 + 1/30 GB/s."""
    pick = chooser(kivi2=0.92)
    raw, small = pick.raw_bytes(1000), pick.wire_bytes("kivi2", 1000)
    codec_seconds = raw * (2 / (1000 * MB) - 1 / (10000 * MB) - 1 / (30000 * MB))
    crossover = (raw - small) / codec_seconds  # link bytes/s where both take as long
    pick.observe("a", int(crossover * 0.8), 1.0)
    assert pick.choose("a", 1000, ALL) == "kivi2"
    pick2 = chooser(kivi2=0.92)
    pick2.observe("a", int(crossover * 1.25), 1.0)
    assert pick2.choose("a", 1000, ALL) == "none"


def test_without_a_table_only_lossless_codecs_are_candidates():
    pick = LinkCodecChooser(LAYOUT, None, 0.9)
    pick.observe("a", 1000, 1.0)  # a very slow link
    assert set(pick.candidates) == {"none", "none+zstd"}
    assert pick.choose("a", 100, ALL) in ("none", "none+zstd")


@pytest.mark.parametrize("name", ["none", "int8", "int4", "kivi2", "kivi8+zstd"])
def test_wire_bytes_are_what_the_chunks_of_a_prompt_carry(name):
    layout = KVLayout("tiny", 2, 3, 64, block_size=16, cache_dtype="float16")
    tokens = 100
    sent = sum(len(c.payload) + len(c.scales)
               for layer in range(2) for kind in "kv"
               for c in encode_chunks("r", layer, kind, 0, tokens, torch.randn(tokens, 3, 64).half(),
                                      get_codec(name.removesuffix("+zstd")), tokens))
    pick = LinkCodecChooser(layout, None, 1.0)
    assert pick.wire_bytes(name, tokens) == sent
    assert pick.raw_bytes(tokens) == 2 * 2 * tokens * 3 * 64 * 2


def test_the_shipped_quality_table_covers_every_codec_on_both_cache_dtypes():
    data = json.loads((QUALITY_DIR / "smollm2-135m.json").read_text())
    assert set(data["cache_dtypes"]) == {"float16", "float32"}
    for codecs in data["cache_dtypes"].values():
        assert set(codecs) == set(ALL)
        assert codecs["none"]["agreement"] == 1.0
    shipped = QualityTable.shipped("smollm2-135m")
    assert "none" in shipped.eligible("float16", 1.0)
    assert QualityTable.shipped("no-such-model") is None


def test_the_floor_applies_to_teacher_forced_top1_agreement_where_the_table_has_it(tmp_path):
    """bench codecs writes both figures; the chooser reads the teacher-forced one (every position of long contexts),
    not greedy decoding until the first divergence, which near ties decide; a table without it, the greedy one."""
    figures = {"none": {"agreement": 1.0, "top1_agreement": 1.0},
               "int8": {"agreement": 0.72, "top1_agreement": 0.994},
               "int4": {"agreement": 0.32, "top1_agreement": 0.954}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"model": "m", "cache_dtypes": {"float16": figures}}))
    assert set(QualityTable.load(path).eligible("float16", 0.97)) == {"none", "int8"}
    for f in figures.values():
        del f["top1_agreement"]
    path.write_text(json.dumps({"model": "m", "cache_dtypes": {"float16": figures}}))
    assert set(QualityTable.load(path).eligible("float16", 0.97)) == {"none"}
