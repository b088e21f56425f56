"""Building the native CPU kernels' library (``engine/kernels/csrc/*.cpp``) once per machine, before serving.

    splitserve build-kernels              (``splitserve/cli.py``; ``scripts/bootstrap.sh`` runs it)
    splitserve build-kernels --baselines  (deploy/Dockerfile: every declared baseline, for nodes of any CPU)

compiles the sources (``SOURCES``, with their header) into one library with ``$CXX`` (default ``g++``)
``-O3 -fopenmp`` and the target's ISA into the cache directory. Two targets (``SPLITSERVE_KERNEL_TARGET``):

- ``native`` (the default): ``-march=native``, this CPU's every extension and tuning, as
  ``cpu_kernels-<key>.so``, the key hashing the sources, the flags, the compiler's version and the CPU's flags;
- ``baseline`` (the image's default): the best of ``BASELINES`` this CPU runs, as ``cpu_kernels-<baseline>-<key>.so``
  (the key without the compiler or the CPU: built once, in the image, for every node). The baselines are the x86-64
  psABI levels that compilers, distributions and cluster operators name: ``x86-64-v3`` (AVX2, FMA, F16C: every x86
  server since Haswell, AMD Zen 1-3), ``x86-64-v4`` (AVX-512 F/BW/CD/DQ/VL: Skylake-SP) and ``x86-64-v4`` with
  AVX512-VNNI (Cascade Lake and later, Zen 4 and later: the int8-activation products' dot-product path). A CPU that
  runs none of them (AVX2 without a v3 extension) gets the native build.

A process that finds no library for its target builds it at first use, as a fallback
(``engine/kernels/cpu_kernels.py``). So that pods starting together compile once, a build holds a file lock next to
its target and looks again for the library once it has the lock; the compiler writes a temporary file that is
renamed into place, so no process ever loads a half-written library.

The cache directory is the first of ``$SPLITSERVE_CACHE_DIR`` and ``~/.cache/splitserve`` that holds the library
or can be written (a library built into a read-only image is used where it lies: a pod on a read-only root runs the
image's baseline without writing anything). Where none can, ``KernelsUnavailable`` says why, and callers run the
model on PyTorch ops. ``SPLITSERVE_CPU_KERNELS=avx2`` builds (or picks a baseline) without AVX-512 where the CPU has
it (for CPUs that slow their clock for 512-bit work); both builds give the same bits, as every output sums its
products in the same order. The int8-activation products use the CPU's VNNI dot products (AVX512-VNNI, AVX-VNNI)
where it has them and AVX2's ``vpmaddubsw`` otherwise, the same exact integer sums either way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from splitserve.engine.kernels.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
# The decode step; quantized-weight products; the bf16 prefill.
SOURCES = [_CSRC / "cpu_kernels.cpp", _CSRC / "quant_kernels.cpp", _CSRC / "bf16_kernels.cpp"]
HEADERS = sorted(_CSRC.glob("*.h"))
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
LOCK_TIMEOUT_S = 600  # a build takes seconds; a lock held this long belongs to a process that hangs
KERNEL_TARGETS = ("native", "baseline")


@dataclass(frozen=True)
class Baseline:
    """An ISA the image's kernels are built for: ``flags`` select it, and a CPU whose ``/proc/cpuinfo`` flags include
    ``needs`` runs the library."""

    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]


# The x86-64 psABI levels as /proc/cpuinfo names their extensions (LZCNT is ``abm``).
_V3 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3",
                 "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
BASELINES = (  # best first: a CPU gets the first it runs
    Baseline("x86-64-v4-vnni", ("-march=x86-64-v4", "-mavx512vnni"), _V4 | {"avx512_vnni"}),
    Baseline("x86-64-v4", ("-march=x86-64-v4",), _V4),
    Baseline("x86-64-v3", ("-march=x86-64-v3",), _V3),
)


class KernelsUnavailable(RuntimeError):
    """The native kernels cannot be used on this machine; the message says why."""


def supported_cpu(flags: Iterable[str] | None = None) -> bool:
    """x86-64 with AVX2, FMA and F16C, what the kernels' intrinsics need (``flags``: the CPU's, default this one's)."""
    found = cpu_flags() if flags is None else frozenset(flags)
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= found


def kernel_target() -> str:
    """``$SPLITSERVE_KERNEL_TARGET``: ``native`` (unset: the default) or ``baseline`` (deploy/Dockerfile sets it)."""
    target = os.environ.get("SPLITSERVE_KERNEL_TARGET") or "native"
    if target not in KERNEL_TARGETS:
        raise KernelsUnavailable(f"SPLITSERVE_KERNEL_TARGET must be one of {', '.join(KERNEL_TARGETS)}, got {target!r}")
    return target


