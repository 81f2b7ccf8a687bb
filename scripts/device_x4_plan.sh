#!/usr/bin/env bash
# The open issues' GPU runs on one nvidia-h100-x4 (or h200-x4) lease, the four GPUs busy at once (device time counts
# the lease's wall time, not its GPUs). SmolLM2 and Qwen2.5-Coder-0.5B staged first (`scripts/device_model.sh smollm2
# qwen2.5-coder-0.5b`: calls 1..N-1), then, in call N after `source .carry/N/assemble.sh`:
#   PART=start bash scripts/device_x4_plan.sh   # four chains under setsid, returns at once:
#     GPU 3 (timings, alone on its GPU; issue 30): the default server's 128K mixed load (dense then infinitehip), the
#           1M prompt among 64 chats (paced 40 ms): since run 8 the kernels do not specialise on step-varying
#           arguments and the warm-up prefills a whole sparse chunk (run 8's p99 and 1M max were compilations)
#     GPU 2: `gemma3` (the GPU test: ring, graphs, the blocked window prefill; issue 33), then `prefill1m8b` (the
#           default's 1M prefill and decode profiled, 8B shape, fp8 KV offloaded: issue 31, and issue 32's TP=1 row)
#     GPUs 0+1: tests/gpu/test_tensor_parallel.py with Qwen2.5-Coder-0.5B (TP=2 over NCCL vs TP=1), then `tp1m` (the
#           8B shape at 1M, bf16 KV, TP=2 without offload; issue 32)
#     GPUs 2+3, once both chains above them are done: `tp2bench` (128K, TP=1 then TP=2; issue 32's scaling row)
# The chains share the host's CPUs and memory (say so where quoted). In the next calls, back to back (the machine goes
# back after ~30 s idle; a collect on a fresh machine says so and stops):
#   PART=collect WAIT_S=560 bash scripts/device_x4_plan.sh   # wait until every chain is done (or WAIT_S), copy what
#                                                           # they wrote so far to $OUT (one archive per chain)
# Run 8 (2026-11-28, two H200s) ran this file's predecessor, scripts/device_x2_plan.sh at commit 5c550da.
set -u
out=${OUT:-out}
chains="gpu3 gpu2 gpu01 gpu23"
chain() {  # chain NAME CUDA_VISIBLE_DEVICES COMMANDS: the commands under setsid (they outlive the call), then NAME/done;
    # they run in a copy of the tree (/tmp/x4/tree): every later call re-copies the working tree onto the machine, and
    # a command starting meanwhile saw half a tree (2026-11-28: the dense server's standalone runs failed on imports)
    mkdir -p "/tmp/x4/$1"
    CUDA_VISIBLE_DEVICES=$2 setsid nohup bash -c "cd /tmp/x4/tree || exit 1
        $3
        touch /tmp/x4/$1/done" > "/tmp/x4/$1/driver.log" 2>&1 < /dev/null &
}
case ${PART:-start} in
start)
    qwen=/tmp/m/qwen2.5-coder-0.5b.gguf
    mkdir -p /tmp/x4/tree && tar cf - --exclude=./.carry . | tar xf - -C /tmp/x4/tree
    [ -e "$qwen" ] || echo "WARNING: no $qwen (stage it with scripts/device_model.sh): the TP test will fail"
    chain gpu3 3 '
        OUT=/tmp/x4/gpu3 PARTS=mixed128k PORT=8012 bash scripts/device_serve_bench.sh
        OUT=/tmp/x4/gpu3 PARTS=long1m EXTRA="--mixed-step-target-ms 40" TAG=-paced40 bash scripts/device_serve_bench.sh'
    chain gpu2 2 'OUT=/tmp/x4/gpu2 bash scripts/device_runs.sh gemma3 prefill1m8b'
    chain gpu01 0,1 "OUT=/tmp/x4/gpu01 MODEL=$qwen bash scripts/device_runs.sh tp2test tp1m"
    chain gpu23 2,3 '
        while ! { [ -e /tmp/x4/gpu2/done ] && [ -e /tmp/x4/gpu3/done ]; }; do sleep 2; done
        OUT=/tmp/x4/gpu23 bash scripts/device_runs.sh tp2bench'
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    echo "started: $chains (/tmp/x4); collect with PART=collect" ;;
collect)
    # a fresh machine (the held one went back after ~30 s idle) has nothing to wait for: say so at once
    [ -d /tmp/x4 ] || { echo "no /tmp/x4: this machine did not run PART=start (the lease was lost)"; exit 3; }
    for _ in $(seq "${WAIT_S:-560}"); do
        left=0; for c in $chains; do [ -e /tmp/x4/$c/done ] || left=1; done
        [ $left = 0 ] && break
        sleep 1
    done
    mkdir -p "$out"
    for c in $chains; do  # one archive per chain (the device returns at most 8 files)
        [ -e /tmp/x4/$c/done ] || echo "$c: not done yet"
        tar czf "$out/$c.tgz" -C /tmp/x4/$c .
        grep -E "^== |gaps while|decode tok/s|WARNING|passed|failed" /tmp/x4/$c/driver.log | tail -12
    done ;;
*) echo "unknown PART ${PART} (start collect)"; exit 2 ;;
esac
