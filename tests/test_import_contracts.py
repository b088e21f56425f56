"""The layers of the code, as ``import-linter`` contracts (``[tool.importlinter]`` in pyproject.toml): they hold
for the repository, and they catch a wrong import when one is made."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINTER = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
PACKAGES = LINTER["root_packages"]
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env={"PYTHONPATH": str(root), "PATH": ""},
                          capture_output=True, text=True, timeout=300)


def test_the_repository_keeps_every_import_contract():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(LINTER['contracts'])} kept, 0 broken" in result.stdout


def copy_of_the_code(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def add_import(module: Path, statement: str) -> None:
    module.write_text(module.read_text() + f"\n{statement}\n")


WRONG_IMPORTS = {  # name: (where, the import added, what the linter must say)
    "a router importing a pod": ({"router/policies.py": "import decode_service.server"}, [
        "router is not allowed to import decode_service", "router.policies -> decode_service.server",
        "3 broken"]),  # the layers (siblings), the router's forbidden list, and torch (a pod loads the model)
    "the engine importing network code or the runtime": (
        {"engine/scheduler.py": "import grpc", "engine/sequence.py": "import runtime.metrics"},
        ["engine is not allowed to import grpc", "engine.sequence -> runtime.metrics"]),
    "a package importing the benchmarks": ({"splitserve/launcher.py": "import bench.serve"}, [
        "splitserve is not allowed to import bench", "splitserve.launcher -> bench.serve"]),
    "a router import cycle": ({"router/config.py": "import router.policies"},  # policies imports config
                              ["no import cycle inside the router BROKEN", "1 broken"]),
    "a router path to torch": ({"router/intake.py": "import engine.model_files"},  # the weight loader
                               ["router is not allowed to import torch", "router.intake -> engine.model_files"]),
}


@pytest.mark.parametrize("case", WRONG_IMPORTS)
def test_a_wrong_import_breaks_the_contracts(tmp_path, case):
    root = copy_of_the_code(tmp_path)
    added, expected = WRONG_IMPORTS[case]
    for module, statement in added.items():
        add_import(root / module, statement)
    result = lint(root)
    assert result.returncode == 1
    for line in expected:
        assert line in result.stdout


def test_the_command_line_loads_a_benchmark_only_when_its_subcommand_runs():
    # The dispatch imports bench.NAME and the simulator by name (invisible to the linter): importing the command
    # line loads none of them.
    probe = ("import sys, splitserve.cli; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('bench', 'simulator')))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


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


ENGINE_PROCESS = """
import sys
import decode_service.server, prefill_service.server
from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutput
llm = LLM(model="tiny-random", kv_cache_memory_bytes=16 << 20)
[out] = llm.generate(["pick"], SamplingParams(max_tokens=4, structured_output=StructuredOutput(choice=("yes", "no"))))
assert out.text in ("yes", "no"), out.text
print(sorted(name for name in ("torch._dynamo", "torch._inductor") if name in sys.modules))
"""


def test_no_engine_process_imports_torchs_compiler():
    """``torch._dynamo`` and ``torch._inductor`` (torch.compile's machinery, with sympy and networkx) cost seconds of
    every pod's, benchmark worker's and offline engine's start, and none of them compiles: a pod's modules, an engine
    built and a guided request served leave them unimported (``llguidance.torch`` and ``skip_init`` imported them)."""
    result = subprocess.run([sys.executable, "-c", ENGINE_PROCESS], cwd=REPO, env={"PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
