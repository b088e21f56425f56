"""The layers of the code, as ``import-linter`` contracts (``[tool.importlinter]`` in pyproject.toml): they hold
for the repository, and they catch a wrong import when one is made."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["splitserve", "deploy", "router", "prefill_service", "decode_service", "kvtransfer", "runtime", "protos", "engine"]
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env={"PYTHONPATH": str(root), "PATH": ""},
                          capture_output=True, text=True, timeout=300)


def test_the_repository_keeps_every_import_contract():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 kept, 0 broken" in result.stdout


def copy_of_the_code(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def add_import(module: Path, statement: str) -> None:
    module.write_text(module.read_text() + f"\n{statement}\n")


def test_a_router_importing_a_pod_breaks_two_contracts(tmp_path):
    root = copy_of_the_code(tmp_path)
    add_import(root / "router" / "policies.py", "import decode_service.server")
    result = lint(root)
    assert result.returncode == 1
    assert "router is not allowed to import decode_service" in result.stdout
    assert "router.policies -> decode_service.server" in result.stdout
    # The layers (siblings), the router's forbidden list, and torch (a pod loads the model).
    assert "3 broken" in result.stdout


def test_the_engine_importing_network_code_or_the_runtime_breaks_the_contracts(tmp_path):
    root = copy_of_the_code(tmp_path)
    add_import(root / "engine" / "scheduler.py", "import grpc")
    add_import(root / "engine" / "sequence.py", "import runtime.metrics")
    result = lint(root)
    assert result.returncode == 1
    assert "engine is not allowed to import grpc" in result.stdout
    assert "engine.sequence -> runtime.metrics" in result.stdout


@pytest.mark.parametrize("module, statement, complaints", [
    # policies imports config: a cycle
    ("config.py", "import router.policies", ["no import cycle inside the router BROKEN", "1 broken"]),
    # the weight loader imports torch
    ("intake.py", "import engine.model_files",
     ["router is not allowed to import torch", "router.intake -> engine.model_files"]),
])
def test_a_router_import_cycle_or_path_to_torch_breaks_its_contract(tmp_path, module, statement, complaints):
    root = copy_of_the_code(tmp_path)
    add_import(root / "router" / module, statement)
    result = lint(root)
    assert result.returncode == 1
    for complaint in complaints:
        assert complaint in result.stdout


def test_the_router_process_loads_no_torch():
    """What the contract says, in a fresh interpreter: the router's modules, both APIs and a Router with its
    tokenizer loaded by name (the path that used to pull in the weight loaders) leave torch unimported."""
    script = ("import sys, router.server, router.openai_api; from router.config import RouterConfig; "
              "from router.router import Router; "
              "Router(RouterConfig(model='tiny-random', decode_pods=['localhost:1'])); "
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
