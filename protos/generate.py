"""Regenerates the Python modules of the ``splitserve.v1`` protos, or checks that they are up to date.

    python -m splitserve.protos.generate           # rewrite protos/splitserve/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python -m splitserve.protos.generate --check   # exit 1, listing what differs, when the committed modules are stale

Protos compile with ``protos/`` as the include path: a proto imports ``"splitserve/v1/common.proto"`` (its proto
package's path) and the generated code imports ``splitserve.v1.common_pb2``, which is where the package installs
(pyproject.toml maps ``protos/splitserve/v1`` to ``splitserve.v1``), so the generated files are used exactly as
protoc writes them.

Both modes compile into a temporary directory first: ``--check`` compares that with the tree (so CI catches
a ``.proto`` edited without regenerating, a hand-edited module, or one left behind by a deleted ``.proto``),
and a write replaces the tree's generated files only once protoc has succeeded. The output depends only on
the ``.proto`` files and the grpcio-tools version, so the check is exact.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = Path("protos")  # the include path, relative to the repository root
PROTO_PACKAGE_DIR = PROTO_ROOT / "splitserve" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# google/protobuf/*.proto (Struct...), as grpcio-tools ships them.
WELL_KNOWN_TYPES = Path(grpc_tools.__file__).parent / "_proto"


def compile_protos(repo_root: Path) -> dict[str, bytes]:
    """Compiles every .proto of the package; returns {file name: contents} of the generated modules."""
    proto_files = sorted((repo_root / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not proto_files:
        raise SystemExit(f"no .proto files in {repo_root / PROTO_PACKAGE_DIR}")
    with tempfile.TemporaryDirectory() as out:
        rc = protoc.main([
            "grpc_tools.protoc",
            f"--proto_path={repo_root / PROTO_ROOT}",
            f"--proto_path={WELL_KNOWN_TYPES}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            *map(str, proto_files),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed with exit code {rc}")
        generated = Path(out) / PROTO_PACKAGE_DIR.relative_to(PROTO_ROOT)
        return {path.name: path.read_bytes() for path in sorted(generated.iterdir())}


def committed_modules(repo_root: Path) -> dict[str, bytes]:
    """The generated modules now in the tree, by file name."""
    return {
        path.name: path.read_bytes()
        for path in sorted((repo_root / PROTO_PACKAGE_DIR).iterdir())
        if path.name.endswith(GENERATED_SUFFIXES)
    }


def drift(repo_root: Path) -> list[str]:
    """Generated files that are missing, different or stale in the tree, as 'path (why)' lines."""
    fresh, committed = compile_protos(repo_root), committed_modules(repo_root)
    problems = []
    for name in sorted(fresh.keys() | committed.keys()):
        if name not in committed:
            why = "missing"
        elif name not in fresh:
            why = "stale: no .proto generates it"
        elif fresh[name] != committed[name]:
            why = "differs"
        else:
            continue
        problems.append(f"{PROTO_PACKAGE_DIR / name} ({why})")
    return problems


def regenerate(repo_root: Path) -> list[str]:
    """Rewrites the tree's generated modules, deleting stale ones; returns the names written."""
    fresh = compile_protos(repo_root)
    package_dir = repo_root / PROTO_PACKAGE_DIR
    for name in committed_modules(repo_root).keys() - fresh.keys():
        (package_dir / name).unlink()
    for name, contents in fresh.items():
        (package_dir / name).write_bytes(contents)
    return sorted(fresh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitserve.protos.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report generated files that are out of date")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift(REPO_ROOT)
        if problems:
            print("generated protos are out of date; run `python -m splitserve.protos.generate`:", *problems,
                  sep="\n  ")
            return 1
        print("generated protos are up to date")
        return 0
    written = regenerate(REPO_ROOT)
    print(f"wrote {len(written)} files to {PROTO_PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
