#!/usr/bin/env bash
# Builds one hatch environment in the open; scripts/hatch runs it on the first command that needs the environment.
#   bash scripts/build-env.sh ENV
# Prints what it installs and roughly how long that takes, then every package as it is installed (hatch -v), then
# the time and size. hatch.toml's installer is uv, which does not read pip's configuration: the settings that say
# where packages come from (find-links, index-url, extra-index-url, constraint; pip's environment variables first,
# then its config files) are handed to uv, so a machine's local wheels and caps still apply.
#   DS_TORCH=cpu    torch's CPU build from PyTorch's CPU index      DS_TORCH=pypi   the configured indexes only
#   unset           the CPU index where no NVIDIA GPU is present (PyPI's Linux torch is the ~5.5 GB CUDA build)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
hatch="$tools/bin/hatch"
env="${1:?usage: build-env.sh ENV}"
cpu_index="https://download.pytorch.org/whl/cpu"
say() { echo "scripts/hatch: $*" >&2; }

describe() {
  case "$1" in
    default) echo "torch 2.13.0, pydantic, PyYAML, numpy, ninja, cffi, tqdm and the nine packages of packages/" \
                  "(editable): about 0.8 GB" ;;
    test|bench) echo "the default environment's packages plus pytest, hypothesis, ruff, transformers, accelerate," \
                     "tensorboard, wandb, comet_ml and safetensors: about 1.2 GB" ;;
    *) echo "the dependencies hatch.toml lists for it" ;;
  esac
}

has_nvidia_gpu() { compgen -G "/proc/driver/nvidia/gpus/*" >/dev/null || compgen -G "/dev/nvidia[0-9]*" >/dev/null; }

reachable() {  # a TCP connection to host:443 within 5 s (an unreachable index costs pip/uv retries per package)
  "$tools/bin/python" -c 'import socket, sys; socket.create_connection((sys.argv[1], 443), timeout=5).close()' \
    "$1" >/dev/null 2>&1
}

torch_index() {  # prints the extra index to put first, or nothing; says why
  case "${DS_TORCH:-auto}" in
    pypi) say "DS_TORCH=pypi: torch from the configured indexes" ;;
    cpu) say "DS_TORCH=cpu: torch's CPU build from $cpu_index"; echo "$cpu_index" ;;
    auto)
      if has_nvidia_gpu; then
        say "NVIDIA GPU found: torch with CUDA from the configured indexes (PyPI's: ~5.5 GB with its nvidia-*" \
            "libraries; DS_TORCH=cpu for the CPU build)"
      elif reachable download.pytorch.org; then
        say "no NVIDIA GPU: torch's CPU build (~190 MB) from $cpu_index, not PyPI's CUDA build (~5.5 GB;" \
            "DS_TORCH=pypi for that)"
        echo "$cpu_index"
      else
        say "no NVIDIA GPU, but download.pytorch.org is unreachable: torch from the configured indexes (a local" \
            "CPU wheel where pip's find-links has one, else PyPI's Linux build, the CUDA one, ~5.5 GB)"
      fi ;;
    *) say "DS_TORCH=$DS_TORCH is not one of: cpu, pypi (or unset: by the presence of an NVIDIA GPU)"; exit 2 ;;
  esac
}

say "first use of the '$env' environment: building it now ($(describe "$env"); about a minute with a fast" \
    "network, several on a slow one). Later commands start at once."
eval "$("$tools/bin/python" "$root/scripts/pip_to_uv.py")"
first="$(torch_index)"
if [ -n "$first" ]; then
  export UV_EXTRA_INDEX_URL="$first${UV_EXTRA_INDEX_URL:+ $UV_EXTRA_INDEX_URL}"
  export PIP_EXTRA_INDEX_URL="$first${PIP_EXTRA_INDEX_URL:+ $PIP_EXTRA_INDEX_URL}"  # should hatch.toml go back to pip
fi
# pip's rule for several indexes: the best version across all of them (uv's default stops at the first index that
# has the package, which breaks on a local mirror holding older versions); torch's +cpu build then wins as with pip.
export UV_INDEX_STRATEGY="${UV_INDEX_STRATEGY:-unsafe-best-match}"
export UV_VENV_SEED=1  # pip inside the environment too, for `python -m pip` in an activated environment
start=$SECONDS
# -v: hatch passes the installer its normal verbosity, so every package shows as it is installed.
if ! "$hatch" -v env create "$env" >&2; then
  say "building the '$env' environment failed (see above); remove what is left with:" \
      "bash scripts/hatch env remove $env"
  exit 1
fi
where="$("$hatch" env find "$env")"
say "the '$env' environment is ready after $((SECONDS - start)) s: $where ($(du -sh "$where" 2>/dev/null | cut -f1))"
