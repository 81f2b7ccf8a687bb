#!/usr/bin/env bash
# A/B of the staging-area release (kvcache/offload.py) on one device machine: the 8B shape at 512K, once as shipped
# (released on the first decode step) and once with `release_staging` patched to a no-op; JSON and logs in $OUT.
# Run the B side second only for a warm Triton cache in both, or swap them: the first run compiles.
bench() {  # bench LABEL [PYTHON STATEMENT RUN BEFORE THE CLI]
    timeout 290 python3 -c "import sys; $2
from longreach.cli import main; sys.exit(main(['bench', 'decode'] + sys.argv[1:]))" \
        --kv-cache-dtype fp8 --kv-cache-memory-gb 4 --max-num-batched-tokens 65536 --kv-offloading-size 40 \
        --lengths 512K --attention infinitehip:3k-flash --dense-lengths --out "$OUT/ab-$1.json" > "$OUT/ab-$1.log" 2>&1
    echo "$1: exit $?"
}
bench release ""
bench keep "import longreach.kvcache.offload as o; o.OffloadedKVCache.release_staging = lambda self: None"
for f in release keep; do grep "decode:.*prefill .* s, decode" "$OUT/ab-$f.log"; grep captured "$OUT/ab-$f.log" | tail -4; done
