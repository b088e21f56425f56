"""Every file or folder the docs name exists (``README.md``, ``docs/*.md`` and ``deploy/README.md``), and every file
and symbol docs/architecture.md's request walk names is where it says.

In prose, a backticked word (no spaces) is taken for a path when it ends in a file extension (``.py``, ``.md``,
``.proto``, ...), is a ``Makefile`` / ``Dockerfile``, or contains ``/`` and starts with the name of a file or folder
that exists (so ``engine/weights.py`` and ``router/openai_protocol/`` are checked, while a gRPC method
``splitserve.v1.Generation/Generate`` or a Kubernetes name ``deployments/scale`` is not). Never paths here: absolute
paths and URL routes (``/v1/completions``, ``/proc/self/task``), ``~`` and ``..`` paths, ``$VARIABLES``, words with
``<placeholders>`` or ``{fields}``.

Inside a fenced code block (commands, walks, diagrams), any word is a path when it names a source file (``.py``,
``.proto``, ``.cpp``, ``.md``, ...) or a folder of the repository (``kvtransfer/codecs/``); a command's output files
(``--json run.json``) are not checked, as they exist only once it ran.

A path resolves when it exists relative to the repository root or to the document's folder, or when it is the end
of a path that exists (a table of ``engine/`` files may say ``config.py``, a chart section ``templates/_helpers.tpl``);
a ``*`` glob must match some path.

The request walk (the fenced blocks of docs/architecture.md's section 2) names code as ``file.py Symbol.member``:
each ``Class`` or ``Class.member`` (a name with a capital and a small letter) must be defined, in the file just
before it when there is one (a class's method, property, class attribute, dataclass field or ``self.`` attribute; or
a ``.proto`` message, service or rpc), and so must a ``snake_case`` function named right after a file.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted({REPO / "README.md", REPO / "deploy" / "README.md", *(REPO / "docs").glob("*.md")})
EXTENSIONS = {"py", "md", "proto", "yaml", "yml", "json", "sh", "cpp", "tpl", "toml", "txt", "png", "csv", "pyi",
              "cfg", "ini", "html"}
SKIPPED_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".pytest_cache", ".ruff_cache"}

# What a fenced block's words are checked as: source files, not the data a command writes.
FENCED_EXTENSIONS = {"py", "proto", "cpp", "h", "tpl", "toml", "sh", "md", "yaml", "yml"}
_FENCE = re.compile(r"^ *```.*?^ *```", re.DOTALL | re.MULTILINE)
_PUNCTUATION = "()[]{},;:'\"<>|`"
_CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_PATH_CHARS = re.compile(r"[A-Za-z0-9_.*][A-Za-z0-9_.*/+-]*")


class Tree:
    """The repository's files and folders (without virtual environments, caches and .git), as relative paths."""

    def __init__(self, root: Path = REPO):
        self.root = root
        self.paths: list[str] = []
        for here, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
            prefix = Path(here).relative_to(root).as_posix()
            self.paths += [name if prefix == "." else f"{prefix}/{name}" for name in dirs + files]
        self.names = {p.rsplit("/", 1)[-1] for p in self.paths}

    def has(self, target: str, doc: Path) -> bool:
        target = target.rstrip("/")
        if (self.root / target).exists() or (doc.parent / target).exists():
            return True
        if "*" in target:
            return any(fnmatch.fnmatchcase(p, target) or fnmatch.fnmatchcase(p, "*/" + target) for p in self.paths)
        return any(p == target or p.endswith("/" + target) for p in self.paths)


def named_paths(text: str, tree: Tree) -> list[str]:
    """The paths ``text`` names: backticked in its prose, and as words of its fenced blocks."""
    paths = []
    for span in _CODE_SPAN.findall(_FENCE.sub("", text)):
        word = span.strip()
        if not _PATH_CHARS.fullmatch(word) or word.startswith(("..", "/")):
            continue
        name = word.rstrip("/").rsplit("/", 1)[-1]
        stem, _, extension = name.rpartition(".")
        first = word.split("/", 1)[0]
        if (stem and extension in EXTENSIONS or name in ("Makefile", "Dockerfile")
                or "/" in word and (first in tree.names or (tree.root / first).exists())):
            paths.append(word)
    return paths + [word for block in _FENCE.findall(text) for word in fenced_paths(block, tree)]


