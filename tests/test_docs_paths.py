"""Every file or folder the docs name in backticks exists: ``README.md``, ``docs/*.md`` and ``deploy/README.md``.

A backticked word (no spaces) is taken for a path when it ends in a file extension (``.py``, ``.md``, ``.proto``,
...), is a ``Makefile`` / ``Dockerfile``, or contains ``/`` and starts with the name of a file or folder that
exists (so ``engine/weights.py`` and ``router/openai_protocol/`` are checked, while a gRPC method
``splitserve.v1.Generation/Generate`` or a Kubernetes name ``deployments/scale`` is not). Never paths here:
absolute paths and URL routes (``/v1/completions``, ``/proc/self/task``), ``~`` and ``..`` paths, ``$VARIABLES``,
words with ``<placeholders>`` or ``{fields}``, and anything inside a fenced code block (commands).

A path resolves when it exists relative to the repository root or to the document's folder, or when it is the end
of a path that exists (a table of ``engine/`` files may say ``config.py``, a chart section ``templates/_helpers.tpl``);
a ``*`` glob must match some path.
"""

from __future__ import annotations

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

_FENCE = re.compile(r"^ *```.*?^ *```", re.DOTALL | re.MULTILINE)
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
    return paths


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
            "```\nmake run `inside/a/fence.py`\n```\n")
    readme = REPO / "README.md"
    named = named_paths(text, tree)
    assert named == ["engine/llm.py", "config.py", "deploy/", "engine/weights.py", "Makefile", "router/gone/"]
    assert [w for w in named if not tree.has(w, readme)] == ["engine/weights.py", "router/gone/"]
    assert tree.has("templates/_helpers.tpl", readme) and tree.has("dashboards/*.json", readme)
