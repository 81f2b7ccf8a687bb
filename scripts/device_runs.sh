#!/usr/bin/env bash
# The GPU runs the open issues wait for, grouped so that one device call does one group or a few (each fits 10
# minutes on an H100). Logs and JSON go to $OUT (the device tool brings them back). Usage, from the repository root:
#   bash scripts/device_runs.sh kernels     # tests/gpu without a model: kernels vs references (bf16, fp8, tiered);
#                                           # then bench attention (prefill and decode vs cuDNN, 128K-1M)
#   bash scripts/device_runs.sh recheck     # tests/gpu: the fused and psa kernels only
#   bash scripts/device_runs.sh decode1m    # bench decode, Llama-3.1-8B shape, fp8 + offload: 1M, infinitehip
#   bash scripts/device_runs.sh prefill1m8b # the default at 1M (8B shape, fp8 + offload), 2 prefill steps from 85% profiled
#   bash scripts/device_runs.sh decode128k  # the same at 128K: infinitehip and psa with a profile, dense 4K/128K
#   bash scripts/device_runs.sh engine      # needs /tmp/m/model.gguf (scripts/device_model.sh): tests/gpu engine
#   bash scripts/device_runs.sh engine2     # needs the model: tests/gpu's offload, Quest and paged-prefill engine tests
#   bash scripts/device_runs.sh bsacheck    # tests/gpu/test_kernels.py's block-sparse attention (bf16, prefill split-K)
#   bash scripts/device_runs.sh kerneltests # the kernels group's tests alone (no timings: fine beside a ladder)
#   bash scripts/device_runs.sh smollm1m    # needs the model: SmolLM2 at 1M, offloaded (2 GiB pool) vs not
#   bash scripts/device_runs.sh serve       # needs the model: scripts/device_serve_bench.sh
#   bash scripts/device_runs.sh quality     # needs the model: passkey 16K-128K, infinitehip / minference / psa
#   bash scripts/device_runs.sh lowq        # needs the model: passkey 4K/8K, dense / minference / psa / infinitehip
#   bash scripts/device_runs.sh prefill128k # needs the model: SmolLM2 128K prefill, minference / infinitehip vs dense
#   bash scripts/device_runs.sh cascadecheck # needs the model: tests/gpu's cascading tests (engine, passkey, prefill)
#   bash scripts/device_runs.sh fp8quality  # needs the model: the same prompts, infinitehip with fp8 KV
#   bash scripts/device_runs.sh cascading   # needs the model: passkey 128K and 1M, cascading 65K vs streaming
#   bash scripts/device_runs.sh psa1m       # needs the model: SmolLM2 at 1M offloaded, infinitehip vs its prefill +
#                                           # psa decode (true positions, and rank positions), keys read metered
#   bash scripts/device_runs.sh verify7     # needs the model: the gathered prefill's checks, 1M prefill again (JIT notes)
#   bash scripts/device_runs.sh psaeps      # needs the model: psa at 1M offloaded, epsilon 0.5 / 0.8 (rank) vs infinitehip
#   bash scripts/device_runs.sh psarank     # needs the model: tests/gpu psa rank rope (kernels, bf16); passkey
#                                           # 16K-128K, infinitehip vs infinitehip prefill + psa decode at rank
#                                           # positions, keys read per decode query metered
#   bash scripts/device_runs.sh psarecall   # needs the model: eval recall at 32K and 128K, psa 0.9-0.98 vs infinitehip
#                                           # 3k and quest 3k: keys read per query beside mass recall (issue 15)
#   bash scripts/device_runs.sh prefill1m   # needs the model: cascading insertion kernels checked, then SmolLM2 1M
#                                           # prefill on the GPU, infinitehip vs cascading
#   bash scripts/device_runs.sh psa1mdiag   # needs the model: psa's 1M decode on the GPU alone, then offloaded
#   bash scripts/device_runs.sh cascadedecode # needs the model: cascading's eager decode step, then a 128K prefill
#                                           # (infinitehip vs cascading), under the profiler
#   bash scripts/device_runs.sh refresh8b   # 8B shape: bench decode at 128K (bf16, dense beside), the default (8, 4, 1)
#                                           # vs the paper's (16, 8, 4) vs (16, 8, 1) (issue 28's schedules)
#   bash scripts/device_runs.sh refresh512k # the same at 512K (bf16; dense's 512K prefill needs a call of its own)
#   bash scripts/device_runs.sh refresh1m   # the same three at 1M (fp8 + offload), one method per run (~10 min each)
#   bash scripts/device_runs.sh box1m       # bench decode, 8B shape, fp8 + offload: 1M, infinitehip (3k-box)
#   bash scripts/device_runs.sh psa128k     # 8B shape, bf16: the psa step's parts in CUDA graphs (128K, 1M); bench
#                                           # decode 128K, infinitehip vs psa (loop and waves kernels) vs dense
#   bash scripts/device_runs.sh seeds8b     # 8B shape: cascading 16k at 1M (bf16, bounded: no offload); psa with
#                                           # fp8 + offload vs infinitehip vs dense at 128K
#   bash scripts/device_runs.sh batch16     # bench decode, 8B shape, fp8 + offload: 16 requests at 128K decoding
#                                           # together (issue 30); its 128 GiB host tier needs nvidia-h100-x2 or
#                                           # h200-x2 (256 GiB of host memory), on one of their GPUs
#   bash scripts/device_runs.sh batch16tp2  # the same on two GPUs (TP=2) without offload (issues 30 and 32)
#   bash scripts/device_runs.sh fp8w        # needs the model: tests/gpu/test_fp8.py; then bench decode on the 8B shape at
#                                           # 128K, bf16 weights vs --quantization fp8, dense beside (issue 31)
#   bash scripts/device_runs.sh crossover   # the 8B shape's decode crossover file (calibrate crossover), then fp8 weights
#                                           # vs bf16 at 4K dense, end to end (issue 31)
#   bash scripts/device_runs.sh paced       # needs the model: bench mixed at 128K beside 32 decodes, 256-token chunks
#                                           # (what --mixed-step-target-ms chose for infinitehip), profiled (issue 30)
#   bash scripts/device_runs.sh mixeddeep   # needs the model: bench mixed as in `paced`, 4 steps profiled (device and
#                                           # host) at 90% of the prompt, where infinitehip's chunks select (issue 30)
#   bash scripts/device_runs.sh mixeddeep2k # needs the model: the same with 2,048-token chunks (the unpaced server's)
#   bash scripts/device_runs.sh chunkgraphs # needs the model: tests/gpu's chunk-graph and box tests; then `paced` again
#                                           # (prefill chunks through piecewise CUDA graphs now) (issue 30)
#   bash scripts/device_runs.sh pagedprefill # needs the model: tests/gpu's paged-prefill test; then bench mixed at
#                                           # 128K beside 32 decodes, dense, --dense-prefill paged vs sdpa, profiled
#   OLD=.carry/old OLD_COMMIT=C bash scripts/device_runs.sh abmixed  # needs the model: bench mixed (128K beside 32 decodes,
#                                           # 256-token chunks, dense and infinitehip) in an earlier tree and in this
#                                           # one, in one call: the earlier code is the same-call baseline. Make the
#                                           # earlier tree here with `mkdir -p .carry/old && git archive C longreach |
#                                           # tar -x -C .carry/old` and carry .carry/old (1.5 MB)
#   OLD=.carry/old OLD_COMMIT=C bash scripts/device_runs.sh abdeep  # abmixed's infinitehip, 4 steps profiled at 90%
#   OLD=.carry/old OLD_COMMIT=C bash scripts/device_runs.sh ab8b  # 8B shape, bf16: bench decode at 128K, infinitehip pruned vs
#                                           # dense, in the earlier tree and in this one (issue 31's small kernels)
#   bash scripts/device_runs.sh calib32k    # needs the model: MInference's Qwen patterns calibrated at 32K, then the
#                                           # essays passkey at 16K/32K with them, the shipped ones and dense (issue 28)
#   bash scripts/device_runs.sh variants    # needs the model: tests/gpu/test_eval_variants.py (decode variants from one
#                                           # prefill == an engine of each, bf16, graphs; issue 28's --share-prefill)
#   bash scripts/device_runs.sh gemma3      # no model: tests/gpu/test_gemma3.py (a random Gemma 3 on CUDA: the ring,
#                                           # the banded prefill, graphs, infinitehip on the global layer; issue 33)
#   bash scripts/device_runs.sh gemma12b    # no model: bench decode at 1M, Gemma-3-12B shape then Llama-3.1-8B shape
#                                           # (fp8 KV offloaded, the default; issue 33's KV memory and decode rows)
#   bash scripts/device_runs.sh strideab    # no model: 8B shape at 256K, the default vs query_stride 2, block_q 128
#                                           # and both, in one process (issue 31; kernel-notes v25)
#   bash scripts/device_runs.sh tp2         # needs nvidia-h100-x2 / h200-x2 and the model: tests/gpu/test_tensor_parallel.py
#                                           # (TP=2 over NCCL vs TP=1); then bench decode, 8B shape, bf16, 128K,
#                                           # infinitehip pruned vs dense, TP=1 then TP=2 (issue 32's scaling row)
#   bash scripts/device_runs.sh tp2test     # two GPUs and the model: tests/gpu/test_tensor_parallel.py alone
#   bash scripts/device_runs.sh tp2bench    # no model: tp2's bench alone (8B shape, 128K, TP=1 then TP=2)
#   bash scripts/device_runs.sh tp1m        # no model, two GPUs: the 8B shape at 1M, bf16 KV, TP=2 without offload
#   bash scripts/device_runs.sh default8b   # 8B shape, bf16: bench decode at 128K, the default vs dense, the last 4
#                                           # steps profiled (issue 31's 2x-dense-at-128K goal)
#   bash scripts/device_runs.sh profile8b   # 8B shape, bf16: bench decode at 128K, infinitehip pruned vs dense, the
#                                           # last 4 steps profiled (where the sparse step's fixed cost goes; issue 31)
#   bash scripts/device_runs.sh tp3m        # no model, two H200s: the 8B shape at 3M, fp8 KV, TP=2, no offload (20+
#                                           # min: start it detached, see the group)
#   bash scripts/device_runs.sh scoresweep  # no model, one GPU: the scoring kernels' layouts timed at the 1M prefill's
#                                           # shape (scripts/score_kernels_sweep.py), then their GPU tests
#   bash scripts/device_runs.sh units128k   # no model, one GPU: tests/gpu's offload kernel check (slots of a page and
#                                           # of a KV head's page), then bench decode at 128K, 8B shape, fp8 offloaded
#                                           # to a 1 GiB pool, --kv-offload-unit page then head (issue 31's installs)
#   bash scripts/device_runs.sh units128kx2 # the same on two GPUs of one host at once (page on 0, head on 1)
#   bash scripts/device_runs.sh units1m     # no model, two GPUs (nvidia-h200-x2: 256 GiB host): the default at 1M
#                                           # (fp8, 76 GiB host tier, 4 GiB pool), unit page on GPU 0 and head on GPU 1
#                                           # at once, 4 decode steps profiled each
#   bash scripts/device_runs.sh table8b     # no model: issue 31's table on the 8B shape, one run: the default vs dense
#                                           # at 32K, 128K and 512K (bf16 KV on the GPU), 4 decode steps profiled each
#   bash scripts/device_runs.sh table8btests # no model: scoresweep's GPU checks alone (scoring, box, offload kernels)
#   bash scripts/device_runs.sh qwen05table # needs Qwen 0.5B: issue 31's table on it (the same command as table8b's)
#   bash scripts/device_runs.sh qwen05fp8   # needs Qwen 0.5B: fp8 weights against bf16 (eval ppl and passkey, dense)
#   bash scripts/device_runs.sh graphcheck  # needs a model: the top-k kernel and 3k-box's graph == eager decode at
#                                           # 1.5x the model's trained length (tests/gpu)
#   bash scripts/device_runs.sh graphbox    # needs a model: graphcheck's 3k-box graph == eager decode alone
#   bash scripts/device_runs.sh qwen051m    # needs Qwen 0.5B: the default at 1M, fp8 KV offloaded to a 0.4 GiB pool:
#                                           # each decode step's installs (stage-1 candidates kept between refreshes)
#   bash scripts/device_runs.sh qwen05prefill # needs Qwen 0.5B: its 128K prefill's three sparse 32K steps and dense's,
#                                           # profiled; then the scoring kernels' layouts timed at its shape
#   bash scripts/device_runs.sh row1m       # no model: issue 31's 1M row (8B shape, fp8 + offload), 4 steps profiled
#   bash scripts/device_runs.sh earlyinstall # no model: the offload kernels' and install-inside-the-step GPU checks, then row1m
#   bash scripts/device_runs.sh row2m       # no model, nvidia-h200-x2 (256 GiB host): the same at 2M (detached: see it)
#   bash scripts/device_runs.sh step16      # no model: row1m's command to step 16, steps 14-16 profiled
#   bash scripts/device_runs.sh stagingoverlap # no model: the offload GPU checks (double-buffered staging), then row1m
#   bash scripts/device_runs.sh stagingab   # no model: the 8B shape's 512K prefill offloaded, 1 then 2 staging buffers
#   bash scripts/device_runs.sh row1m1641   # no model: row1m with refresh (16, 4, 1), 50 steps
#   bash scripts/device_runs.sh ahead256k   # no model: the installs-ahead GPU check, then the 8B shape at 256K
#                                           # offloaded: (8, 4, 1), (16, 4, 1), (16, 4, 1) with ahead
#   bash scripts/device_runs.sh ahead512k   # no model: the same check, then 512K offloaded: (16, 4, 1) without and
#                                           # with ahead, one process
#   bash scripts/device_runs.sh row1mahead  # no model: row1m with (16, 4, 1) and ahead
#   bash scripts/device_runs.sh prefill512k # no model: 512K offloaded, the default against stage 1 by SelectRep
#                                           # ({"exact_below": 8}) in one process: what the exact stage 1 costs the prefill
#   bash scripts/device_runs.sh runsab      # no model: the scoring kernels' GPU check (runs of 8 keys too), then the
#                                           # 8B shape at 256K with stage 2 from stage 1's runs off and on (scripts/runs_ab.py)
#   bash scripts/device_runs.sh aheadcheck  # no model: tests/gpu's installs ahead and inside the step (fits beside a ladder)
#   bash scripts/device_runs.sh qwen05refresh # needs Qwen 0.5B: the scoring kernels' GPU check (its shape too), then
#                                           # its 128K decode with 8 steps profiled (a stage-0 and a stage-1 refresh),
#                                           # their timeline in $OUT/traces
# A group's first command compiles kernels (~30-60 s); bench decode runs an untimed warm-up prompt first.
set -u
out=${OUT:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
model=${MODEL:-/tmp/m/model.gguf}
run() {  # run NAME SECONDS CMD...: the command's output in $out/NAME.log, its tail on stdout. Past SECONDS the
    # command gets SIGUSR1 (longreach prints its Python stacks: where it was) and SIGKILL 10 s later (exit 137)
    local name=$1 secs=$2; shift 2
    echo "== $name: $*"
    timeout -s USR1 -k 10 "$secs" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $?"
    tail -14 "$out/$name.log"
}
gpu_tests() {  # gpu_tests NAME SECONDS PYTEST-ARGS...: GPU tests (tests/gpu), their JSON report in $out/NAME.json
    local name=$1 secs=$2; shift 2
    run "$name" "$secs" python3 -m pytest -s -q --gpu-report "$out/$name.json" "$@"
}
bd="python3 -m longreach bench decode --kv-cache-dtype fp8 --kv-cache-memory-gb 4 --max-num-batched-tokens 65536"
scoring_checks() {  # the stage scoring kernels' GPU checks (bf16, real sizes), the box and offload kernels' (fp8 too)
    gpu_tests "$1" 280 tests/gpu/test_kernels.py tests/gpu/test_box.py tests/gpu/test_offload.py \
        -k "chunk_scores or box_kernels or offload_kernels"
}
# issue 31's table: the same bench decode command for every model shape (table8b, qwen05table)
table=(--lengths 32k 128k 512k --attention infinitehip --dense-lengths 32k 128k 512k --decode-tokens 64
       --max-num-batched-tokens 32768 --profile-steps 4)
# issue 31's 1M row (groups row1m and earlyinstall; step16 stops it early)
at1m=($bd --kv-offloading-size 76 --lengths 1M --attention infinitehip --dense-lengths)
row1m=("${at1m[@]}" --decode-tokens 42 --profile-steps 4 --out "$out/bench-decode-1m-8b.json")
for group in "$@"; do
case "$group" in
batch16)  # the host tier holds all 16 x 131,136 tokens (fp8 pages with their scales: ~145 GiB; 132 GiB preempted one)
    run batch16 800 $bd --kv-cache-memory-gb 40 --kv-offloading-size 150 --batch 16 --lengths 128k \
        --attention infinitehip --dense-lengths 4k --decode-tokens 64 --profile-steps 4 \
        --out "$out/bench-decode-16x128k.json" ;;
