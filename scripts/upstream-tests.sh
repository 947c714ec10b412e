#!/usr/bin/env bash
# Runs DeepSpeed's own unit tests (tests/unit of a DeepSpeed checkout) against this project, one file at a time,
# and prints a table per file: collected / passed / failed / skipped / hung (docs/upstream-tests.md keeps one).
#
# Usage: bash scripts/upstream-tests.sh [options] DEEPSPEED_CHECKOUT [FILE ...]
#   FILE          test files relative to tests/unit (runtime/test_pld.py); default: every tests/unit/**/test_*.py
#   -p PYTHON     the interpreter whose `deepspeed` is tested (default: the project's hatch test env; give the
#                 python of scripts/real-deepspeed-venv.sh to measure real DeepSpeed on the same files)
#   -f LIST       read FILEs from a file (one a line, # comments)
#   -t SECONDS    wall-clock limit per file (default 600): a file still running then is killed with its ranks
#                 and the test it was running is counted as hung
#   -o DIR        results folder (default: a new temporary folder); re-running into it resumes (-r) or overwrites
#   -r            resume: skip files that already have a result in DIR
#   -m FILE       also write the table as markdown to FILE
#   -k EXPR       only the tests pytest's -k EXPR selects, in every file (a sample of a big parametrized file)
# DeepSpeed's tests import a few packages themselves (py-cpuinfo, hjson: DeepSpeed's own dependencies; mup): they
# are installed once with that python's pip into .venvs/upstream-test-extras-<python>, put on PYTHONPATH for the
# run only, so the project's environments stay as hatch.toml declares them.
# Env: DS_ACCELERATOR (cpu), LOCAL_SIZE (4), DS_UNITTEST_TIMEOUT (DeepSpeed's own per-test rank timeout; default
# 300), passed to every file. The Hugging Face hub is put offline so tests needing a download fail fast.
#
# The tests never import the checkout's own `deepspeed` package: DeepSpeed's tests/conftest.py puts the folder
# above tests/ on sys.path, so the tests run from a copy of tests/ in the results folder, whose parent holds no
# deepspeed/. A preflight check prints which `deepspeed` the interpreter imports from there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="" list="" per_file=600 out="" resume=0 markdown="" select=""
while getopts "p:f:t:o:rm:k:h" opt; do
  case "$opt" in
    p) python="$OPTARG" ;; f) list="$OPTARG" ;; t) per_file="$OPTARG" ;; o) out="$OPTARG" ;;
    r) resume=1 ;; m) markdown="$OPTARG" ;; k) select="$OPTARG" ;;
    *) sed -n '2,21p' "${BASH_SOURCE[0]}"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [ $# -lt 1 ] || [ ! -d "$1/tests/unit" ]; then
  echo "upstream-tests: give the path of a DeepSpeed checkout (a folder with tests/unit); got '${1:-}'" >&2
  exit 2
fi
checkout="$(cd "$1" && pwd)"; shift
if [ -z "$python" ]; then
  python="$(bash "$root/scripts/hatch" env find test)/bin/python"
  [ -x "$python" ] || bash "$root/scripts/hatch" run test:python -c "pass"  # builds the test env once
fi
[ -x "$python" ] || { echo "upstream-tests: no python at '$python'" >&2; exit 2; }
if ! "$python" -c "import pytest, transformers" >/dev/null 2>&1; then
  echo "upstream-tests: $python lacks pytest or transformers (DeepSpeed's tests need both); install them into" \
       "that environment first: $python -m pip install pytest transformers" >&2
  exit 2
fi

files=("$@")
if [ -n "$list" ]; then mapfile -t -O "${#files[@]}" files < <(sed -e 's/#.*//' -e '/^\s*$/d' "$list"); fi
if [ ${#files[@]} -eq 0 ]; then
  mapfile -t files < <(cd "$checkout/tests/unit" && find . -name 'test_*.py' | sed 's|^\./||' | sort)
fi

out="${out:-$(mktemp -d -t upstream-tests.XXXXXX)}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$out/work"
rm -rf "$work" && mkdir -p "$work" && cp -r "$checkout/tests" "$work/tests"
# Two files reach the checkout's top-level helpers by path: ops/test_op_builder.py loads op_builder/builder.py as a
# file, utils/test_nvtx.py imports accelerator.cuda_accelerator. Copy those, never the checkout's deepspeed/; only
# builder.py of op_builder/, so `from op_builder import __deepspeed__` (real DeepSpeed's "running from a source
# tree" probe) still fails and real DeepSpeed keeps loading its installed op builders.
[ -d "$checkout/accelerator" ] && cp -r "$checkout/accelerator" "$work/accelerator"
[ -f "$checkout/op_builder/builder.py" ] && mkdir -p "$work/op_builder" && cp "$checkout/op_builder/builder.py" "$work/op_builder/"
printf '%s\n' "${files[@]}" > "$out/files.txt"

export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" LOCAL_SIZE="${LOCAL_SIZE:-4}"
export DS_UNITTEST_TIMEOUT="${DS_UNITTEST_TIMEOUT:-300}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
extras="$root/.venvs/upstream-test-extras-$("$python" -c 'import sys, hashlib; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:8])')"
# DeepSpeed pins pytest<8.4 (requirements-dev.txt): under pytest 8.4+ its DistributedFixture fixtures are not
# found (checkpoint/test_universal_checkpoint.py errors on every test). The extras folder holds that pytest too;
# being on PYTHONPATH it shadows the environment's own pytest for these runs only. --no-deps: its dependencies
# (pluggy, iniconfig, packaging) are the environment's, already new enough for any pytest 8.
pytest_spec="pytest>=8.3,<8.4"
extras_ok="import cpuinfo, hjson, mup, pytest; assert pytest.version_tuple[:2] == (8, 3), pytest.__file__"
if ! PYTHONPATH="$extras" "$python" -c "$extras_ok" >/dev/null 2>&1; then
  "$python" -m pip install -q --disable-pip-version-check --target "$extras" py-cpuinfo hjson >&2
  "$python" -m pip install -q --disable-pip-version-check --no-deps --target "$extras" mup >&2  # torch-only use
  "$python" -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$extras" "$pytest_spec" >&2
  PYTHONPATH="$extras" "$python" -c "$extras_ok" || {
    echo "upstream-tests: $extras does not give $python the pytest DeepSpeed's tests expect ($pytest_spec)" >&2
    exit 2
  }
fi
export PYTHONPATH="$root/scripts:$extras${PYTHONPATH:+:$PYTHONPATH}"

# A JIT build killed mid-way (a file killed at the limit while real DeepSpeed compiled an op) leaves torch's
# extension lock behind, and every later build of that op waits on it forever: say so up front.
for lock in "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}"/*/*/lock; do
  [ -e "$lock" ] && echo "upstream-tests: warning: $lock exists; if no build is running, delete it (a" \
    "killed JIT build leaves it, and later builds of that op wait on it forever)" >&2
done
cd "$work/tests"
imported="$("$python" -c "import sys; sys.path.insert(1, '..'); import deepspeed; print(deepspeed.__file__)")"
case "$imported" in "$work"*|"$checkout"*)
  echo "upstream-tests: the run would import the checkout's own deepspeed ($imported)" >&2; exit 2 ;;
esac
{
  echo "deepspeed under test: $imported ($("$python" -c 'import deepspeed; print(deepspeed.__version__)'))"
  echo "DeepSpeed tests: $checkout ($(git -C "$checkout" describe --tags --always 2>/dev/null || echo unknown))"
  echo "python: $python; torch $("$python" -c 'import torch; print(torch.__version__)'); $(nproc) cores; $(date -u +%F)"
  echo "pytest: $("$python" -m pytest --version 2>&1 | head -1) ($("$python" -c 'import pytest; print(pytest.__file__)'))"
  echo "env: DS_ACCELERATOR=$DS_ACCELERATOR LOCAL_SIZE=$LOCAL_SIZE DS_UNITTEST_TIMEOUT=$DS_UNITTEST_TIMEOUT; per-file limit ${per_file}s${select:+; -k '$select'}"
} | tee "$out/run-info.txt"

for f in "${files[@]}"; do
  stem="$out/${f//\//__}"; stem="${stem%.py}"
  if [ "$resume" = 1 ] && [ -f "$stem.status" ]; then continue; fi
  rm -f "$stem.events" "$stem.status" "$stem.log"
  start=$(date +%s.%N)
  rc=0
  # timeout (without --foreground) puts pytest in its own process group and signals the whole group, so the
  # ranks DeepSpeed's DistributedTest spawned die with it.
  UPSTREAM_TESTS_EVENTS="$stem.events" timeout -k 15 "$per_file" "$python" -m pytest "unit/$f" ${select:+-k "$select"} \
    -p upstream_tests -p no:cacheprovider -o console_output_style=classic --color=no -q -rN \
    >"$stem.log" 2>&1 || rc=$?
  seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
  timed_out=0; [ "$rc" = 124 ] || [ "$rc" = 137 ] && timed_out=1
  pytest_exit=0; grep -q "Test hanged, exiting" "$stem.log" && pytest_exit=1
  printf 'rc=%s\nseconds=%s\ntimed_out=%s\npytest_exit=%s\n' "$rc" "$seconds" "$timed_out" "$pytest_exit" > "$stem.status"
  printf '%-70s rc=%-3s %6.0fs\n' "$f" "$rc" "$seconds"
done

echo
python3 "$root/scripts/upstream_tests.py" summary "$out"
if [ -n "$markdown" ]; then
  { cat "$out/run-info.txt" | sed 's/^/    /'; echo; python3 "$root/scripts/upstream_tests.py" summary --markdown "$out"; } > "$markdown"
  echo "markdown table: $markdown"
fi
echo "results: $out"
