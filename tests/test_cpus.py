"""CPU sets (runtime/cpus.py): Linux CPU lists parsed and written back, sets outside the process's allowed CPUs
refused naming the field, and a process started with a set runs every thread on it with one torch thread per CPU.
Anything that changes affinity runs in a child process, never in the test process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from splitserve.decode_service.config import DecodeConfig
from splitserve.probes import serving
from splitserve.router.config import RouterConfig
from splitserve.runtime.cpus import allowed_cpus, checked_cpu_set, format_cpu_list, parse_cpu_list, thread_env
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
NOT_ALLOWED = max(allowed_cpus()) + 1  # a CPU this process may not run on (it may not even exist)


@pytest.mark.parametrize("text, cpus", [
    ("1", {1}), ("0-3,6", {0, 1, 2, 3, 6}), ("0,2", {0, 2}), ("3-3", {3}), ("0-1, 4-5", {0, 1, 4, 5}),
])
def test_cpu_lists_parse_as_linux_writes_them(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "-1", "0,,1", "1-", "3-1", "0-2-4", "1.5"])
def test_malformed_cpu_lists_are_refused(text):
    with pytest.raises(ValueError, match="CPU list"):
        parse_cpu_list(text)


def test_cpu_sets_are_written_as_ranges():
    assert format_cpu_list({0, 1, 2, 6}) == "0-2,6"
    assert format_cpu_list([5, 3, 4, 9, 10]) == "3-5,9-10"
    assert format_cpu_list({7}) == "7"
    assert parse_cpu_list(format_cpu_list({0, 2, 3, 4, 8})) == {0, 2, 3, 4, 8}


def test_a_set_must_be_cpus_this_process_may_run_on():
    assert checked_cpu_set("cpus", "") == frozenset()  # empty: leave the affinity as it is
    everything = format_cpu_list(allowed_cpus())
    assert checked_cpu_set("cpus", everything) == allowed_cpus()
    with pytest.raises(ValueError, match=rf"^decode_cpus: CPU {NOT_ALLOWED} of '0,{NOT_ALLOWED}' is not one this "
                                         rf"process may run on \({everything}\)$"):
        checked_cpu_set("decode_cpus", f"0,{NOT_ALLOWED}")
    with pytest.raises(ValueError, match="^router_cpus: '2-1' is not a CPU list: range 2-1 runs backwards$"):
        checked_cpu_set("router_cpus", "2-1")


def test_pod_and_router_configs_refuse_a_bad_set_naming_the_field():
    with pytest.raises(ValueError, match="^cpus: CPU"):
        DecodeConfig(cpus=str(NOT_ALLOWED))
    with pytest.raises(ValueError, match="^cpus: 'x' is not a CPU list"):
        RouterConfig(cpus="x", decode_pods=["127.0.0.1:1"])
    assert DecodeConfig(cpus="0").cpus == "0"


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "splitserve.decode_service", "--model", "tiny-random", "--cpus", str(NOT_ALLOWED)],
    [sys.executable, "-m", "splitserve.router.server", "--decode-pods", "127.0.0.1:1", "--cpus", "0-"],
])
@pytest.mark.e2e
def test_a_process_given_a_bad_set_exits_at_once_with_a_usage_error(command):
    done = subprocess.run(command, cwd=REPO_ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert re.search(r"error: cpus: (CPU \d+ of|'0-' is not a CPU list)", done.stderr), done.stderr


def _applied_in_a_child(*call_args: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    """(every thread's Cpus_allowed_list, torch threads) of a child that called apply_cpu_set(*call_args), after a
    matrix product started torch's pool."""
    script = (
        "import os, torch\n"
        "from splitserve.runtime.torch_threads import apply_cpu_set\n"
        f"applied = apply_cpu_set({', '.join(call_args)})\n"
        "torch.ones(512, 512) @ torch.ones(512, 512)\n"
        "lists = {open(f'/proc/self/task/{t}/status').read().split('Cpus_allowed_list:')[1].split()[0]\n"
        "         for t in os.listdir('/proc/self/task')}\n"
        "print(','.join(sorted(lists)), applied.threads, torch.get_num_threads())\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lists, reported, actual = done.stdout.split()
    assert reported == actual
    return lists, actual


def test_applying_a_set_pins_every_thread_and_sizes_torch_to_it():
    assert _applied_in_a_child("'0'") == ("0", "1")
    assert _applied_in_a_child("'0'", "num_threads=3") == ("0", "3")  # an explicit thread count wins
    everything = format_cpu_list(allowed_cpus())
    assert _applied_in_a_child(f"'{everything}'") == (everything, str(len(allowed_cpus())))


def test_without_a_set_nothing_changes():
    # The child inherits its affinity and OMP_NUM_THREADS from here.
    assert _applied_in_a_child("''", env=thread_env(1)) == (format_cpu_list(allowed_cpus()), "1")


@pytest.mark.e2e
def test_a_pod_started_with_cpus_0_runs_every_thread_on_cpu_0_with_one_torch_thread(tmp_path, free_ports):
    port = free_ports(2)
    metrics_port = port + 1
    log = tmp_path / "decode.log"
    with open(log, "wb") as out:
        pod = subprocess.Popen([sys.executable, "-m", "splitserve.decode_service", "--host", "127.0.0.1",
                                "--port", str(port), "--metrics-port", str(metrics_port), "--model", "tiny-random",
                                "--num-blocks", "32", "--cpus", "0"],
                               cwd=REPO_ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not serving(f"127.0.0.1:{port}"):
            assert pod.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        request = decode_pb2.DecodeRequest(request_id="pinned", prompt_token_ids=list(range(1, 40)),
                                           sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=8))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # runs the engine, so its threads exist
            assert sum(len(m.chunk.token_ids) for m in decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=60))
        tasks = Path(f"/proc/{pod.pid}/task")
        lists = {(task / "status").read_text().split("Cpus_allowed_list:")[1].split()[0] for task in tasks.iterdir()}
        assert lists == {"0"}
        assert "splitserve.runtime.torch_threads: CPUs 0, 1 torch threads" in log.read_text()
    finally:
        pod.terminate()
        pod.wait(timeout=30)