batch16tp2)  # the same 16 x 128K on two GPUs without offload (76 GiB of fp8 KV per rank; 72 preempted one)
    run batch16_tp2 600 $bd --kv-cache-memory-gb 76 --tensor-parallel-size 2 --batch 16 --lengths 128k \
        --attention infinitehip --dense-lengths 4k --decode-tokens 64 --out "$out/bench-decode-16x128k-tp2.json" ;;
fp8w)
    gpu_tests gpu_check_fp8 200 tests/gpu/test_fp8.py --gpu-model "$model"
    for q in bf16 fp8; do
        run "decode_128k_$q" 300 python3 -m longreach bench decode --lengths 128k --attention infinitehip \
            --dense-lengths 4k 128k --decode-tokens 64 $([ $q = fp8 ] && echo --quantization fp8) \
            --out "$out/bench-decode-128k-weights-$q.json"
    done ;;
crossover)  # issue 31: the 8B shape's decode crossover (dense vs infinitehip, 4K-128K), then bench decode with
    # --quantization fp8 against bf16 (the fp8 GEMV end to end); files in $OUT
    run crossover_8b 420 python3 -m longreach calibrate crossover --model random:llama-3.1-8b --attention infinitehip \
        --lengths 16k 32k 64k 128k --out-dir "$out/crossover"
    for q in bf16 fp8; do
        run "decode_4k_$q" 150 python3 -m longreach bench decode --lengths 4k --attention infinitehip --dense-lengths 4k \
            --decode-tokens 64 $([ $q = fp8 ] && echo --quantization fp8) --out "$out/bench-decode-4k-weights-$q.json"
    done ;;
