#!/usr/bin/env bash
# The open issues' GPU runs on one nvidia-h200-x2 (or h100-x2) lease, both GPUs busy at once. SmolLM2 and Gemma 3
# 270M staged first (`scripts/device_model.sh smollm2 gemma3-270m`: calls 1..N-1), then, in call N after
# `source .carry/N/assemble.sh`:
#   PART=start bash scripts/device_x2_plan.sh     # two chains under setsid, returns at once:
#                                                 #   GPU 1 (timings, alone on its GPU; issue 30): the default server's
#                                                 #   128K mixed load (unpaced, dense then infinitehip), the 1M prompt
#                                                 #   among 64 chats (paced 40 ms): since run 8 the kernels do not
#                                                 #   specialise on step-varying arguments and the warm-up prefills a
#                                                 #   whole sparse chunk (run 8's p99 and 1M max were compilations)
#                                                 #   GPU 0: `gemma3` (the GPU test: ring, graphs, the blocked window
#                                                 #   prefill; issue 33), then `prefill1m8b` (the default's 1M prefill
#                                                 #   and decode profiled, 8B shape, offloaded; issue 31)
# The serving runs and GPU 0's bench share the host's CPUs (say so where quoted). Run 8 (2026-11-28) ran the chains of
# commit 5c550da's version of this file (batch 16, the soak, the Gemma ladder and 12B rows): docs/serving.md. In the
# next calls, back to back (the machine goes back after ~30 s idle; a collect on a fresh machine says so and stops):
#   PART=collect WAIT_S=560 bash scripts/device_x2_plan.sh   # wait for both chains (again until both are done),
#                                                 # copy what they wrote so far to $OUT
#   PART=tp bash scripts/device_x2_plan.sh        # on both GPUs: batch16tp2, tp2bench (no model needed; issue 32)
# Files: $OUT/gpu1.tgz, $OUT/gpu0.tgz (serve-bench archives, JSON, logs), $OUT/tp/.
set -u
out=${OUT:-out}
case ${PART:-start} in
start)
    mkdir -p /tmp/x2/gpu0 /tmp/x2/gpu1 /tmp/soak
    CUDA_VISIBLE_DEVICES=1 setsid nohup bash -c '
        OUT=/tmp/x2/gpu1 PARTS=mixed128k PORT=8012 bash scripts/device_serve_bench.sh
        OUT=/tmp/x2/gpu1 PARTS=long1m EXTRA="--mixed-step-target-ms 40" TAG=-paced40 bash scripts/device_serve_bench.sh
        touch /tmp/x2/gpu1/done' > /tmp/x2/gpu1/driver.log 2>&1 < /dev/null &
    CUDA_VISIBLE_DEVICES=0 setsid nohup bash -c '
        OUT=/tmp/x2/gpu0 bash scripts/device_runs.sh gemma3 prefill1m8b
        touch /tmp/x2/gpu0/done' > /tmp/x2/gpu0/driver.log 2>&1 < /dev/null &
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    echo "started: GPU 1 the 128K and 1M serving runs, GPU 0 gemma3's GPU test then prefill1m8b (/tmp/x2);"
    echo "collect with PART=collect" ;;
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
