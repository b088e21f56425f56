"""``splitserve bench soak`` end to end, short, on the tiny random model: it brings up its cluster, injects its
faults under load, prints its progress and report, writes the JSON, and exits 0 only with no block leaked and no
unexpected failure, on the default (hybrid) scheduling with every answer it can check served again through the
other path (shadow checks) and matching. Every prompt is split (``FORCE_SPLIT_ENV``: its first 16 tokens prefilled on
the prefill pod and pushed, the rest on the decode pod): on an idle cluster hybrid placement lends a 48-token prompt
whole to its decode pod, and then no KV moves for the corrupted chunks to hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.router.policies import FORCE_SPLIT_ENV

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_injects_every_kind_of_fault_and_leaks_nothing(tmp_path, free_ports):
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "-m", "splitserve", "bench", "soak", "--model", "tiny-random", "--duration", "14",
         "--fault-interval", "3", "--request-rate", "4", "--input-len", "48", "--output-len", "16",
         "--corrupt-chunks", "0.2", "--abort-share", "0.2", "--abort-within", "0.15",
         "--kv-cache-memory-bytes", str(16 << 20),
         "--drain-timeout", "90", "--base-port", str(free_ports(12)), "--run-dir", str(tmp_path / "cluster"),
         "--progress-interval", "5", "--json", str(out)],
        check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400,
        env={**os.environ, FORCE_SPLIT_ENV: "16"})
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert set(report["leaked_blocks"]) == {"prefill-0", "decode-0", "decode-1"}
    assert all(n == 0 for n in report["leaked_blocks"].values())
    requests, faults = report["requests"], report["faults"]
    assert requests["served"] >= 10 and requests["failed_unexpected"] == {}
    assert faults["redis_restarted"] >= 1 and faults["decode_pod_killed"] >= 1 and faults["client_aborts"] >= 1
    assert faults["corrupt_chunk_retries"] >= 1
    assert all(report["latency_s"][name]["p99"] > 0 for name in ("ttft", "tpot", "e2e"))
    # the default (hybrid) scheduling, its answers checked through the other path: with the lossless codec every
    # check matches, tokens and logprobs; no KV lease expired on a pod (a leak its lease freed)
    assert report["config"]["kv_codec"] == "none" and sum(report["routes"].values()) >= requests["served"]
    assert report["routes"]["split"] >= requests["served"], report["routes"]  # every prompt's prefix pushed
    shadow = report["shadow_checks"]
    assert shadow["match"] >= 1 and shadow["diverged"] == 0 and shadow["divergences"] == [], shadow
    assert all(not n for n in report["leases_expired"].values()), report["leases_expired"]
    assert "[soak " in result.stderr and "fault at" in result.stderr  # progress lines while it runs
    assert "leaked" in result.stdout and "shadow" in result.stdout and "PASSED" in result.stdout