chunkgraphs)
    gpu_tests gpu_chunk_graphs 400 tests/gpu/test_engine.py tests/gpu/test_box.py --gpu-model "$model" \
        -k "chunk or box or graph"
    for g in 2048 0; do  # chunk graphs on (the default cap), then off: the same command in one call
        run "mixed_paced_graphs$g" 420 python3 -m longreach bench mixed --model "$model" --context 131072 \
            --decodes 32 --attention dense infinitehip --long-prefill-token-threshold 256 --profile-steps 4 \
            --chunk-graph-max-tokens "$g" --out "$out/bench-mixed-128k-chunk256-graphs$g.json"
    done ;;
pagedprefill)
    gpu_tests gpu_paged_prefill 300 tests/gpu/test_engine.py --gpu-model "$model" -k paged
    for m in paged sdpa; do  # the prefix read in place, then gathered for SDPA: the same command in one call
        run "mixed_paced_$m" 420 python3 -m longreach bench mixed --model "$model" --context 131072 --decodes 32 \
            --attention dense --long-prefill-token-threshold 256 --profile-steps 4 --dense-prefill "$m" \
            --out "$out/bench-mixed-128k-chunk256-prefill-$m.json"
    done ;;
abmixed|abdeep|ab8b)  # the same command in the tree at $OLD, then in this one (abdeep: abmixed's infinitehip
    # alone, 4 steps profiled at 90% of the prompt: its deep chunks)
    : "${OLD:?OLD=the earlier tree (see the usage above)}"
    for tree in old new; do  # python -m imports from the working directory first: each tree runs from its own
        dir=$PWD commit=${LONGREACH_COMMIT:-}
        [ "$tree" = old ] && dir=$(cd "$OLD" && pwd) commit=${OLD_COMMIT:?OLD_COMMIT: the commit of the earlier tree}
        path="$dir:$(printf %s "${PYTHONPATH:-}" | tr ':' '\n' | grep -vx "$PWD" | paste -sd: -)"
        e=(env -C "$dir" PYTHONPATH="$path" LONGREACH_COMMIT="$commit")
        if [ "$group" != ab8b ]; then
            methods=(dense infinitehip) deep=() tag=
            [ "$group" = abdeep ] && methods=(infinitehip) deep=(--profile-steps 4 --profile-at 0.9) tag=-deep
            run "mixed_paced${tag}_$tree" 280 "${e[@]}" python3 -m longreach bench mixed --model "$model" \
                --context 131072 --decodes 32 --attention "${methods[@]}" --long-prefill-token-threshold 256 \
                ${deep[@]+"${deep[@]}"} --out "$out/bench-mixed-128k-chunk256$tag-$tree.json"
        else
            run "decode_8b_128k_$tree" 280 "${e[@]}" python3 -m longreach bench decode --lengths 128k \
                --attention infinitehip@pruned --attention-config '{"infinitehip@pruned": {"dense_below": null}}' \
                --dense-lengths 128k --decode-tokens 64 --out "$out/bench-decode-128k-8b-$tree.json"
        fi
    done ;;
gemma3)
    gpu_tests gpu_check_gemma3 240 tests/gpu/test_gemma3.py ;;
gemma12b)  # issue 33: the Gemma-3-12B shape's KV per token and 1M decode beside the Llama-3.1-8B shape's (random
    # weights, fp8 KV offloaded to an 80 GiB host tier, 4 GiB GPU pool, the default method): Gemma's 40 sliding layers
    # prefill under a banded mask over 8K-token chunks (a 64K chunk's mask would cost ~8x the FLOPs); the Llama runs
    # decode1m's command (65,536-token chunks)
    run gemma12b_1m 420 python3 -m longreach bench decode --model random:gemma-3-12b --kv-cache-dtype fp8 \
        --kv-cache-memory-gb 4 --kv-offloading-size 80 --max-num-batched-tokens 8192 --lengths 1M \
        --attention infinitehip --dense-lengths 4k --decode-tokens 64 --out "$out/bench-decode-1m-gemma3-12b.json"
    run llama8b_1m 500 $bd --kv-offloading-size 80 --lengths 1M --attention infinitehip --dense-lengths 4k \
        --decode-tokens 64 --out "$out/bench-decode-1m-llama8b-beside-gemma.json" ;;
tp2)
    bash "$0" tp2test tp2bench ;;
