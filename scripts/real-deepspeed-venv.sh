#!/usr/bin/env bash
# Makes (once) a side virtual environment with the real DeepSpeed from PyPI, for the side-by-side checks
# (benchmarks/peers.py, scripts/cross-checkpoints.py, scripts/upstream-tests.sh). Prints the venv's python.
# torch is pinned to the CPU wheel before DeepSpeed so pip never pulls a CUDA build; DeepSpeed's ops are
# JIT-built on first use, as its docs describe for a plain `pip install deepspeed`.
# Usage: bash scripts/real-deepspeed-venv.sh [VERSION]   (default: the newest release pip offers)
# Env: REAL_DS_VENV (default .venvs/real-deepspeed under the repository root).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${REAL_DS_VENV:-$root/.venvs/real-deepspeed}"
version="${1:-}"
spec="deepspeed${version:+==$version}"
lock="$venv.lock"
mkdir -p "$(dirname "$venv")"
# One builder at a time: concurrent callers wait for the first one's venv.
exec 9>"$lock"
flock 9
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import deepspeed" >/dev/null 2>&1; then
  python="${PYTHON:-$(command -v python3 || command -v python)}"
  echo "real-deepspeed-venv: creating $venv ($spec)" >&2
  "$python" -m venv "$venv"
  pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" torch==2.13.0 numpy
  "${pip[@]}" setuptools wheel ninja packaging psutil py-cpuinfo hjson msgpack einops "pydantic>=2" tqdm
  DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation "$spec"
fi
echo "$venv/bin/python"
