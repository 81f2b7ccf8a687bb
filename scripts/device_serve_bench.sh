#!/usr/bin/env bash
# `longreach bench serve` on the GPU (issue 12), SmolLM2 from scripts/device_model.sh's /tmp/m/model.gguf:
# 64 concurrent streams of 2K-token prompts (dense; 4,096 requests, ~2.5 minutes on an H100), then the mixed load
# (two 128K-token prompts among short chats) against a dense and an infinitehip server. Each server runs on
# 127.0.0.1, is waited for on /health (and given up the moment its process dies), and is stopped before the next.
# Logs and JSON go to $OUT (or ./out).
set -u
out=${OUT:-out}; mkdir -p "$out"
port=8011
model=${MODEL:-/tmp/m/model.gguf}
start() {  # start NAME ARGS...: a server; returns 1 if it dies or is not healthy within 300 s
    local name=$1; shift
    python3 -m longreach serve "$model" --port $port --max-model-len 140000 --max-num-seqs 64 "$@" \
        > "$out/serve_$name.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do
        curl -sf 127.0.0.1:$port/health > /dev/null && return 0
        kill -0 $pid 2> /dev/null || { echo "server $name died:"; tail -5 "$out/serve_$name.log"; return 1; }
        sleep 1
    done
    echo "server $name not healthy after 300 s"; return 1
}
stop() { kill -TERM $pid 2> /dev/null; wait $pid 2> /dev/null; }
bench() {  # bench NAME SECONDS ARGS...
    local name=$1 secs=$2; shift 2
    timeout "$secs" python3 -m longreach bench serve --base-url http://127.0.0.1:$port --out "$out/$name.json" "$@" \
        > "$out/$name.log" 2>&1
    echo "== $name (rc $?)"; tail -16 "$out/$name.log"
}
mixed="--num-prompts 40 --request-rate 4 --random-input-len 512 --random-output-len 128 --long-prompts 2 \
--long-input-len 131072"
if start dense --attention dense; then
    bench streams64_2k 220 --num-prompts 4096 --max-concurrency 64 --random-input-len 2048 --random-output-len 128
    bench mixed_dense 150 $mixed
    stop
fi
if start infinitehip --attention infinitehip; then
    bench mixed_infinitehip 150 $mixed
    stop
fi