tp2test)  # needs two GPUs and the model (Qwen2.5-Coder-0.5B: 2 KV heads, one per rank): TP=2 over NCCL vs TP=1
    gpu_tests gpu_check_tp2 600 tests/gpu/test_tensor_parallel.py --gpu-model "$model" ;;
tp2bench)  # no model needed: tp2's scaling row alone
    for n in 1 2; do  # the same command, one GPU then two (rank r on cuda:r)
        run "decode_8b_128k_tp$n" 280 python3 -m longreach bench decode --lengths 128k \
            --attention infinitehip@pruned --attention-config '{"infinitehip@pruned": {"dense_below": null}}' \
            --dense-lengths 128k --decode-tokens 64 --tensor-parallel-size "$n" \
            --out "$out/bench-decode-128k-8b-tp$n.json"
    done ;;
tp1m)  # issue 32's 1M row: the 8B shape (random weights), bf16 KV, TP=2 without offload (64 GiB of KV per rank: 66 fits an
    # H100 beside its 7.5 GiB of weights), the default method, 4 decode steps profiled; TP=1 with offload in the same
    # session is prefill1m8b (fp8 KV, one GPU)
    run tp2_1m 580 python3 -m longreach bench decode --lengths 1M --attention infinitehip --dense-lengths 4k \
        --kv-cache-memory-gb 66 --max-num-batched-tokens 32768 --tensor-parallel-size 2 --decode-tokens 64 \
        --profile-steps 4 --out "$out/bench-decode-1m-8b-tp2-bf16.json" ;;
tp3m)  # issue 32's 3M row: the 8B shape, fp8 KV, TP=2 without offload (~103 GiB of KV per rank beside ~8 GiB of
    # weights on an H200). Estimated 20+ min of prefill (an extrapolation from tp1m's 148 s: the selection grows with
    # prefix x chunk), past one call's 10 minutes: start it detached from a copy of the tree, e.g.
    #   cp -r . /tmp/t3 && cd /tmp/t3 && OUT=/tmp/t3/out setsid nohup bash scripts/device_runs.sh tp3m > /tmp/t3.log 2>&1 &
    # and collect /tmp/t3/out in later calls of the same lease (docs/design-tensor-parallel.md)
    run tp2_3m 1750 python3 -m longreach bench decode --lengths 3M --attention infinitehip --dense-lengths 4k \
        --kv-cache-dtype fp8 --kv-cache-memory-gb 106 --max-num-batched-tokens 65536 --tensor-parallel-size 2 \
        --decode-tokens 32 --profile-steps 4 --out "$out/bench-decode-3m-8b-tp2-fp8.json" ;;
tp2short)  # no model needed: tp2's bench at 32K (8B shape, random weights), whether NCCL captures in CUDA graphs
    for n in 1 2; do
        run "decode_8b_32k_tp$n" 120 python3 -m longreach bench decode --lengths 32k \
            --attention infinitehip@pruned --attention-config '{"infinitehip@pruned": {"dense_below": null}}' \
            --dense-lengths 32k --decode-tokens 64 --tensor-parallel-size "$n" \
            --out "$out/bench-decode-32k-8b-tp$n.json"
    done ;;
default8b)  # issue 31: the default at 128K on the 8B shape (bf16, no offload), dense in the same run, 4 steps profiled
    run default_8b_128k 400 python3 -m longreach bench decode --lengths 128k --attention infinitehip \
        --dense-lengths 128k --decode-tokens 64 --profile-steps 4 --out "$out/bench-decode-128k-default-8b.json" ;;
table8b)  # issue 31: one table per model shape, the same command for each (Qwen: qwen05table)
    run table_8b 580 python3 -m longreach bench decode "${table[@]}" --out "$out/bench-decode-table-8b.json" ;;
table8btests)
    scoring_checks gpu_check_scores_offload ;;
qwen05table)
    run table_qwen05 330 python3 -m longreach bench decode --model "$model" --text-source paul-graham "${table[@]}" \
        --out "$out/bench-decode-table-qwen05.json" ;;
qwen05prefill)  # issue 31: where Qwen's 128K prefill goes (0.65x dense in qwen05table)
    run prefill_qwen05_128k 300 python3 -m longreach bench decode --model "$model" --text-source paul-graham \
        --lengths 128k --attention infinitehip --dense-lengths 128k --decode-tokens 8 --max-num-batched-tokens 32768 \
        --profile-prefill-steps 3 --profile-prefill-at 0.2 --out "$out/bench-decode-128k-prefill-profile-qwen05.json"
    run score_sweep_qwen05 240 python3 scripts/score_kernels_sweep.py "$out/score-kernels-sweep-qwen05-128k.json" \
        --shape qwen05-128k ;;
qwen05refresh)  # issue 31: Qwen's 128K decode (0.96x dense) loses in its refresh steps: profile 8 steps (16-23)
    gpu_tests gpu_check_chunk_scores 200 tests/gpu/test_kernels.py -k chunk_scores
    run refresh_qwen05_128k 240 python3 -m longreach bench decode --model "$model" --text-source paul-graham \
        --lengths 128k --attention infinitehip --dense-lengths --decode-tokens 25 --max-num-batched-tokens 32768 \
        --profile-steps 8 --profile-trace "$out/traces" --out "$out/bench-decode-128k-refresh-profile-qwen05.json" ;;
graphbox)  # graphcheck's graph == eager decode alone
    gpu_tests gpu_check_graph_box 150 tests/gpu/test_box.py --gpu-model "$model" -k box_engine ;;
graphcheck)
    gpu_tests gpu_check_graphs 200 tests/gpu/test_kernels.py tests/gpu/test_box.py --gpu-model "$model" \
        -k "topk or box_engine" ;;
qwen05fp8)
    for q in bf16 fp8; do  # fp8 weights' quality against bf16: one process each (the engine takes one weight format)
        flag=(); [ $q = fp8 ] && flag=(--quantization fp8)
        # its whole-window logits at 32K need ~19 GiB beside the KV cache
        run "ppl_qwen05_$q" 90 python3 -m longreach eval ppl --model "$model" --text-source paul-graham \
            --lengths 4k 32k --samples 4 --attention dense --max-num-batched-tokens 32768 --kv-cache-memory-gb 8 \
            ${flag[@]+"${flag[@]}"} --out "$out/ppl-qwen05-weights-$q.json"
        run "passkey_qwen05_$q" 100 python3 -m longreach eval passkey --model "$model" --haystack paul-graham \
            --lengths 8k 32k --depths 0.1 0.3 0.5 0.7 0.9 --seeds 4 --needles classic secret code --attention dense \
            --max-num-batched-tokens 32768 ${flag[@]+"${flag[@]}"} --out "$out/passkey-qwen05-weights-$q.json"
    done ;;
qwen051m)  # stage 1's candidates of a real model between stage-0 refreshes (docs/design-refresh-installs.md, option 1)
    run qwen05_1m 560 python3 -m longreach bench decode --model "$model" --text-source paul-graham --lengths 1M \
        --attention infinitehip --kv-cache-dtype fp8 --kv-cache-memory-gb 0.4 --kv-offloading-size 12 \
        --max-num-batched-tokens 65536 --dense-lengths --decode-tokens 41 --out "$out/bench-decode-1m-qwen05.json" ;;
profile8b)
    run profile_8b_128k 400 python3 -m longreach bench decode --lengths 128k --attention infinitehip@pruned \
        --attention-config '{"infinitehip@pruned": {"dense_below": null}}' --dense-lengths 128k --decode-tokens 64 \
        --profile-steps 4 --out "$out/bench-decode-128k-profile-8b.json" ;;
