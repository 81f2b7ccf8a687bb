#!/usr/bin/env bash
# The GPU runs the open issues wait for, grouped so that one device call does one group (each fits 10 minutes on an
# H100). Logs and JSON go to $OUT (the device tool brings them back). Usage, from the repository root:
#   bash scripts/device_runs.sh kernels     # gpu_check without a model: kernels vs references (bf16, fp8, tiered)
#   bash scripts/device_runs.sh decode8b    # bench decode, Llama-3.1-8B shape: 128K with a profile, then 1M
#   bash scripts/device_runs.sh engine      # needs /tmp/m/model.gguf (scripts/device_model.sh): gpu_check engine
#   bash scripts/device_runs.sh smollm1m    # needs the model: SmolLM2 at 1M, offloaded (2 GiB pool) vs not
#   bash scripts/device_runs.sh serve       # needs the model: scripts/device_serve_bench.sh
# A group's first command compiles kernels (~30-60 s); bench decode runs an untimed warm-up prompt first.
set -u
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
model=${MODEL:-/tmp/m/model.gguf}
run() {  # run NAME SECONDS CMD...: the command's output in $out/NAME.log, its tail on stdout
    local name=$1 secs=$2; shift 2
    echo "== $name: $*"
    timeout "$secs" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $?"
    tail -14 "$out/$name.log"
}
bd="python3 -m longreach bench decode --kv-cache-dtype fp8 --kv-cache-memory-gb 4 --max-num-batched-tokens 65536"
case "${1:-}" in
kernels)
    run gpu_check_kernels 560 python3 scripts/gpu_check.py --out "$out" --only paged block-sparse chunk offload \
        minference fused
    ;;
decode8b)
    run decode_128k 200 $bd --kv-offloading-size 12 --lengths 128k --attention infinitehip:3k-flash \
        --dense-lengths 4k 128k --profile-steps 8 --out "$out/bench-decode-128k.json"
    run decode_1m 380 $bd --kv-offloading-size 76 --lengths 1M --attention infinitehip:3k-flash --dense-lengths \
        --out "$out/bench-decode-1m.json"
    ;;
engine)
    run gpu_check_engine 560 python3 scripts/gpu_check.py --model "$model" --out "$out" --only engine fp32
    ;;
smollm1m)
    # offloaded with a 2 GiB GPU page cache, then the same without offloading (its 23 GiB of KV fit an H100)
    sm="python3 -m longreach bench decode --model $model --text-source paul-graham --lengths 1M \
        --attention infinitehip:3k-flash --max-num-batched-tokens 65536 --dense-lengths"
    run smollm2_1m_offload 280 $sm --kv-offloading-size 26 --kv-cache-memory-gb 2 \
        --out "$out/bench-decode-smollm2-1m-offload.json"
    run smollm2_1m_gpu 280 $sm --out "$out/bench-decode-smollm2-1m-gpu.json"
    ;;
serve)
    run serve 560 bash scripts/device_serve_bench.sh
    ;;
*)
    echo "usage: bash scripts/device_runs.sh kernels|decode8b|engine|smollm1m|serve" >&2
    exit 2
    ;;
esac
