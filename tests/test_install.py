"""Installing splitserve adds one top-level import name, ``splitserve``, and every package of the tree is in it.

The repository keeps the design's top-level folders (``engine/``, ``router/``, ...); ``[tool.setuptools]`` in
pyproject.toml maps each to a subpackage of ``splitserve``. These tests check that mapping against the tree, and
install a wheel into a fresh virtual environment to list what it puts at the top level.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def packages_in_the_tree() -> set[str]:
    """Every folder with an ``__init__.py`` under a mapped folder, by the import name the mapping gives it."""
    found = set()
    for name, folder in SETUPTOOLS["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder)
            if "__pycache__" in relative.parts:
                continue
            found.add(".".join([name, *relative.parts]))
    return found


def test_every_package_of_the_tree_is_installed_under_one_name():
    listed = set(SETUPTOOLS["packages"])
    # protos/ holds protos/splitserve/v1, which installs as splitserve.v1 (the generated code's own import name)
    in_tree = {name for name in packages_in_the_tree() if not name.startswith("splitserve.protos.splitserve")}
    assert in_tree == listed, {"not installed": sorted(in_tree - listed), "not in the tree": sorted(listed - in_tree)}
    assert all(name == "splitserve" or name.startswith("splitserve.") for name in listed)


@pytest.mark.timeout(600)
def test_a_wheel_installed_into_a_fresh_environment_adds_exactly_one_top_level_name(tmp_path):
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info where it runs
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "*.egg-info"))
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    [wheel] = wheels.glob("splitserve-*.whl")
    env = tmp_path / "env"
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    before = set(Path(site).iterdir())
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    added = sorted(p.name for p in set(Path(site).iterdir()) - before)
    # bin/ holds the console script (pip --target puts it beside the packages); the rest is importable
    importable = [name for name in added if not name.endswith((".dist-info", ".data")) and name != "bin"]
    assert importable == ["splitserve"], added
    # installed, the mapped folders are where the mapping says, with their data files
    installed = Path(site) / "splitserve"
    assert (installed / "engine" / "kernels" / "csrc" / "cpu_kernels.cpp").is_file()
    assert (installed / "v1" / "generate_pb2.py").is_file()
    assert (installed / "router" / "openai" / "app.py").is_file()
    assert list((installed / "simulator" / "profiles").glob("*.json"))
    # the Azure traces ship inside the package, with their licence and attribution
    assert {p.name for p in (installed / "measure" / "traces").iterdir()} == {
        "AzureLLMInferenceTrace_conv.csv.gz", "AzureLLMInferenceTrace_code.csv.gz", "README.md"}
