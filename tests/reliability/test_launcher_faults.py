"""``splitserve up`` under faults, with real processes: a child that exits, whatever the cause, is started again on
its ports while the rest keep serving; a child that will not start is reported with its log; stopping goes stage by
stage; and no child outlives the launcher, even one killed with SIGKILL.

First the supervisor on small stand-in processes (fast, exact timings), then real clusters on the tiny random
model. A running cluster's pods, router and redis-server killed and started again are in ``test_pod_faults.py``,
on its cluster. Every wait polls against a deadline: a busy 2-core machine makes things slow, not wrong.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_cluster import START_S, up_config, wait_until

from splitserve import supervisor
from splitserve.launcher import Cluster
from splitserve.supervisor import ChildSpec, Supervisor

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's zombie waits for whoever adopted it to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ---- the supervisor, on stand-in processes --------------------------------------------------------------------------

def python_child(name: str, code: str, tmp_path: Path, **spec) -> ChildSpec:
    return ChildSpec(name, [sys.executable, "-c", code], tmp_path / f"{name}.log", **spec)


def printed(log: Path, line: str) -> int:
    """How many times ``line`` is a whole line of ``log`` (the start markers quote the command, not its output)."""
    return log.read_text().splitlines().count(line)


@pytest.fixture
def fast_backoff(monkeypatch):
    monkeypatch.setattr(supervisor, "FIRST_BACKOFF_S", 0.2)
    monkeypatch.setattr(supervisor, "MAX_BACKOFF_S", 0.8)


def test_a_killed_child_is_restarted_and_the_others_keep_running(tmp_path, fast_backoff):
    sleeper = "import time; print('up', flush=True); time.sleep(600)"
    supervised = Supervisor([python_child("a", sleeper, tmp_path), python_child("b", sleeper, tmp_path)])
    supervised.start()
    log = tmp_path / "a.log"
    try:
        first_a, b = supervised.children["a"].pid, supervised.children["b"].pid
        wait_until(lambda: printed(log, "up") == 1, 30, "a to run")
        os.kill(first_a, signal.SIGKILL)
        wait_until(lambda: supervised.restarts["a"] == 1 and supervised.children["a"].pid, 30, "a's restart")
        assert supervised.children["a"].pid != first_a
        assert (supervised.children["b"].pid, supervised.restarts["b"]) == (b, 0)
        [exit_a] = supervised.exits
        assert (exit_a.name, exit_a.pid, exit_a.returncode) == ("a", first_a, -signal.SIGKILL)
        assert "was killed by SIGKILL" in exit_a.describe()
        wait_until(lambda: printed(log, "up") == 2, 30, "a to run again")
        assert log.read_text().count("splitserve up: start") == 2  # one log, appended, each start marked
    finally:
        supervised.stop([["a", "b"]])
    assert supervised.children["a"].pid is None and supervised.children["b"].pid is None


def test_a_crash_loop_is_reported_with_the_log_tail_and_retried_with_growing_backoff(tmp_path, fast_backoff, caplog):
    crash = "import sys; print('cannot open the model: bad path', flush=True); sys.exit(3)"
    supervised = Supervisor([python_child("pod", crash, tmp_path)])
    with caplog.at_level(logging.WARNING, logger="splitserve.supervisor"):
        supervised.start()
        try:
            wait_until(lambda: len(supervised.exits) >= 4, 60, "four exits")
        finally:
            supervised.stop([["pod"]])
    assert all(e.returncode == 3 and "bad path" in e.log_tail for e in supervised.exits)
    messages = [(r.levelname, r.getMessage()) for r in caplog.records if "exited with code 3" in r.getMessage()]
    assert [level for level, _ in messages[:4]] == ["WARNING", "WARNING", "ERROR", "ERROR"]
    assert "crash loop: 3 quick exits in a row" in messages[2][1]
    assert "cannot open the model: bad path" in messages[2][1]  # the log's tail, in the event
    delays = [float(message.split("again in ")[1].split(" s")[0]) for _, message in messages[:4]]
    assert delays == [0.2, 0.4, 0.8, 0.8]  # doubling, up to the maximum


def test_stop_goes_stage_by_stage_and_kills_what_outlives_its_grace(tmp_path):
    events = tmp_path / "events"
    drains = ("import signal, sys, time\n"
              "def stop(*_):\n"
              f"    open({str(events)!r}, 'a').write('NAME got SIGTERM\\n'); time.sleep(0.5)\n"
              f"    open({str(events)!r}, 'a').write('NAME drained\\n'); sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "print('ready', flush=True)\n"
              "while True: time.sleep(1)\n")
    stubborn = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                "while True: time.sleep(1)\n")
    supervised = Supervisor([python_child("pod", drains.replace("NAME", "pod"), tmp_path),
                             python_child("router", drains.replace("NAME", "router"), tmp_path),
                             python_child("stubborn", stubborn, tmp_path, stop_grace_s=0.5)])
    supervised.start()
    for name in ("pod", "router", "stubborn"):  # their signal handlers are in place
        wait_until(lambda: printed(tmp_path / f"{name}.log", "ready"), 30, f"{name} to run")
    started = time.monotonic()
    supervised.stop([["router"], ["pod"], ["stubborn"]])
    assert time.monotonic() - started < 10
    assert events.read_text().splitlines() == ["router got SIGTERM", "router drained", "pod got SIGTERM",
                                               "pod drained"]
    assert supervised.children["stubborn"].pid is None  # killed after its 0.5 s
    assert supervised.exits == []  # being stopped is not an exit to restart from


def test_children_die_with_the_supervising_process(tmp_path):
    """The launcher killed with SIGKILL: the kernel sends its children SIGTERM (PR_SET_PDEATHSIG)."""
    parent = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, time\n"
        "from splitserve.supervisor import ChildSpec, Supervisor\n"
        f"s = Supervisor([ChildSpec('sleeper', ['sleep', '600'], pathlib.Path({str(tmp_path)!r}) / 'sleeper.log')])\n"
        "s.start()\n"
        "print(s.children['sleeper'].pid, flush=True)\n"
        "time.sleep(600)\n")], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert alive(child)
    parent.kill()
    parent.wait(timeout=10)
    wait_until(lambda: not alive(child), 10, f"child {child} to exit")


# ---- startup failures ---------------------------------------------------------------------------------------------

def test_a_pod_that_cannot_start_fails_wait_ready_at_once_with_its_log(tmp_path, free_ports):
    base = free_ports(12)
    config = up_config(tmp_path, base, prefill=0, decode=1)
    taken = socket.socket()
    taken.bind((config.host, config.base_pod_port))  # decode-0's port
    taken.listen()
    failing = Cluster(config)
    started = time.monotonic()
    try:
        failing.start()
        with pytest.raises(RuntimeError, match=r"(?s)decode-0 \(pid \d+\) exited with code 1 after .* while "
                                               r"starting; last lines of .*decode-0.log:\n.*cannot listen on"):
            failing.wait_ready(log=lambda *_: None)
        assert time.monotonic() - started < START_S  # at once, not at the readiness timeout
    finally:
        failing.stop()
        taken.close()


# ---- the launcher process -------------------------------------------------------------------------------------------

def launch(tmp_path: Path, base: int, *flags: str) -> subprocess.Popen:
    """``python -m splitserve up`` (1 prefill + 1 decode, Redis registry) until it says it is up."""
    config = up_config(tmp_path, base)
    ports = ["--grpc-port", str(base), "--http-port", str(base + 1), "--base-pod-port", str(config.base_pod_port),
             "--base-metrics-port", str(config.base_metrics_port), "--redis-port", str(config.redis_port),
             "--prometheus-port", str(config.prometheus_port)]
    out = open(tmp_path / "up.out", "wb")
    launcher = subprocess.Popen([sys.executable, "-m", "splitserve", "up", "--model", "tiny-random", "--registry",
                                 "redis", "--kv-cache-memory-bytes", str(16 << 20), "--run-dir", str(tmp_path),
                                 *ports, *flags], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    wait_until(lambda: launcher.poll() is None and "splitserve is up" in (tmp_path / "up.out").read_text()
               or launcher.poll() is not None, START_S, "splitserve up to be up")
    assert launcher.poll() is None, (tmp_path / "up.out").read_text()
    return launcher


def children_of(pid: int) -> dict[int, str]:
    """{pid: command line} of the processes whose parent is ``pid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def ports_free(host: str, ports: list[int]) -> bool:
    """No process listens on any of ``ports``: a new server can take them (with SO_REUSEADDR, as every server here
    binds; the closed connections' TIME_WAIT does not count)."""
    for port in ports:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                sock.listen()
            except OSError:
                return False
    return True