mixeddeep)  # issue 30: where a 256-token chunk's step goes at 90% of a 128K prompt (infinitehip selects there)
    run mixed_deep 420 python3 -m longreach bench mixed --model "$model" --context 131072 --decodes 32 \
        --attention dense infinitehip --long-prefill-token-threshold 256 --profile-steps 4 --profile-at 0.9 \
        --cprofile --out "$out/bench-mixed-128k-chunk256-deep-profile.json" ;;
mixeddeep2k)  # issue 30: the unpaced default's 2,048-token chunks at 90% of a 128K prompt beside 32 decodes (its 1.41x)
    run mixed_deep_2k 420 python3 -m longreach bench mixed --model "$model" --context 131072 --decodes 32 \
        --attention dense infinitehip --long-prefill-token-threshold 2048 --profile-steps 4 --profile-at 0.9 \
        --out "$out/bench-mixed-128k-chunk2048-deep-profile.json" ;;
paced)
    run mixed_paced 420 python3 -m longreach bench mixed --model "$model" --context 131072 --decodes 32 \
        --attention dense infinitehip --long-prefill-token-threshold 256 --profile-steps 4 \
        --out "$out/bench-mixed-128k-chunk256.json" ;;
kernels)
    gpu_tests gpu_check_kernels 330 tests/gpu -k "not box and not gemma3"  # no model: the engine tests skip
    # minference (each pure pattern) and infinitehip prefill vs cuDNN, one 8B-shaped layer
    run bench_attention 230 python3 -m longreach bench attention --contexts 128K 512K 1M --no-flex --repeats 3 \
        --out "$out/bench-attention.json"
    ;;
recheck)  # the kernel checks that failed or were fixed since their last GPU run
    gpu_tests gpu_check_recheck 180 tests/gpu -k "fused or psa"
    ;;
decode1m)
    run decode_1m 570 $bd --kv-offloading-size 76 --lengths 1M --attention infinitehip:3k-flash --dense-lengths \
        --out "$out/bench-decode-1m.json"
    ;;
prefill1m8b)  # issue 31: where the default's 1M prefill goes (8B shape, fp8 + offload; 2 steps from 85% profiled:
    # selection vs attention vs the staging gathers vs matmuls), then its decode (4 steps profiled: run 8's 20.5 tok/s)
    run prefill_1m_8b 580 $bd --kv-offloading-size 76 --lengths 1M --attention infinitehip --dense-lengths \
        --decode-tokens 48 --profile-prefill-steps 2 --profile-prefill-at 0.85 --profile-steps 4 \
        --out "$out/bench-decode-1m-prefill-profile-8b.json" ;;
scoresweep)  # issue 31's prefill: the stage scoring kernels' two layouts at the 1M profile's shape
    # (scripts/score_kernels_sweep.py), then their GPU checks (bf16, real sizes) and the offload kernels' (fp8 too)
    run score_sweep 300 python3 scripts/score_kernels_sweep.py "$out/score-kernels-sweep.json"
    scoring_checks gpu_check_scoring ;;
refresh1m)  # issue 31: the default's 1M decode with a stage-0 refresh step among the 4 profiled (steps 37-40;
    # the schedule (8, 4, 1) refreshes stage 0 at every 8th step): what the ~100 ms refresh steps spend
    run refresh_1m_8b 420 $bd --kv-offloading-size 76 --lengths 1M --attention infinitehip --dense-lengths \
        --decode-tokens 42 --profile-steps 4 --out "$out/bench-decode-1m-refresh-profile-8b.json" ;;
row1m)  # issue 31's 1M row on today's default (8B shape, random weights, fp8 KV offloaded to a 76 GiB host tier, a
    # 4 GiB GPU pool), the last 4 of 42 decode steps profiled (indices 38-41: stage 0 refreshes at 8, 16, ..., 40); no
    # dense row (dense's 1M prefill on the GPU alone would take ~15 min: an estimate from its FLOPs)
    run decode_1m_8b 560 "${row1m[@]}" ;;
ahead256k)  # no model: tests/gpu's installs ahead (random:tiny offloaded == GPU-resident through graphs; the looping
    # copy kernel), then the 8B shape at 256K (fp8 KV offloaded, 4 GiB pool: stage 1's candidates are as many bytes
    # as at 1M) in one bench: the default (8, 4, 1), (16, 4, 1), and (16, 4, 1) with `ahead`
    gpu_tests gpu_check_ahead 120 tests/gpu/test_offload.py -k ahead
    cfg='{"infinitehip@r1641": {"refresh": [16, 4, 1]}, "infinitehip@ahead16": {"refresh": [16, 4, 1], "ahead": true}}'
    run decode_256k_ahead 260 $bd --kv-offloading-size 20 --lengths 256k --attention infinitehip infinitehip@r1641 \
        infinitehip@ahead16 --attention-config "$cfg" --dense-lengths --decode-tokens 66 \
        --out "$out/bench-decode-256k-8b-ahead.json" ;;
ahead512k)  # no model: tests/gpu's installs ahead (random:tiny, pool 1/2), then the 8B shape at 512K offloaded, (16, 4, 1)
    # without and with `ahead` in one process (the bench times the engine's stream, not the background copies)
    gpu_tests gpu_check_ahead 150 tests/gpu/test_offload.py -k ahead
    cfg='{"infinitehip@r1641": {"refresh": [16, 4, 1]}, "infinitehip@ahead16": {"refresh": [16, 4, 1], "ahead": true}}'
    run decode_512k_ahead 420 $bd --kv-offloading-size 40 --lengths 512k --attention infinitehip@r1641 \
        infinitehip@ahead16 --attention-config "$cfg" --dense-lengths --decode-tokens 66 --profile-steps 4 \
        --out "$out/bench-decode-512k-8b-ahead.json" ;;
prefill512k)  # no model: the 8B shape at 512K offloaded, the default and {"exact_below": 8} (stage 1 scored by SelectRep,
    # not exactly: ~1/6 of its reads) in one process, 8 decode steps: the prefill's exact-stage share, end to end
    run prefill_512k_eb8 560 $bd --kv-offloading-size 40 --lengths 512k --attention infinitehip infinitehip@eb8 \
        --attention-config '{"infinitehip@eb8": {"exact_below": 8}}' --dense-lengths --decode-tokens 8 \
        --out "$out/bench-decode-512k-8b-eb8.json" ;;
strideab)  # no model: the 8B shape at 256K, fp8 KV on the GPU (fits an H100), in one process: the default,
    # {"query_stride": [2, 2, 2]} (every stage scores a prefill block from every 2nd row), {"block_q": 128} (blocks of
    # 128 rows: each key tile gathered and rotated once per 128 rows instead of 64) and both (kernel-notes v25)
    run prefill_256k_qs2 560 python3 -m longreach bench decode --kv-cache-dtype fp8 --kv-cache-memory-gb 24 \
        --max-num-batched-tokens 65536 --lengths 256k \
        --attention infinitehip infinitehip@qs2 infinitehip@bq128 infinitehip@bq128qs2 \
        --attention-config '{"infinitehip@qs2": {"query_stride": [2, 2, 2]}, "infinitehip@bq128": {"block_q": 128},
            "infinitehip@bq128qs2": {"block_q": 128, "query_stride": [2, 2, 2]}}' \
        --dense-lengths --decode-tokens 8 --out "$out/bench-decode-256k-8b-strides.json" ;;
runsab)  # no model: tests/gpu's chunk scores (bf16, real sizes; exact 32-key chunks per run of 8 keys too), then the
    # 8B shape at 256K (GPU-resident fp8 KV) prefilled with infinitehip's stage 2 read from its keys (off) and from
    # stage 1's runs (on), one process each, the same command
    gpu_tests gpu_check_chunk_scores 200 tests/gpu/test_kernels.py -k chunk_scores
    for ab in off on; do
        run "runs_ab_$ab" 200 python3 scripts/runs_ab.py $ab bench decode --kv-cache-dtype fp8 --kv-cache-memory-gb 40 \
            --max-num-batched-tokens 65536 --lengths 256k --attention infinitehip --dense-lengths --decode-tokens 8 \
            --out "$out/bench-decode-256k-8b-runs-$ab.json"
    done ;;
