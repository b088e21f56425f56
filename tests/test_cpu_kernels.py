"""The native kernels' library as a package: built once by several processes at once (file lock), a clear reason
and the PyTorch path when no cache directory is writable, a library whose ABI disagrees with the declarations
refused before any call, and the compute path an engine reports (what the pod logs and exports)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.kernels import abi, cpu_kernels
from splitserve.engine.kernels.abi import ENTRY_POINTS, KernelABIError, check_abi
from splitserve.engine.kernels.build import KernelsUnavailable, library_path, supported_cpu
from splitserve.engine.kernels.cpu_kernels import CpuKernels, choose
from splitserve.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[1]


def _declared_table() -> dict[str, str]:
    """What the declarations say each entry point takes, spelled as the library's table spells it."""
    return {name: "".join(abi._TYPE_CODES[t] for t in args) for name, (args, _) in ENTRY_POINTS.items()}


def test_the_declarations_agree_with_the_library(native_kernels):
    version, table = abi.library_abi(native_kernels._lib)
    assert version == abi.ABI_VERSION
    assert table == _declared_table()
    assert table["ss_linear"] == "pqqpqqppqi"  # x, rows, ldx, packed, out, in, bias, y, ldy, threads


def test_a_table_that_disagrees_is_refused_naming_each_difference():
    table = _declared_table()
    check_abi(abi.ABI_VERSION, table)  # agrees: no error
    other = abi.ABI_VERSION + 1
    with pytest.raises(KernelABIError, match=f"ABI version {other}, this code needs {abi.ABI_VERSION}"):
        check_abi(other, table)
    doctored = dict(table, ss_linear=table["ss_linear"][:-1], ss_extra="p")  # one argument fewer; one unknown
    del doctored["ss_decode_layers"]
    with pytest.raises(KernelABIError) as refused:
        check_abi(abi.ABI_VERSION, doctored)
    message = str(refused.value)
    assert "ss_linear: library takes (pqqpqqppq), declared (pqqpqqppqi)" in message
    assert "ss_decode_layers: library takes (absent)" in message and "ss_extra: in the library, not declared" in message
    assert "ss_prefill_attention" not in message


def _compile(source: str, path: Path) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    (path.with_suffix(".cpp")).write_text(textwrap.dedent(source))
    subprocess.run(["g++", "-shared", "-fPIC", str(path.with_suffix(".cpp")), "-o", str(path)], check=True)
    return path


def test_a_library_that_disagrees_is_refused_before_any_call(tmp_path):
    stale = _compile("""
        #include <stdint.h>
        extern "C" {
        struct AbiEntry { const char* name; const char* arg_types; };
        static const AbiEntry kTable[] = {{"ss_linear", "pqqpqqppq"}};  // an older ss_linear, one argument fewer
        int ss_abi_version() { return %d; }
        int64_t ss_abi_table(const AbiEntry** entries) { *entries = kTable; return 1; }
        void ss_linear() {}
        }
    """ % abi.ABI_VERSION, tmp_path / "stale.so")
    with pytest.raises(KernelABIError, match=r"ss_linear: library takes \(pqqpqqppq\), declared \(pqqpqqppqi\)"):
        CpuKernels(stale)
    silent = _compile('extern "C" void ss_linear() {}', tmp_path / "silent.so")
    with pytest.raises(KernelABIError, match="reports no ABI"):
        CpuKernels(silent)


def _needs_a_buildable_cpu() -> None:
    if not supported_cpu() or shutil.which("g++") is None:
        pytest.skip("the native kernels do not build here")


def test_no_writable_cache_directory_is_a_clear_reason_and_the_pytorch_path(tmp_path, monkeypatch):
    _needs_a_buildable_cpu()
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "a_file" / "cache"))  # even root cannot mkdir there

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    with pytest.raises(KernelsUnavailable, match=r"no writable cache directory .*a_file/cache: Not a directory"):
        library_path()
    choice = cpu_kernels.load.__wrapped__()  # what a process starting now would get
    assert choice.kernels is None and choice.path == "pytorch"
    assert str(choice).startswith("PyTorch ops (no writable cache directory")


def test_two_processes_building_at_once_compile_once(tmp_path, native_kernels):
    _needs_a_buildable_cpu()
    # A stand-in compiler that writes the library already built once the test lets it: the lock, not the compiler,
    # is under test. Process A compiles; B starts meanwhile and must wait for A's library instead of compiling.
    log, release = tmp_path / "compiles.log", tmp_path / "release"
    compiler = tmp_path / "cxx"
    compiler.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then exec g++ --version; fi
        echo "$$" >> {log}
        while [ ! -e {release} ]; do sleep 0.05; done
        for output; do :; done
        cp {native_kernels.path} "$output"
    """))
    compiler.chmod(0o755)
    env = dict(os.environ, CXX=str(compiler), SPLITSERVE_CACHE_DIR=str(tmp_path / "cache"),
               HOME=str(tmp_path / "home"), SPLITSERVE_CPU_KERNELS="1")

    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "splitserve", "build-kernels"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = start()
    deadline = time.monotonic() + 120
    while not (log.exists() and log.read_text()):  # A holds the lock, compiling
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.05)
    second = start()
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(second.stdout), daemon=True)
    reader.start()
    # B's log says it waits for A (without the lock it would compile too: a second line in the log).
    while not any("another process is building" in line for line in seen) and len(log.read_text().split()) < 2:
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)
    release.touch()
    second.wait(timeout=120)
    reader.join(timeout=10)
    outputs = ["".join(seen), first.communicate(timeout=120)[0]]
    assert [second.returncode, first.returncode] == [0, 0], outputs
    assert "another process is building" in outputs[0], outputs[0]
    assert len(log.read_text().split()) == 1  # one compile
    libraries = list((tmp_path / "cache").glob("*.so"))
    assert len(libraries) == 1 and not list((tmp_path / "cache").glob("*.tmp"))
    assert all(f"native CPU kernels ({native_kernels.isa.upper()}, {libraries[0]})" in out for out in outputs)


def test_the_compute_path_says_pytorch_and_why():
    assert str(choose("cpu", torch.float32, enabled=False)) == "PyTorch ops (cpu_kernels=False)"
    assert choose("cuda", torch.float32).reason == "device cuda: the native kernels are for CPUs"
    assert choose("cpu", torch.bfloat16).reason == "dtype bfloat16: the native kernels compute in float32"
    engine = LLMEngine(EngineConfig(model="tiny-random", cpu_kernels=False))
    assert engine.compute_path.path == "pytorch" and engine.runner.model.kernels is None


def test_an_engine_on_the_native_kernels_says_so(native_kernels):
    engine = LLMEngine(EngineConfig(model="tiny-random"))
    assert engine.compute_path.kernels is native_kernels and engine.compute_path.path == "native"
    assert str(engine.compute_path) == f"native CPU kernels ({native_kernels.isa.upper()}, {native_kernels.path})"