def fenced_paths(block: str, tree: Tree) -> list[str]:
    """The source files and repository folders a fenced block's words name."""
    paths = []
    for raw in block.split():
        word = _bare(raw).split("::", 1)[0]  # tests/test_x.py::test_y names the file
        if not _PATH_CHARS.fullmatch(word) or word.startswith(("..", "/", ".")):
            continue
        name = word.rstrip("/").rsplit("/", 1)[-1]
        stem, _, extension = name.rpartition(".")
        if (stem and extension in FENCED_EXTENSIONS) or (word.endswith("/") and (tree.root / word).is_dir()):
            paths.append(word)
    return paths


def _bare(word: str) -> str:
    return word.strip(_PUNCTUATION).removesuffix("()")


@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree()


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_every_backticked_path_in_the_docs_exists(doc, tree):
    missing = sorted({w for w in named_paths(doc.read_text(), tree) if not tree.has(w, doc)})
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"


def test_the_check_sees_paths_and_skips_what_is_not_one(tree):
    text = ("`engine/llm.py`, `config.py`, `deploy/`, `engine/weights.py`, `Makefile`, `router/gone/`; not\n"
            "`/v1/completions`, `~/.cache/x`, `$SPLITSERVE_CACHE_DIR`, `cpu_kernels-<key>.so`, `splitserve.v1`,\n"
            "`Generation/Generate`, `kubernetes.io/tls`, `.proto`, `max_tokens + 1`\n"
            "```\nmake run `inside/a/fence.py` (router/intake.py, kvtransfer/codecs/ tests/test_x.py::test_y\n"
            "--json run.json --plot docs/new.png /abs/path.py ../up.py .venv/bin/python engine/ nowhere/\n```\n")
    readme = REPO / "README.md"
    named = named_paths(text, tree)
    assert named == ["engine/llm.py", "config.py", "deploy/", "engine/weights.py", "Makefile", "router/gone/",
                     "inside/a/fence.py", "router/intake.py", "kvtransfer/codecs/", "tests/test_x.py", "engine/"]
    assert [w for w in named if not tree.has(w, readme)] == ["engine/weights.py", "router/gone/", "inside/a/fence.py",
                                                             "tests/test_x.py"]
    assert tree.has("templates/_helpers.tpl", readme) and tree.has("dashboards/*.json", readme)


# ---- the request walk's symbols -------------------------------------------------------------------------------------

_CLASS_SYMBOL = re.compile(r"[A-Z]\w*[a-z]\w*(\.\w+)?")  # ``RequestRun`` or ``RequestRun._admit``, not ``HTTP``
_FUNCTION_SYMBOL = re.compile(r"[a-z]\w*_\w*")  # ``make_choices``, after a file
_PROTO_NAMES = re.compile(r"^\s*(?:message|service|rpc|enum)\s+(\w+)", re.MULTILINE)
WALK_PROSE = {"None", "True", "False", "PyTorch"}  # capitalised words of a walk that name no code of ours


