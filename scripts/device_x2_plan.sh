#!/usr/bin/env bash
# Issues 30 and 33's GPU runs on one nvidia-h200-x2 (or h100-x2) lease, both GPUs busy at once. SmolLM2 and Gemma 3
# 270M staged first (`scripts/device_model.sh smollm2 gemma3-270m`: calls 1..N-1), then, in call N after
# `source .carry/N/assemble.sh`:
#   PART=start bash scripts/device_x2_plan.sh     # two chains under setsid, returns at once:
#                                                 #   GPU 1 (timings, alone on its GPU): the default server's 128K
#                                                 #   mixed load (unpaced), the 1M prompt among 64 chats (paced 40 ms),
#                                                 #   then `gemma12b` (bench decode at 1M, Gemma-3-12B then Llama-3.1-8B
#                                                 #   shape)
#                                                 #   GPU 0: `batch16` (16 x 128K, 8B shape, fp8, offloaded), then
#                                                 #   `mixeddeep2k` (the unpaced 2,048-token chunk, 90% in), then
#                                                 #   three jobs sharing the GPU, none of them timed: the 10-minute soak
#                                                 #   (64 streams; zero lost, memory flat), Gemma 3's retrieval ladder
#                                                 #   (SUITE=gemma, 600 s) and `bsacheck` (split-K's bf16 test)
# The serving runs and the GPU-0 benches share the host's CPUs (say so where quoted). In the next calls, back to back
# (the machine goes back after ~30 s idle; a collect on a fresh machine says so and stops at once):
#   PART=collect WAIT_S=560 bash scripts/device_x2_plan.sh   # wait for both chains (again until both are done),
#                                                 # copy what they wrote so far to $OUT
#   PART=tp bash scripts/device_x2_plan.sh        # on both GPUs: batch16tp2, tp2bench (no model needed; issue 32)
# Files: $OUT/gpu1.tgz, $OUT/gpu0.tgz (serve-bench archives, JSON, logs; the soak's in gpu0's soak/, the ladder's in
# gpu0's ladder/), $OUT/tp/.
set -u
out=${OUT:-out}
case ${PART:-start} in
start)
    mkdir -p /tmp/x2/gpu0 /tmp/x2/gpu1 /tmp/soak
    CUDA_VISIBLE_DEVICES=1 setsid nohup bash -c '
        OUT=/tmp/x2/gpu1 PARTS=mixed128k PORT=8012 bash scripts/device_serve_bench.sh
        OUT=/tmp/x2/gpu1 PARTS=long1m EXTRA="--mixed-step-target-ms 40" TAG=-paced40 bash scripts/device_serve_bench.sh
        OUT=/tmp/x2/gpu1 bash scripts/device_runs.sh gemma12b
        touch /tmp/x2/gpu1/done' > /tmp/x2/gpu1/driver.log 2>&1 < /dev/null &
    CUDA_VISIBLE_DEVICES=0 setsid nohup bash -c '
        OUT=/tmp/x2/gpu0 bash scripts/device_runs.sh batch16 mixeddeep2k
        OUT=/tmp/x2/gpu0/soak PARTS=soak_run PORT=8013 EXTRA="--kv-cache-memory-gb 12" \
            bash scripts/device_serve_bench.sh > /tmp/x2/gpu0/soak.log 2>&1 &
        OUT=/tmp/x2/gpu0/ladder SUITE=gemma MODEL=/tmp/m/gemma3-270m.gguf P=3 KV_GB=4 \
            bash scripts/device_ladder.sh 600 > /tmp/x2/gpu0/ladder.log 2>&1 &
        OUT=/tmp/x2/gpu0 bash scripts/device_runs.sh bsacheck
        wait
        touch /tmp/x2/gpu0/done' > /tmp/x2/gpu0/driver.log 2>&1 < /dev/null &
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    echo "started: GPU 1 serving runs + gemma12b, GPU 0 batch16 + mixeddeep2k, then soak + gemma ladder + bsacheck"
    echo "(/tmp/x2); collect with PART=collect" ;;
collect)
    # a fresh machine (the held one went back after ~30 s idle) has nothing to wait for: say so at once
    [ -d /tmp/x2 ] || { echo "no /tmp/x2: this machine did not run PART=start (the lease was lost)"; exit 3; }
    for _ in $(seq "${WAIT_S:-560}"); do
        [ -e /tmp/x2/gpu0/done ] && [ -e /tmp/x2/gpu1/done ] && break
        sleep 1
    done
    mkdir -p "$out"
    for g in gpu0 gpu1; do  # one archive per GPU (the device returns at most 8 files)
        [ -e /tmp/x2/$g/done ] || echo "$g: not done yet"
        tar czf "$out/$g.tgz" -C /tmp/x2/$g .
        grep -E "^== |gaps while|decode tok/s|WARNING" /tmp/x2/$g/driver.log | tail -20
    done
    # what the shared GPU-0 jobs wrote so far (their own archives come only when each is done)
    if [ -d /tmp/ladder ]; then
        tar czf "$out/ladder-now.tgz" -C /tmp ladder; grep "^== " /tmp/x2/gpu0/ladder.log | tail -8
    fi
    [ -d /tmp/soak ] && tar czf "$out/soak-now.tgz" -C /tmp soak ;;
tp)
    OUT="$out/tp" bash scripts/device_runs.sh batch16tp2 tp2bench ;;
*) echo "unknown PART ${PART} (start collect tp)"; exit 2 ;;
esac