aheadcheck)  # no model: tests/gpu's installs ahead (random:tiny, pool 1/2); a correctness check, so it may share the
    # GPU with a background ladder run
    gpu_tests gpu_check_ahead 240 tests/gpu/test_offload.py -k "ahead or inside_the_step" ;;
row1mahead)  # no model: row1m with (16, 4, 1) and `ahead`, 66 steps (four stage-0 refreshes, three of them ahead)
    run decode_1m_8b_ahead 560 "${at1m[@]}" --decode-tokens 66 --profile-steps 4 \
        --attention-config '{"refresh": [16, 4, 1], "ahead": true}' --out "$out/bench-decode-1m-8b-ahead.json" ;;
row1m1641)  # no model: row1m with stage 0 refreshed every 16 steps ({"refresh": [16, 4, 1]}: equal to the default on
    # Qwen's retrieval suite at 128K-512K, docs/quality.md run 17), 50 steps so that three stage-0 refreshes are timed
    run decode_1m_8b_r1641 560 "${at1m[@]}" --decode-tokens 50 --profile-steps 4 \
        --attention-config '{"refresh": [16, 4, 1]}' --out "$out/bench-decode-1m-8b-r1641.json" ;;
earlyinstall)  # no model: tests/gpu's offload kernels (the copy's skipped entries too) and the install inside the
    # step (random:tiny offloaded == GPU-resident, graphs), then row1m with stage 1's candidates installed before
    # they are scored (kvcache/offload.py `install_reads`)
    gpu_tests gpu_check_offload_install 240 tests/gpu/test_offload.py -k "kernels or inside_the_step"
    run decode_1m_8b 560 "${row1m[@]}" ;;
stagingoverlap)  # no model: tests/gpu's offload kernels and the install inside the step (random:tiny offloaded ==
    # GPU-resident through graphs; its prefill chunks' prefixes gathered into two staging buffers, the next layer's on
    # the copy stream, by DMA runs and by the copy kernel), then row1m: the 1M prefill with the gathers overlapped
    gpu_tests gpu_check_staging_overlap 240 tests/gpu/test_offload.py -k "kernels or inside_the_step"
    run decode_1m_8b 560 "${row1m[@]}" ;;
stagingab)  # no model: the 8B shape's 512K prefill (fp8 KV offloaded, 4 GiB pool), one staging buffer (the gathers on
    # the layer's critical path, as before 2026-11-30) then two (the next layer's gather overlapped), each its own
    # process in one call: the same-call A/B of kvcache/staging.py's overlap
    ab=(bench decode --kv-cache-dtype fp8 --kv-cache-memory-gb 4 --max-num-batched-tokens 65536
        --kv-offloading-size 40 --lengths 512k --attention infinitehip --dense-lengths --decode-tokens 8)
    for n in 1 2; do
        run "prefill_512k_staging$n" 280 python3 -c "import sys; import longreach.kvcache.build as b; \
b.STAGING_BUFFERS_GPU = $n; from longreach.cli import main; sys.exit(main(sys.argv[1:]))" "${ab[@]}" \
            --out "$out/bench-decode-512k-8b-staging$n.json"
    done ;;
step16)  # row1m's command stopped after 18 decode tokens with the last 3 profiled (steps 14-16): in every 1M and 2M
    # run of 2026-11-29 the stage-0 refresh at step 16 took ~30 ms more than those at 8, 24, 32 and 40 (the same
    # bytes installed); this profile is where to look
    run decode_1m_8b_step16 560 "${at1m[@]}" --decode-tokens 18 --profile-steps 3 \
        --out "$out/bench-decode-1m-8b-step16.json" ;;
row2m)  # issue 31's 2M row: row1m's command at 2M with 48 decode steps (the last 4 profiled: no refresh among them),
    # a ~147 GiB host tier (nvidia-h200-x2's 256 GiB host, one of its GPUs). Its prefill took 409.6 s (2026-11-29),
    # the whole run ~9 min, past one call's limit with margin: start it detached,
    #   cp -r . /tmp/t2m && (cd /tmp/t2m && OUT=/tmp/t2m/out CUDA_VISIBLE_DEVICES=1 setsid nohup bash \
    #       scripts/device_runs.sh row2m > /tmp/t2m.log 2>&1; touch /tmp/t2m.done) &
    # and collect /tmp/t2m/out in a later call of the same lease
    run decode_2m_8b 1500 $bd --kv-offloading-size 150 --lengths 2M --attention infinitehip --dense-lengths \
        --decode-tokens 48 --profile-steps 4 --out "$out/bench-decode-2m-8b.json" ;;
offloadengine)  # needs the model: tests/gpu/test_offload.py's engine test alone (SmolLM2 128K, page and head slots)
    gpu_tests gpu_check_offload_engine 300 tests/gpu/test_offload.py -k engine --gpu-model "$model" ;;
offloadcheck)  # needs the model: the offloaded engine on the GPU (SmolLM2 128K, bit for bit, page and head slots),
    # then the default's 1M run with its profiles (prefill1m8b's command)
    gpu_tests gpu_check_offload_engine 240 tests/gpu/test_offload.py -k engine --gpu-model "$model"
    run prefill_1m_8b 400 $bd --kv-offloading-size 76 --lengths 1M --attention infinitehip --dense-lengths \
        --decode-tokens 48 --profile-prefill-steps 2 --profile-prefill-at 0.85 --profile-steps 4 \
        --out "$out/bench-decode-1m-prefill-profile-8b.json" ;;
units128k)  # issue 31: a slot per page vs per KV head's page (docs/design-offload-heads.md), same command otherwise
    gpu_tests gpu_check_offload_kernels 240 tests/gpu/test_offload.py -k kernels
    for unit in page head; do
        run "units_128k_$unit" 300 $bd --kv-cache-memory-gb 1 --kv-offloading-size 12 --kv-offload-unit $unit \
            --lengths 128k --attention infinitehip --dense-lengths 4k --decode-tokens 64 --profile-steps 4 \
            --out "$out/bench-decode-128k-offload-$unit-8b.json"
    done ;;
units128kx2)  # units128k on two GPUs of one host at once: GPU 0 the kernel check then page, GPU 1 head
    (CUDA_VISIBLE_DEVICES=0 gpu_tests gpu_check_offload_kernels 240 tests/gpu/test_offload.py -k kernels
     CUDA_VISIBLE_DEVICES=0 run units_128k_page 300 $bd --kv-cache-memory-gb 1 --kv-offloading-size 12 \
        --kv-offload-unit page --lengths 128k --attention infinitehip --dense-lengths 4k --decode-tokens 64 \
        --profile-steps 4 --out "$out/bench-decode-128k-offload-page-8b.json") &
    CUDA_VISIBLE_DEVICES=1 run units_128k_head 300 $bd --kv-cache-memory-gb 1 --kv-offloading-size 12 \
        --kv-offload-unit head --lengths 128k --attention infinitehip --dense-lengths 4k --decode-tokens 64 \
        --profile-steps 4 --out "$out/bench-decode-128k-offload-head-8b.json" &
    wait ;;
