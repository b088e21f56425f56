"""The shape of the house, measured (issues 33 and 44): what a newcomer reads must not drift from what is there.

- every package's ``__init__.py`` docstring names each of its modules (``name.py``) and subpackages (``name/``);
- the number of import contracts that docs/architecture.md states is the number pyproject.toml holds;
- no folder of code holds more than ``MAX_PY_FILES`` Python files;
- files by concept, never by count: no module is longer than ``MAX_LINES`` lines unless ``LONG_FILE_CEILINGS`` gives it
  a ceiling and a reason; a listed module past its ceiling fails, and so does one back under ``MAX_LINES`` (its entry
  goes). The measure is a smell detector, not a target: squeezing a file under it is worse than the entry;
- no line of hand-written Python, tests included, is wider than ``MAX_COLUMNS`` (pyproject's ``[tool.ruff]``
  line-length), but in the files of ``KNOWN_WIDE_FILES``, each of which fails once it has no wide line left;
- no import cycle between modules, counting imports inside functions and those under ``if TYPE_CHECKING:``, but the
  cycles of ``KNOWN_CYCLES``, each of which fails once it is cut;
- nothing imports ``splitserve.bench``: not the simulator, not the measurement library, not ``scripts/``.

Exempt from the size measures: ``tests/`` (a test module gathers the scenarios of one subject, and reads one at a
time) and the generated gRPC modules (``*_pb2.py``, ``*_pb2_grpc.py``: ``protos/splitserve/v1/``, written by
``python -m splitserve.protos.generate``), which the width check skips too. The measures also run as a script:
``.venv/bin/python tests/test_structure.py`` prints every figure.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]  # import name -> the folder it installs from
MAX_PY_FILES = 15
MAX_LINES = 500
MAX_COLUMNS = PYPROJECT["tool"]["ruff"]["line-length"]
GENERATED = re.compile(r"_pb2(_grpc)?\.py$")
NOT_CODE = {".git", ".venv", "__pycache__", "tests", "build"}  # folders the size measures skip
# Over a limit today, in another engineer's area: each entry names the area that owns it (delete it once it is
# under the limit; the tests fail when an entry is no longer needed).
KNOWN_LARGE_FOLDERS: dict[str, str] = {}
# Modules allowed past MAX_LINES: path -> (the most lines it may have, why it is one concept that long).
LONG_FILE_CEILINGS: dict[str, tuple[int, str]] = {}
# Files with lines wider than MAX_COLUMNS, left to the engineer rewriting them (issue 44's engine side).
KNOWN_WIDE_FILES: dict[str, str] = {}
# Import cycles known and owned elsewhere, each listed as its sorted modules (none today).
KNOWN_CYCLES: list[list[str]] = []


# ---- the tree -------------------------------------------------------------------------------------------------------

def packages() -> dict[str, Path]:
    """Every package of the installed tree (import name -> folder), as pyproject's package-dir maps the folders."""
    found = {}
    for name, folder in PACKAGE_DIRS.items():
        for init in sorted((REPO / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(REPO / folder)
            if "__pycache__" not in relative.parts and not (name == "splitserve.protos" and relative.parts):
                found[".".join([name, *relative.parts])] = init.parent  # protos/splitserve/v1 is splitserve.v1
    return found


def modules() -> dict[str, Path]:
    """Every module of the installed tree (import name -> file); a package's own name -> its ``__init__.py``."""
    found = {}
    for name, folder in packages().items():
        found[name] = folder / "__init__.py"
        for path in sorted(folder.glob("*.py")):
            if path.name != "__init__.py":
                found[f"{name}.{path.stem}"] = path
    return found


def scripts() -> list[Path]:
    return sorted((REPO / "scripts").glob("*.py"))


# ---- package docstrings ----------------------------------------------------------------------------------------------

def unnamed_modules(folder: Path) -> list[str]:
    """The modules (``name.py``) and subpackages (``name/``) of the package in ``folder`` that its ``__init__.py``
    docstring does not name; a generated module counts as named when its ``.proto`` file is, and ``__main__.py``
    (``python -m`` of the package itself) needs no name."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    missing = []
    for path in sorted(folder.iterdir()):
        if path.suffix == ".py" and path.name not in ("__init__.py", "__main__.py"):
            proto = GENERATED.sub(".proto", path.name)
            if path.name not in doc and not (proto != path.name and proto in doc):
                missing.append(path.name)
        elif (path / "__init__.py").is_file() and f"{path.name}/" not in doc:
            missing.append(f"{path.name}/")
    return missing


def test_every_package_docstring_names_its_modules():
    missing = {name: gaps for name, folder in packages().items() if (gaps := unnamed_modules(folder))}
    assert not missing, missing


def test_a_module_left_out_of_its_package_docstring_is_found(tmp_path):
    (tmp_path / "__init__.py").write_text('"""A package: ``named.py`` and ``sub/``."""\n')
    for name in ("named.py", "forgotten.py", "sub/__init__.py", "lost/__init__.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert unnamed_modules(tmp_path) == ["forgotten.py", "lost/"]


# ---- the import contracts' count in the docs -------------------------------------------------------------------------

def stated_contract_count(text: str) -> int:
    """The count docs/architecture.md gives ("... as N `import-linter` contracts")."""
    match = re.search(r"as (\d+) `import-linter` contracts", text)
    assert match, "docs/architecture.md no longer states how many import contracts there are"
    return int(match.group(1))


def test_the_docs_state_as_many_import_contracts_as_pyproject_holds():
    text = (REPO / "docs" / "architecture.md").read_text()
    contracts = PYPROJECT["tool"]["importlinter"]["contracts"]
    assert stated_contract_count(text) == len(contracts)
    kept, broken = map(int, re.search(r"Contracts: (\d+) kept, (\d+) broken", text).groups())  # the example's output
    assert kept + broken == len(contracts)


# ---- sizes ----------------------------------------------------------------------------------------------------------

def code_files() -> list[Path]:
    """Every hand-written Python file outside ``NOT_CODE`` folders."""
    return [path for path in python_files() if "tests" not in path.relative_to(REPO).parts[:-1]]


def python_files() -> list[Path]:
    """Every hand-written Python file of the tree, tests included."""
    skipped = NOT_CODE - {"tests"}
    return [path for path in sorted(REPO.rglob("*.py"))
            if not skipped & set(path.relative_to(REPO).parts[:-1]) and not GENERATED.search(path.name)
            and not path.relative_to(REPO).parts[0].endswith(".egg-info")]


def large_folders() -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in code_files():
        folder = path.parent.relative_to(REPO).as_posix()
        counts[folder] = counts.get(folder, 0) + 1
    return {folder: n for folder, n in counts.items() if n > MAX_PY_FILES}


def line_counts() -> dict[str, int]:
    return {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in code_files()}


def size_faults(lengths: dict[str, int], ceilings: dict[str, tuple[int, str]]) -> dict[str, str]:
    """What is wrong with the modules' sizes: a module past ``MAX_LINES`` with no ceiling, one past its ceiling, and
    a ceiling no longer needed (its module is back under ``MAX_LINES``, or gone)."""
    faults = {}
    for path, n in lengths.items():
        ceiling = ceilings.get(path, (MAX_LINES, ""))[0]
        if n > ceiling:
            faults[path] = f"{n} lines, past {'its ceiling' if path in ceilings else 'MAX_LINES'} of {ceiling}"
    for path in ceilings:
        if lengths.get(path, 0) <= MAX_LINES:
            faults[path] = f"{lengths.get(path, 'no')} lines: no longer needs a ceiling past {MAX_LINES}"
    return faults


def wide_lines(paths: list[Path], root: Path = REPO) -> dict[str, list[int]]:
    """File (relative to ``root``) -> its lines (1-based) wider than ``MAX_COLUMNS`` characters."""
    found = {}
    for path in paths:
        numbers = [i for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > MAX_COLUMNS]
        if numbers:
            found[path.relative_to(root).as_posix()] = numbers
    return found


def test_no_folder_holds_more_than_15_python_files():
    assert set(large_folders()) <= set(KNOWN_LARGE_FOLDERS), large_folders()
    assert not set(KNOWN_LARGE_FOLDERS) - set(large_folders()), "a known large folder is no longer large: drop it"


def test_no_module_is_past_its_size_ceiling_and_no_ceiling_outlives_its_need():
    assert size_faults(line_counts(), LONG_FILE_CEILINGS) == {}


def test_the_size_check_fails_on_a_long_module_a_broken_ceiling_and_a_ceiling_not_needed():
    lengths = {"a.py": MAX_LINES, "b.py": MAX_LINES + 1, "c.py": 700, "d.py": 900, "e.py": 100}
    ceilings = {"c.py": (800, "one concept"), "d.py": (800, "one concept"), "e.py": (800, "was long")}
    assert size_faults(lengths, ceilings) == {
        "b.py": f"{MAX_LINES + 1} lines, past MAX_LINES of {MAX_LINES}", "d.py": "900 lines, past its ceiling of 800",
        "e.py": f"100 lines: no longer needs a ceiling past {MAX_LINES}"}


def test_no_line_is_wider_than_the_projects_width():
    wide = wide_lines(python_files())
    assert {path: lines for path, lines in wide.items() if path not in KNOWN_WIDE_FILES} == {}
    assert not set(KNOWN_WIDE_FILES) - set(wide), "a known wide file has no wide line left: drop it"


def test_the_width_check_counts_characters_past_the_width(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\n" + "#" * MAX_COLUMNS + "\n" + "é" * (MAX_COLUMNS + 1) + "\n")
    (tmp_path / "n.py").write_text("y = 2\n")
    assert wide_lines([tmp_path / "m.py", tmp_path / "n.py"], tmp_path) == {"m.py": [3]}


# ---- imports ---------------------------------------------------------------------------------------------------------

def imported_names(path: Path, module: str | None = None) -> list[str]:
    """Every absolute module name ``path`` imports, at the top, inside a function or under ``if TYPE_CHECKING:`` (a
    type-only import still ties the two modules: neither reads without the other), ``from X import Y`` as both ``X``
    and ``X.Y``."""
    tree = ast.parse(path.read_text())
    package = module.rsplit(".", 1)[0] if module and path.name != "__init__.py" else module
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0] if node.level > 1 else package,
                                              base]))
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (a name that is no module of the tree, such as ``X.Y`` where Y
    is a function, is dropped)."""
    known = modules()
    return {name: {target for target in imported_names(path, name) if target in known and target != name}
            for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_modules_late_and_type_only_imports_included():
    found = cycles(import_graph())
    assert [cycle for cycle in found if cycle not in KNOWN_CYCLES] == []
    assert [cycle for cycle in KNOWN_CYCLES if cycle not in found] == [], "a known cycle is cut: drop it"


def test_a_late_or_type_only_import_that_closes_a_cycle_is_found(tmp_path):
    (tmp_path / "a.py").write_text("import pkg.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg import a\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    (tmp_path / "d.py").write_text("import pkg.c\n")
    graph = {f"pkg.{name}": {t for t in imported_names(tmp_path / f"{name}.py", f"pkg.{name}")
                             if t in ("pkg.a", "pkg.b", "pkg.c", "pkg.d")} for name in "abcd"}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}, "pkg.d": {"pkg.c"}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]
    (tmp_path / "a.py").write_text("import pkg.b\nimport pkg.d\n")  # a -> d -> c -(type only)-> a
    graph["pkg.a"] = {t for t in imported_names(tmp_path / "a.py", "pkg.a") if t.startswith("pkg.")}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.d"]]


def importers_of_the_benchmarks() -> dict[str, list[str]]:
    """Modules outside ``splitserve.bench``, and ``scripts/``, that import it."""
    sources = {name: path for name, path in modules().items() if name.split(".")[:2] != ["splitserve", "bench"]}
    sources |= {f"scripts/{path.name}": path for path in scripts()}
    found = {}
    for name, path in sources.items():
        bench = [t for t in imported_names(path, name) if t == "splitserve.bench" or t.startswith("splitserve.bench.")]
        if bench:
            found[name] = bench
    return found


def test_nothing_imports_the_benchmarks():
    assert importers_of_the_benchmarks() == {}


if __name__ == "__main__":  # the measures, printed: python tests/test_structure.py
    print(f"folders over {MAX_PY_FILES} Python files: {large_folders() or 'none'} "
          f"(known: {', '.join(KNOWN_LARGE_FOLDERS) or 'none'})")
    print(f"module sizes: {size_faults(line_counts(), LONG_FILE_CEILINGS) or 'within their limits'}; the longest: "
          f"{sorted(line_counts().items(), key=lambda item: -item[1])[:5]}")
    print(f"lines over {MAX_COLUMNS} columns: { {p: len(n) for p, n in wide_lines(python_files()).items()} or 'none'} "
          f"(known: {', '.join(KNOWN_WIDE_FILES) or 'none'})")
    print(f"import cycles: {cycles(import_graph()) or 'none'}")
    print(f"importers of splitserve.bench: {importers_of_the_benchmarks() or 'none'}")
    print(f"package docstrings missing modules: "
          f"{ {n: g for n, f in packages().items() if (g := unnamed_modules(f))} or 'none'}")
    sys.exit(0)