class Symbols:
    """What the tree defines: per file, its top-level names and each class's members; and every ``.proto`` message,
    service and rpc (the gRPC modules that define them are generated)."""

    def __init__(self, root: Path = REPO):
        self.root = root
        self.top: dict[str, set[str]] = {}  # file -> names defined at its top level
        self.members: dict[str, dict[str, set[str]]] = {}  # file -> class -> its members
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root)
            if SKIPPED_DIRS & set(relative.parts) or relative.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            self._read(relative.as_posix(), ast.parse(path.read_text()))
        self.proto = {name for path in root.rglob("*.proto") if not SKIPPED_DIRS & set(path.parts)
                      for name in _PROTO_NAMES.findall(path.read_text())}

    def _read(self, file: str, tree: ast.Module) -> None:
        top, classes = set(), {}
        for node in tree.body:
            top |= _defined(node)
            if isinstance(node, ast.ClassDef):
                members = {name for statement in node.body for name in _defined(statement)}
                members |= {target.attr for method in ast.walk(node) if isinstance(method, ast.FunctionDef)
                            for assign in ast.walk(method) if isinstance(assign, (ast.Assign, ast.AnnAssign))
                            for target in (assign.targets if isinstance(assign, ast.Assign) else [assign.target])
                            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id == "self"}
                classes[node.name] = members
        self.top[file], self.members[file] = top, classes

    def has(self, symbol: str, file: str | None = None) -> bool:
        """``symbol`` (``Name`` or ``Class.member``) is defined in ``file`` (a path as the docs write it, which may
        be the end of the real one), or anywhere when ``file`` is None."""
        files = [f for f in self.top if file is None or f == file or f.endswith("/" + file)]
        name, _, member = symbol.partition(".")
        for f in files:
            if member and member in self.members[f].get(name, ()):
                return True
            if not member and name in self.top[f]:
                return True
        # A gRPC message, service or rpc: the .proto files define them (``Generation.Generate``).
        return file is None and all(part in self.proto for part in symbol.split("."))


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {n.id for target in node.targets for n in ast.walk(target) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def walk_symbols(block: str) -> list[tuple[str | None, str]]:
    """(the file just before it or None, symbol) for every symbol a walk names."""
    found = []
    words = block.split()
    for i, raw in enumerate(words):
        word = re.sub(r"\(.*$", "", _bare(raw))  # PrefillRequest(decode_address=D) -> PrefillRequest
        before = words[i - 1] if i else ""
        file = before if before.endswith(".py") and _bare(before) == before else None
        if word not in WALK_PROSE and (_CLASS_SYMBOL.fullmatch(word) or (file and _FUNCTION_SYMBOL.fullmatch(word))):
            found.append((file, word))
    return found


def request_walk(text: str) -> list[str]:
    """The fenced blocks of docs/architecture.md's section 2, "A request's path through the files"."""
    section = text.split("\n## 2. ", 1)[1].split("\n## 3. ", 1)[0]
    return _FENCE.findall(section)


def test_every_symbol_of_the_request_walk_is_defined_where_it_says():
    walk = request_walk((REPO / "docs" / "architecture.md").read_text())
    symbols = Symbols()
    named = [(file, symbol) for block in walk for file, symbol in walk_symbols(block)]
    assert len(named) > 60  # the walk names its code
    assert [f"{file or ''} {symbol}".strip() for file, symbol in named if not symbols.has(symbol, file)] == []


def test_the_walk_check_finds_a_missing_file_a_missing_symbol_and_a_symbol_in_the_wrong_file(tree):
    block = ("```\n 1 intake   router/choices.py make_choices -> router/intake.py RequestIntake.make_request\n"
             " 2 gone     router/placement.py Placement._plan (GrammarMasks (grammar_masks.py), HTTP, None)\n"
             " 3 moved    router/router.py RequestRun.serve; Generation.Generate while kvtransfer/wire.py while\n```")
    symbols = Symbols()
    named = walk_symbols(block)
    assert named == [("router/choices.py", "make_choices"), ("router/intake.py", "RequestIntake.make_request"),
                     ("router/placement.py", "Placement._plan"), (None, "GrammarMasks"),
                     ("router/router.py", "RequestRun.serve"), (None, "Generation.Generate")]
    assert [(f, s) for f, s in named if not symbols.has(s, f)] == [("router/placement.py", "Placement._plan"),
                                                                   ("router/router.py", "RequestRun.serve")]
    assert symbols.has("RequestRun.serve", "router/request_run.py") and symbols.has("RequestRun.calls")
    assert [w for w in fenced_paths(block, tree) if not tree.has(w, REPO / "docs" / "x.md")] == ["grammar_masks.py"]

