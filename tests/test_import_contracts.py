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
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
LINTER = PYPROJECT["tool"]["importlinter"]
# import name -> the repository folder it installs from (the design's top-level folders, mapped under one name)
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env={"PYTHONPATH": str(root), "PATH": ""},
                          capture_output=True, text=True, timeout=300)


def test_the_repository_keeps_every_import_contract(tmp_path):
    result = lint(copy_of_the_code(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(LINTER['contracts'])} kept, 0 broken" in result.stdout


def copy_of_the_code(tmp_path: Path) -> Path:
    """The package as an install lays it out (each folder where pyproject's package-dir puts it): import-linter
    reads packages from disk, so it checks this copy rather than the repository's folders."""
    for name, folder in sorted(PACKAGE_DIRS.items()):  # "splitserve" first, its mapped subpackages into it
        target = tmp_path.joinpath(*name.split("."))
        shutil.copytree(REPO / folder, target, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def installed_path(root: Path, repo_path: str) -> Path:
    """A repository path (``router/policies.py``) -> where the copy of the code holds that file."""
    folder, _, rest = repo_path.partition("/")
    name = next(name for name, mapped in PACKAGE_DIRS.items() if mapped == folder)
    return root.joinpath(*name.split("."), rest)


def add_import(module: Path, statement: str) -> None:
    module.write_text(module.read_text() + f"\n{statement}\n")


WRONG_IMPORTS = {  # name: (where, the import added, what the linter must say)
    "a router importing a pod": ({"router/policies.py": "import splitserve.decode_service.server"}, [
        "splitserve.router is not allowed to import splitserve.decode_service",
        "splitserve.router.policies -> splitserve.decode_service.server",
        "3 broken"]),  # the layers (siblings), the router's forbidden list, and torch (a pod loads the model)
    "the engine importing network code or the runtime": (
        {"engine/scheduler.py": "import grpc", "engine/sequence.py": "import splitserve.runtime.metrics"},
        ["splitserve.engine is not allowed to import grpc",
         "splitserve.engine.sequence -> splitserve.runtime.metrics"]),
    "a package importing the benchmarks": ({"splitserve/launcher.py": "import splitserve.bench.serve"}, [
        "splitserve.launcher is not allowed to import splitserve.bench",
        "splitserve.launcher -> splitserve.bench.serve"]),
    "a router import cycle": ({"router/config.py": "import splitserve.router.policies"},  # policies imports config
                              ["no import cycle inside the router BROKEN", "1 broken"]),
    "a router path to torch": ({"router/intake.py": "import splitserve.engine.weights.model_files"},  # weight loader
                               ["splitserve.router is not allowed to import torch",
                                "splitserve.router.intake -> splitserve.engine.weights.model_files"]),
}


@pytest.mark.parametrize("case", WRONG_IMPORTS)
def test_a_wrong_import_breaks_the_contracts(tmp_path, case):
    root = copy_of_the_code(tmp_path)
    added, expected = WRONG_IMPORTS[case]
    for module, statement in added.items():
        add_import(installed_path(root, module), statement)
    result = lint(root)
    assert result.returncode == 1
    for line in expected:
        assert line in result.stdout


def test_the_command_line_loads_a_benchmark_only_when_its_subcommand_runs():
    # The dispatch imports splitserve.bench.NAME and the simulator by name (invisible to the linter): importing the
    # command line loads none of them.
    probe = ("import sys, splitserve.cli; "
             "print(sorted(m for m in sys.modules "
             "if m.split('.')[:2] in (['splitserve', 'bench'], ['splitserve', 'simulator'])))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_router_process_loads_no_torch():
    """What the contract says, in a fresh interpreter: the router's modules, both APIs and a Router with its
    tokenizer loaded by name (the path that used to pull in the weight loaders) leave torch unimported."""
    script = ("import sys, splitserve.router.server, splitserve.router.openai.app; "
              "from splitserve.router.config import RouterConfig; "
              "from splitserve.router.router import Router; "
              "Router(RouterConfig(model='tiny-random', decode_pods=['localhost:1'])); "
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


ENGINE_PROCESS = """
import sys
import splitserve.decode_service.server, splitserve.prefill_service.server
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.sampling.params import StructuredOutput
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