def choose_baseline(flags: Iterable[str], avx512: bool = True, vnni: bool = True) -> Baseline | None:
    """The best of ``BASELINES`` a CPU with ``flags`` runs (``avx512=False``: none with AVX-512; ``vnni=False``: none
    with VNNI), or None."""
    found = frozenset(flags)
    for baseline in BASELINES:
        if (baseline.needs <= found and (avx512 or "avx512f" not in baseline.needs)
                and (vnni or "avx512_vnni" not in baseline.needs)):
            return baseline
    return None


def library_path(avx512: bool = True, vnni: bool = True, target: str | None = None,
                 flags: Iterable[str] | None = None) -> Path:
    """The library for this CPU (``flags``: the CPU's, default this one's) and ``target`` (default
    ``kernel_target()``): with ``avx512=False`` without its AVX-512, if it has any; ``vnni=False`` without its VNNI
    integer dot products, the int8-activation path's AVX2 fallback. Built now if no cache directory holds it yet.
    Raises ``KernelsUnavailable``."""
    found = cpu_flags() if flags is None else frozenset(flags)
    if not supported_cpu(found):
        raise KernelsUnavailable("the native CPU kernels need x86-64 with AVX2, FMA and F16C")
    if (target or kernel_target()) == "baseline":
        baseline = choose_baseline(found, avx512, vnni)
        if baseline is not None:
            return _baseline_library(baseline)
        logger.info("no declared baseline (%s) runs on this CPU; building for it", ", ".join(b.name for b in BASELINES))
    compiler = _compiler()
    cflags = FLAGS + ([] if avx512 else ["-mno-avx512f"]) + ([] if vnni else ["-mno-avx512vnni", "-mno-avxvnni"])
    return _find_or_build(f"cpu_kernels-{_key(cflags, compiler, found)}.so", cflags)


def build_baselines() -> list[Path]:
    """Every declared baseline's library, found or built now whatever this CPU runs (an image's build: its pods run
    on other CPUs). Empty off x86-64, where none applies."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    return [_baseline_library(baseline) for baseline in BASELINES]


def _baseline_library(baseline: Baseline) -> Path:
    cflags = [flag for flag in FLAGS if flag != "-march=native"] + list(baseline.flags)
    return _find_or_build(f"cpu_kernels-{baseline.name}-{_key(cflags)}.so", cflags)


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise KernelsUnavailable("no C++ compiler (g++ or $CXX) for the native CPU kernels")
    return compiler


def _find_or_build(name: str, cflags: list[str]) -> Path:
    directories = cache_dirs()
    for directory in directories:
        if (directory / name).exists():
            return directory / name
    directory = _writable(directories)
    return _build(_compiler(), cflags, directory / name)


def cache_dirs() -> list[Path]:
    """Where the library may be, in order: ``$SPLITSERVE_CACHE_DIR``, then ``~/.cache/splitserve`` (when this
    process has a home directory: ``Path.home()`` raises without one)."""
    directories = []
    if os.environ.get("SPLITSERVE_CACHE_DIR"):
        directories.append(Path(os.environ["SPLITSERVE_CACHE_DIR"]))
    try:
        directories.append(Path.home() / ".cache" / "splitserve")
    except RuntimeError:
        pass
    return directories


def _writable(directories: list[Path]) -> Path:
    problems = []
    for directory in directories:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if os.access(directory, os.W_OK | os.X_OK):
                return directory
            problems.append(f"{directory}: not writable")
        except OSError as e:
            problems.append(f"{directory}: {e.strerror or e}")
    tried = "; ".join(problems) or "no home directory and SPLITSERVE_CACHE_DIR unset"
    raise KernelsUnavailable(f"no writable cache directory for the native CPU kernels ({tried}); "
                             "set SPLITSERVE_CACHE_DIR to one")


def _build(compiler: str, flags: list[str], target: Path) -> Path:
    lock = FileLock(target.with_suffix(".lock"))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.info("another process is building the native CPU kernels into %s; waiting for it", target)
            lock.acquire(timeout=LOCK_TIMEOUT_S)
        try:
            if target.exists():  # built by the process that held the lock before us
                return target
            logger.info("building the native CPU kernels into %s", target)
            fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
            os.close(fd)
            try:
                subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True,
                               check=True)
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        finally:
            lock.release()
    except subprocess.CalledProcessError as e:
        raise KernelsUnavailable(f"building the native CPU kernels failed: {e.stderr or e}") from e
    except Timeout as e:
        raise KernelsUnavailable(f"another process has held {e.lock_file} for {LOCK_TIMEOUT_S} s") from e
    except OSError as e:
        raise KernelsUnavailable(f"building the native CPU kernels failed: {e}") from e
    return target


def _key(flags: list[str], compiler: str | None = None, cpu: frozenset[str] = frozenset()) -> str:
    """The sources, the flags and, for a native build, the compiler's version and the CPU's flags, hashed (a
    baseline's key names neither: one build serves every compiler's and CPU's processes)."""
    parts = [*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(flags).encode()]
    if compiler is not None:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        parts += [version.encode(), " ".join(sorted(cpu)).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
