"""Building the native CPU kernels' library (``engine/kernels/csrc/*.cpp``) once per machine, before serving.

    splitserve build-kernels      (``splitserve/cli.py``; ``scripts/bootstrap.sh`` runs it)

compiles the sources (``SOURCES``, with their header) into one library with ``$CXX`` (default ``g++``)
``-O3 -march=native -fopenmp`` into the cache directory, as
``cpu_kernels-<key>.so``, the key hashing the sources, the flags, the compiler's version and the CPU's flags. A
process that finds no library there builds it at first use, as a fallback (``engine/kernels/cpu_kernels.py``). So that
pods starting together compile once, a build holds a file lock next to its target and looks again for the library
once it has the lock; the compiler writes a temporary file that is renamed into place, so no process ever loads a
half-written library.

The cache directory is the first of ``$SPLITSERVE_CACHE_DIR`` and ``~/.cache/splitserve`` that holds the library
or can be written (a library built into a read-only image is used where it lies). Where none can,
``KernelsUnavailable`` says why, and callers run the model on PyTorch ops. ``SPLITSERVE_CPU_KERNELS=avx2`` builds
without AVX-512 where the CPU has it (for CPUs that slow their clock for 512-bit work); both builds give the same
bits, as every output sums its products in the same order. The int8-activation products use the CPU's VNNI dot
products (AVX512-VNNI, AVX-VNNI) where it has them and AVX2's ``vpmaddubsw`` otherwise, the same exact integer
sums either way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout

from splitserve.engine.kernels.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = [_CSRC / "cpu_kernels.cpp", _CSRC / "quant_kernels.cpp"]  # the decode step; quantized-weight products
HEADERS = [_CSRC / "quant_kernels.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
LOCK_TIMEOUT_S = 600  # a build takes seconds; a lock held this long belongs to a process that hangs


class KernelsUnavailable(RuntimeError):
    """The native kernels cannot be used on this machine; the message says why."""


def supported_cpu() -> bool:
    """x86-64 with AVX2, FMA and F16C, what the kernels' intrinsics need."""
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= cpu_flags()


def library_path(avx512: bool = True, vnni: bool = True) -> Path:
    """The library built for this CPU (with ``avx512=False``: without its AVX-512, if it has any; ``vnni=False``:
    without its VNNI integer dot products, the int8-activation path's AVX2 fallback), built now if no cache
    directory holds it yet. Raises ``KernelsUnavailable``."""
    if not supported_cpu():
        raise KernelsUnavailable("the native CPU kernels need x86-64 with AVX2, FMA and F16C")
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise KernelsUnavailable("no C++ compiler (g++ or $CXX) for the native CPU kernels")
    flags = FLAGS + ([] if avx512 else ["-mno-avx512f"]) + ([] if vnni else ["-mno-avx512vnni", "-mno-avxvnni"])
    name = f"cpu_kernels-{_key(compiler, flags)}.so"
    directories = cache_dirs()
    for directory in directories:
        if (directory / name).exists():
            return directory / name
    directory = _writable(directories)
    return _build(compiler, flags, directory / name)


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


def _key(compiler: str, flags: list[str]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(flags).encode(), version.encode(),
             " ".join(sorted(cpu_flags())).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