def test_killing_the_launcher_with_sigkill_leaves_no_child_and_no_port_behind(tmp_path, free_ports):
    base = free_ports(12)
    launcher = launch(tmp_path, base, "--prometheus")
    children = children_of(launcher.pid)
    commands = " | ".join(children.values())
    assert len(children) == 5, commands  # redis-server, 2 pods, router, prometheus
    assert all(word in commands for word in ("redis-server", "prefill_service", "decode_service",
                                             "splitserve.router.server", "prometheus"))
    launcher.kill()
    launcher.wait(timeout=10)
    killed_at = time.monotonic()
    wait_until(lambda: not any(alive(pid) for pid in children), 30, "every child to exit")
    print(f"children gone {time.monotonic() - killed_at:.1f} s after the launcher's SIGKILL")
    # router gRPC and HTTP, Prometheus, redis-server, 2 pods and their /metrics (UpConfig.on_ports)
    wait_until(lambda: ports_free("127.0.0.1", list(range(base, base + 8))), 10, "the ports to be free")


def test_sigterm_to_the_launcher_stops_the_router_then_the_pods_then_redis(tmp_path, free_ports):
    launcher = launch(tmp_path, free_ports(12), "--no-prometheus")
    children = children_of(launcher.pid)
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 0
    assert not any(alive(pid) for pid in children)
    events = [line.split("splitserve.supervisor: ")[1] for line in (tmp_path / "up.out").read_text().splitlines()
              if "splitserve.supervisor: stopped" in line]
    assert events == ["stopped router", "stopped prefill-0, decode-0", "stopped redis"]
