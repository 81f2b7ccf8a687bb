#!/usr/bin/env bash
# `longreach bench serve` on the GPU (issue 30), SmolLM2 from scripts/device_model.sh's /tmp/m/model.gguf.
# Parts, chosen by $PARTS (default "mixed128k"), each against its own servers (started on 127.0.0.1, waited for on
# /health and given up the moment the process dies, stopped before the next):
#   mixed128k  dense, then the default sparse method: the 128K prompt alone twice (the first compiles what the server's
#              warm-up did not reach; the second is the standalone prefill time), then the mixed load: 40 short chats
#              at 4 req/s with two 128K-token prompts among them
#   long1m     the default sparse method: one 1M-token prompt among 64 streaming chats (a closed loop of 65 places
#              for 150 s; the long prompt goes once, after the first 64 chats): every gap a chat sees while it is
#              prefilled
#   streams64  dense: 64 concurrent streams of 2K-token prompts, 4,096 requests
#   soak       the default sparse method: 64 streams for $SOAK_S seconds (default 600) of 1-3K-token prompts, the
#              server's memory read every 10 s; started under setsid so that it outlives the call, writing to
#              /tmp/soak (then `PARTS=soak_collect` copies what it wrote to $OUT once it is done)
# $METHODS (default "dense $SPARSE") are the servers of mixed128k; $EXTRA is appended to every server's flags and $TAG
# to every file name (a variant run beside the default one). Logs and JSON go to $OUT (or ./out).
set -u
# The device returns at most 8 files from $OUT: everything is written to a work folder and packed into
# $OUT/serve-bench.tgz at the end (a soak's own run writes to /tmp/soak, collected by soak_collect).
final=${OUT:-out}; mkdir -p "$final"
out=$(mktemp -d /tmp/serve-bench.XXXX)
port=${PORT:-8011}
model=${MODEL:-/tmp/m/model.gguf}
sparse=${SPARSE:-infinitehip}
start() {  # start NAME MAX_MODEL_LEN ARGS...: a server; returns 1 if it dies or is not healthy within 300 s
    local name=$1 len=$2; shift 2
    python3 -m longreach serve "$model" --port $port --max-model-len "$len" --max-num-seqs 80 "$@" ${EXTRA:-} \
        > "$out/serve_$name${TAG:-}.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do
        curl -sf 127.0.0.1:$port/health > /dev/null && return 0
        kill -0 $pid 2> /dev/null || { echo "server $name died:"; tail -5 "$out/serve_$name${TAG:-}.log"; return 1; }
        sleep 1
    done
    echo "server $name not healthy after 300 s"; return 1
}
stop() { kill -TERM $pid 2> /dev/null; wait $pid 2> /dev/null; }
bench() {  # bench NAME SECONDS ARGS...
    local name=$1 secs=$2; shift 2
    timeout "$secs" python3 -m longreach bench serve --base-url http://127.0.0.1:$port --out "$out/$name${TAG:-}.json" \
        "$@" > "$out/$name${TAG:-}.log" 2>&1
    echo "== $name${TAG:-} (rc $?)"; tail -24 "$out/$name${TAG:-}.log"
}
alone="--num-prompts 1 --long-prompts 1 --long-input-len 131072 --random-output-len 8"
mixed="--num-prompts 40 --request-rate 4 --random-input-len 512 --random-output-len 128 --long-prompts 2 \
--long-input-len 131072"
for part in ${PARTS:-mixed128k}; do
    case $part in
    mixed128k)
        for m in ${METHODS:-dense $sparse}; do
            if start "$m" 140000 --attention "$m"; then
                bench "alone_cold_$m" 200 $alone
                bench "alone_$m" 200 $alone
                bench "mixed_$m" 200 $mixed
                stop
            fi
        done ;;
    long1m)
        if start long1m_$sparse 1050000 --attention "$sparse"; then
            bench "long1m_$sparse" 420 --num-prompts 128 --max-concurrency 65 --duration 150 --random-input-len 512 \
                --random-output-len 256 --long-prompts 1 --long-input-len 1000000 --sample-metrics 5
            stop
        fi ;;
    streams64)
        if start dense 140000 --attention dense; then
            bench streams64_2k 220 --num-prompts 4096 --max-concurrency 64 --random-input-len 2048 \
                --random-output-len 128
            stop
        fi ;;
    soak)
        rm -rf /tmp/soak; mkdir -p /tmp/soak
        OUT=/tmp/soak PARTS=soak_run setsid nohup bash "$0" > /tmp/soak/driver.log 2>&1 < /dev/null &
        echo "soak started under setsid: /tmp/soak" ;;
    soak_run)
        if start "soak_$sparse" 8192 --attention "$sparse"; then
            bench "soak_$sparse" $(( ${SOAK_S:-600} + 300 )) --num-prompts 512 --max-concurrency 64 \
                --duration "${SOAK_S:-600}" --random-input-len 2048 --random-range-ratio 0.5 --random-output-len 128 \
                --sample-metrics 10
            stop
        fi
        cp "$out"/* /tmp/soak/ 2> /dev/null; touch /tmp/soak/done ;;
    soak_collect)
        [ -d /tmp/soak ] || { echo "no /tmp/soak: this machine did not start the soak (the lease was lost)"; exit 3; }
        for _ in $(seq ${WAIT_S:-560}); do [ -e /tmp/soak/done ] && break; sleep 1; done
        [ -e /tmp/soak/done ] || echo "soak not done yet"
        cp /tmp/soak/*.json /tmp/soak/*.log "$out"/ 2> /dev/null; tail -30 /tmp/soak/driver.log ;;
    *) echo "unknown part $part (mixed128k long1m streams64 soak soak_collect)"; exit 2 ;;
    esac
done
tar czf "$final/serve-bench${TAG:-}.tgz" -C "$out" . && echo "packed $(ls "$out" | wc -l) files into $final/serve-bench${TAG:-}.tgz"