units1m)  # the same at 1M, both units at once on two GPUs of one host (each its own 76 GiB host tier)
    for gpu_unit in 0:page 1:head; do
        gpu=${gpu_unit%%:*} unit=${gpu_unit##*:}
        CUDA_VISIBLE_DEVICES=$gpu run "units_1m_$unit" 580 $bd --kv-offloading-size 76 --kv-offload-unit $unit \
            --lengths 1M --attention infinitehip --dense-lengths --decode-tokens 48 --profile-steps 4 \
            --out "$out/bench-decode-1m-offload-$unit-8b.json" &
    done
    wait ;;
decode128k)
    run decode_128k 300 $bd --kv-offloading-size 12 --lengths 128k --attention infinitehip:3k-flash psa \
        --dense-lengths 4k 128k --profile-steps 8 --out "$out/bench-decode-128k.json"
    ;;
engine)
    gpu_tests gpu_check_engine 560 tests/gpu -k engine --gpu-model "$model"
    ;;
engine2)  # the engine tests that the 2026-11-27 lease did not reach (offload, Quest) and the paged-prefill test
    gpu_tests gpu_check_engine2 560 tests/gpu -k "offload_engine or quest_engine or paged_prefill" --gpu-model "$model"
    ;;
calib32k)  # needs the model: MInference's patterns for Qwen 0.5B calibrated at 32K on the GPU (the shipped ones come
    # from 8K on a CPU and lost the essays passkey at 16K, quality.md run 3), then the essays passkey at 16K and 32K,
    # 10 prompts per cell: dense, the shipped patterns, the 32K ones, in one eval (issue 28, item 6)
    p32="$out/minference-qwen2.5-coder-0.5b-32k.json"
    run calibrate_32k 420 python3 -m longreach calibrate --method minference --model "$model" --task kv-retrieval \
        --length 32k --out "$p32"
    run passkey_minference 560 python3 -m longreach eval passkey --model "$model" --haystack paul-graham \
        --lengths 16k 32k --depths 0.1 0.3 0.5 0.7 0.9 --seeds 2 --attention dense minference@shipped minference@c32 \
        --attention-config "{\"minference@shipped\": {\"patterns\": \"qwen2.5-coder-0.5b\"}, \"minference@c32\": {\"patterns\": \"$p32\"}}" \
        --out "$out/passkey-minference-patterns-16k-32k.json"
    ;;
variants)  # needs the model: --share-prefill's decode variants against an engine of each (tests/gpu/test_eval_variants.py)
    gpu_tests gpu_check_variants 300 tests/gpu/test_eval_variants.py --gpu-model "$model"
    ;;
bsacheck)  # the block-sparse attention kernel against its reference at real sizes (split-K in prefill too)
    gpu_tests gpu_check_bsa 400 tests/gpu/test_kernels.py -k block_sparse_attention ;;
kerneltests)  # the kernels group's tests without its timings: correct beside other work on the GPU
    gpu_tests gpu_check_kernels 560 tests/gpu -k "not box and not gemma3"
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
quality)  # needs the model: passkey 16K-128K, one method per command (a timeout loses one method, not all)
    pk="python3 -m longreach eval passkey --model $model --lengths 16k 32k 64k 128k --depths 0.1 0.5 0.9 --seeds 2"
    for m in infinitehip minference minference+infinitehip:3k-flash psa; do
        run "passkey_${m//[:+]/_}" 150 $pk --attention "$m" --out "$out/passkey-${m//[:+]/_}.json"
    done
    ;;
lowq)  # needs the model: inside the trained length (4K, 8K), where true positions are right: dense vs each method
    run passkey_4k_8k 200 python3 -m longreach eval passkey --model "$model" --lengths 4k 8k \
        --depths 0.1 0.3 0.5 0.7 0.9 --seeds 2 --attention dense minference psa infinitehip \
        --out "$out/passkey-4k-8k.json"
    ;;
prefill128k)  # needs the model: end-to-end SmolLM2 prefill at 128K, minference (each preset) and infinitehip vs dense
    run prefill_128k 400 python3 -m longreach bench decode --model "$model" --text-source paul-graham --lengths 128k \
        --attention minference:vs minference:bs minference:a-shape infinitehip --dense-lengths 128k \
        --max-num-batched-tokens 32768 --decode-tokens 32 --out "$out/bench-prefill-128k-smollm2.json"
    ;;
cascadecheck)  # needs the model: cascading on the GPU == CPU, passkey 4k cache vs streaming 8K-64K, prefill vs dense
    gpu_tests gpu_check_cascading 300 tests/gpu/test_cascading.py -k "kernels or engine or passkey" \
        --gpu-model "$model"
    gpu_tests gpu_check_cascading_prefill 280 tests/gpu/test_cascading.py::test_cascading_prefill --gpu-model "$model"
    ;;
fp8quality)  # needs the model: infinitehip with fp8 KV on the prompts of `quality` (16K-32K), and with offload
    run passkey_fp8 150 python3 -m longreach eval passkey --model "$model" --lengths 16k 32k 64k 128k \
        --depths 0.1 0.5 0.9 --seeds 2 --attention infinitehip --kv-cache-dtype fp8 --out "$out/passkey-fp8.json"
    ;;
cascading)  # needs the model: the blog's 65K cache (8 sub-caches) vs streaming with the same memory, to 1M
    run passkey_cascading 400 python3 -m longreach eval passkey --model "$model" --lengths 128k 1M \
        --depths 0.1 0.5 0.9 --attention cascading:65k streaming --max-num-batched-tokens 65536 \
        --attention-config '{"streaming": {"n_sink": 64, "n_window": 65472}}' --out "$out/passkey-cascading.json"
    ;;
psa1m)  # needs the model: PSA's decode at 1M through the offloaded store, after infinitehip's prefill (psa's own
    # prefill is dense: ~minutes at 1M), against infinitehip's own decode; real weights, so real attention mass.
    # psa:0.95 at rank positions, then psa (0.95) at true positions (the paper's: ~42% of the keys at 1M, so the
    # slow one goes last; the JSON is written after each row); both meter their keys per query
    run smollm2_1m_psa ${SECS:-560} python3 -m longreach bench decode --model $model --text-source paul-graham --lengths 1M \
        --dense-lengths --max-num-batched-tokens 65536 --kv-offloading-size 26 --kv-cache-memory-gb 2 \
        --attention infinitehip infinitehip+psa:0.95 infinitehip+psa --decode-tokens 24 --profile-steps 2 \
        --attention-config \
        '{"psa": {"count_reads": true}, "psa:0.95": {"rope": "rank", "count_reads": true}}' \
        --out "$out/bench-decode-smollm2-1m-psa.json"
    ;;
psaeps)  # needs the model: psa's 1M offloaded decode time against the keys it reads, by epsilon (rank positions),
    # beside infinitehip in the same run
    run smollm2_1m_psa_eps 560 python3 -m longreach bench decode --model $model --text-source paul-graham --lengths 1M \
        --dense-lengths --max-num-batched-tokens 65536 --kv-offloading-size 26 --kv-cache-memory-gb 2 \
        --attention infinitehip infinitehip+psa@e50 infinitehip+psa@e80 --decode-tokens 24 --attention-config \
        '{"psa@e50": {"epsilon": 0.5, "rope": "rank", "count_reads": true}, "psa@e80": {"epsilon": 0.8, "rope": "rank", "count_reads": true}}' \
        --out "$out/bench-decode-smollm2-1m-psa-eps.json"
    ;;
verify7)  # needs the model: what the seventh session changed after its measurements, on a fresh machine: the gathered
    # prefill one sequence at a time (kernel and engine checks), then the 1M prefill again (infinitehip's row shows
    # whether kernels compile inside its timed prefill: prefill_jit), then psaeps
    gpu_tests gpu_check_cascading_flash 200 tests/gpu/test_cascading.py -k "flash or engine" --gpu-model "$model"
    run smollm2_1m_prefill_verify 330 python3 -m longreach bench decode --model "$model" --text-source paul-graham \
        --lengths 1M --dense-lengths --max-num-batched-tokens 65536 --decode-tokens 16 \
        --attention infinitehip cascading:16k --out "$out/bench-prefill-smollm2-1m-verify.json"
    grep -h "compilation(s) inside" "$out/smollm2_1m_prefill_verify.log"
    ;;
psarank)  # needs the model: PSA past the trained length (rope "rank", attention/psa/), after a sparse prefill;
    # keys read per decode query metered (count_reads) beside each length's accuracy
    gpu_tests gpu_check_psa_rank 150 tests/gpu/test_psa.py::test_psa_rank_rope
    run passkey_psa_rank 420 python3 -m longreach eval passkey --model "$model" --lengths 16k 32k 64k 128k \
        --depths 0.1 0.5 0.9 --seeds 2 --attention infinitehip infinitehip+psa ${RANK_METHODS:-} \
        --attention-config '{"psa": {"rope": "rank", "count_reads": true}}' --out "$out/passkey-psa-rank.json"
    ;;
psarecall)  # needs the model: the budget each method reads past the trained length (true positions for psa)
    for n in 32768 131072; do
        run recall_$n 280 python3 -m longreach eval recall --model "$model" --text-source paul-graham --length $n \
            --queries 128 --attention psa:0.9 psa:0.95 psa:0.98 infinitehip:3k quest:3k --out "$out/recall-$n.json"
    done
    ;;
prefill1m)  # needs the model: 1M prefill on the GPU (SmolLM2's 23 GiB of KV fit), the bounded cache vs infinitehip;
    # first the fused insertion kernels against torch (16k sizes) and through the engine against the CPU reference
    gpu_tests gpu_check_cascade_insert 240 tests/gpu/test_cascading.py -k "insert or engine" --gpu-model "$model"
    run smollm2_1m_prefill 400 python3 -m longreach bench decode --model "$model" --text-source paul-graham \
        --lengths 1M --dense-lengths --max-num-batched-tokens 65536 --decode-tokens 64 \
        --attention infinitehip cascading:16k --out "$out/bench-prefill-smollm2-1m.json"
    ;;
psa1mdiag)  # needs the model: where PSA's 1M decode time goes: on the GPU alone (SmolLM2's 23 GiB of KV fit), then
    # offloaded; 12 decode tokens each (8 warm-up), keys read metered
    for off in none 26; do
        flags=$([ $off = none ] && echo "" || echo "--kv-offloading-size $off --kv-cache-memory-gb 2")
        run smollm2_1m_psa_$off 280 python3 -m longreach bench decode --model "$model" --text-source paul-graham \
            --lengths 1M --dense-lengths --max-num-batched-tokens 65536 --decode-tokens 12 $flags \
            --attention infinitehip+psa --attention-config '{"psa": {"count_reads": true}}' \
            --out "$out/bench-decode-smollm2-1m-psa-$off.json"
    done
    ;;
cascadedecode)  # needs the model: where cascading's eager decode step goes (9.9 tok/s at 1M with a 16K cache)
    run smollm2_128k_cascading_decode 200 python3 -m longreach bench decode --model "$model" --text-source paul-graham \
        --lengths 128k --dense-lengths --max-num-batched-tokens 65536 --decode-tokens 24 --profile-steps 4 \
        --attention cascading:16k --out "$out/bench-decode-smollm2-128k-cascading-profile.json"
    # where a prefill step's time goes (profiled steps 2-3 at 128K; their seconds include the profiler's overhead)
    run smollm2_128k_prefill_profile 150 python3 -m longreach bench decode --model "$model" --text-source \
        paul-graham --lengths 128k --dense-lengths --max-num-batched-tokens 65536 --decode-tokens 8 \
        --attention infinitehip cascading:16k --profile-prefill-steps 2 --out "$out/bench-prefill-profile-128k.json"
    ;;
refresh8b)  # the decode schedules against the default (issue 28's candidates; docs/quality.md run 13): 8B shape, bf16
    # @pruned: the default's schedule, (8, 4, 1) since 2026-11-27 (runs 14-15 ran these groups when it was (16, 8, 4))
    cfg='{"infinitehip@pruned": {"dense_below": null}, "infinitehip@r16": {"dense_below": null, "refresh": [16, 8, 4]},
          "infinitehip@r1681": {"dense_below": null, "refresh": [16, 8, 1]}}'
    run decode_128k_refresh 300 python3 -m longreach bench decode --lengths 128k --attention infinitehip@pruned \
        infinitehip@r16 infinitehip@r1681 --attention-config "$cfg" --dense-lengths 128k --decode-tokens 64 \
        --out "$out/bench-decode-128k-8b-candidates.json"
    ;;
refresh512k)  # refresh8b at 512K (its KV fits an H200 in bf16, dense beside): each candidate's decode cost at 4x the length
    # @pruned: the default's schedule, (8, 4, 1) since 2026-11-27 (runs 14-15 ran these groups when it was (16, 8, 4))
    cfg='{"infinitehip@pruned": {"dense_below": null}, "infinitehip@r16": {"dense_below": null, "refresh": [16, 8, 4]},
          "infinitehip@r1681": {"dense_below": null, "refresh": [16, 8, 1]}}'
    run decode_512k_refresh 560 python3 -m longreach bench decode --lengths 512k --attention infinitehip@pruned \
        infinitehip@r16 infinitehip@r1681 --attention-config "$cfg" --dense-lengths 512k --decode-tokens 64 \
        --out "$out/bench-decode-512k-8b-candidates.json"
    ;;
refresh1m)
    # at 1M, fp8 KV offloaded, no dense row (its KV does not fit); one method per run: a 1M prefill takes minutes
    for m in "infinitehip {}" "infinitehip@r16 {\"refresh\": [16, 8, 4]}" "infinitehip@r1681 {\"refresh\": [16, 8, 1]}"; do
        run "decode_1m_${m%% *}" 590 $bd --kv-offloading-size 76 --lengths 1M --attention "${m%% *}" \
            --attention-config "{\"${m%% *}\": ${m#* }}" --dense-lengths --out "$out/bench-decode-1m-8b-${m%% *}.json"
    done
    ;;
box1m)
    run decode_1m_box 590 $bd --kv-offloading-size 76 --lengths 1M --attention infinitehip --dense-lengths \
        --out "$out/bench-decode-1m-box.json"
    ;;
psa128k)
    gpu_tests gpu_check_psa_step 150 tests/gpu/test_psa.py::test_psa_step_times
    run psa_128k 400 python3 -m longreach bench decode --lengths 128k --attention ${PSA_METHODS:-infinitehip psa \
        psa@waves} --attention-config '{"psa@waves": {"decode_kernel": "waves"}}' --dense-lengths ${DENSE-128k} \
        --decode-tokens 64 --profile-steps 4 --out "$out/bench-decode-128k-psa.json"
    ;;
seeds8b)
    run cascading_1m 300 python3 -m longreach bench decode --lengths 1M --attention cascading:16k --dense-lengths \
        --max-num-batched-tokens 65536 --decode-tokens 64 --out "$out/bench-decode-1m-cascading.json"
    run psa_128k 280 $bd --kv-offloading-size 12 --lengths 128k --attention infinitehip psa --dense-lengths 128k \
        --decode-tokens 64 --out "$out/bench-decode-128k-psa.json"
    ;;
*)
    echo "usage: bash scripts/device_runs.sh GROUP... (kernels recheck decode1m decode128k engine smollm1m serve" \
        "quality lowq prefill128k cascadecheck fp8quality cascading psa1m verify7 psaeps psarank psarecall prefill1m psa1mdiag cascadedecode box1m psa128k seeds8b batch16 fp8w crossover paced)" >&2
    exit 2
    ;;
esac
done
