#!/usr/bin/env bash
# The retrieval ladder of issue 13 on one GPU (docs/quality.md, "The retrieval ladder"): passkey at 4K-128K with
# 20 prompts per cell (5 depths x 4 keys, the needle phrasings in turn) on three haystacks, and RULER NIAH-single
# 1/2/3, for every rung (dense + YaRN / dynamic NTK, positions only, oracle selection, the method) and the other
# methods. Needs /tmp/m/model.gguf (scripts/device_model.sh).
#
#   bash scripts/device_ladder.sh [SECONDS]     # run the jobs not done yet, P at a time, until SECONDS have passed
#   ONLY='REGEX' P=3 bash scripts/device_ladder.sh 540   # only the jobs whose name matches; 3 at a time
#   SUITE=qwen_wall MODEL=/tmp/m/model.gguf bash scripts/device_ladder.sh   # another job list (suite_* below)
#   LIST=1 SUITE=qwen_rest bash scripts/device_ladder.sh    # print a suite's jobs and run nothing
#   BG=1 SUITE=qwen_final bash scripts/device_ladder.sh 1500   # run under setsid, past the call's 600 s limit, then
#   COLLECT=1 bash scripts/device_ladder.sh      # in each later call: wait up to WAIT_S (560) s for it, pack, print
#   The machine goes back after ~30 s without a call, taking the background run with it: issue the start and its
#   collect calls together, one batch of back-to-back calls (twice on 2026-11-27 a pause to read a call's output
#   between them lost the run; COLLECT on a fresh machine now says so and exits at once).
#
# Jobs run in priority order; each writes /tmp/ladder/NAME.json, and a job whose JSON exists is skipped, so calls on
# a warm machine resume where the last one stopped (a job killed at the deadline runs again from scratch). Every
# call packs what exists into $OUT/ladder.tgz and prints the tables (scripts/ladder_table.py).
set -u
budget=${1:-560}
P=${P:-3}  # 4 evals at 12 GiB of KV each ran out of GPU memory on an H100 beside hip
KV_GB=${KV_GB:-12}  # KV per eval; 128K of SmolLM2 is 2.8 GiB, so 6 lets P=6 share an H100
out=${OUT:-out}
model=${MODEL:-/tmp/m/model.gguf}
export PYTHONUNBUFFERED=1
yarn='{"rope_type": "yarn", "factor": 16}'
ntk='{"rope_type": "dynamic", "factor": 16}'
declare -a JOBS=()
# job NAME ARGS... : one eval command; NAME = KIND__HAYSTACK__LABEL__LENGTHS
job() { JOBS+=("$(printf '%q ' "$@")"); }
ladder() {  # ladder HAYSTACK LABEL [eval args...]: one method at 128K, then 4K-64K
    local hay=$1 label=$2; shift 2
    for lens in 128k "4k 8k 16k 32k 64k"; do
        job "passkey__${hay}__${label}__${lens// /-}" passkey --haystack "$hay" --lengths $lens "$@"
    done
}
rungs() {  # the rungs, on haystack $1
    ladder "$1" infinitehip --attention infinitehip:3k
    ladder "$1" infinitehip-3k-exact --attention infinitehip:3k-exact
    ladder "$1" infinitehip-3k-box --attention infinitehip:3k-box
    ladder "$1" dense --attention dense
    ladder "$1" oracle --attention infinitehip:oracle
    ladder "$1" dense+yarn16 --attention dense --rope-scaling "$yarn"
}
ruler() {  # ruler LABEL METHOD LENGTHS: NIAH-single 1, 2 and 3, one job per task
    for t in niah_single_1 niah_single_2 niah_single_3; do
        job "ruler__${t}__${1}__${3// /-}" ruler --tasks "$t" --lengths $3 --samples 20 --attention "$2"
    done
}
suite_smollm2() {  # issue 13's ladder on SmolLM2
rungs filler
ladder filler oracle-true --attention infinitehip:oracle-true
ladder filler positions-st --attention infinitehip:positions-st
ladder filler positions-de --attention infinitehip:positions-de
ladder filler dense+ntk16 --attention dense --rope-scaling "$ntk"
ladder filler streaming --attention streaming
ladder filler hip --attention hip
ladder filler quest --attention quest
ladder filler infinitehip-5k --attention infinitehip:5k
ladder filler infinitehip-w2048 --attention infinitehip:3k --attention-config '{"n_window": 2048}'
# what separates infinitehip 3k from the oracle (which finds the key at 16K-128K): the chunk-indexed positions of
# layers 0-2, the decode refresh intervals, stage 0's SelectRep (infinitehip-3k-exact, in the rungs)
# and stage 0 scored from a box around each chunk's keys instead of SelectRep (kernels/chunk_box.py; eager decode)
ladder filler infinitehip-box-minmax --attention infinitehip:3k --attention-config '{"stage0_scores": "minmax"}'
ladder filler infinitehip-box-cuboid --attention infinitehip:3k --attention-config '{"stage0_scores": "cuboid-mean"}'
ladder filler infinitehip-rt --attention infinitehip:3k --attention-config '{"prune_rope": "rt"}'
ladder filler infinitehip-refresh1 --attention infinitehip:3k --attention-config '{"refresh": [1, 1, 1]}'
ruler dense dense "4k 8k"
ruler infinitehip infinitehip:3k "4k 8k"
ruler infinitehip infinitehip:3k 64k
ruler infinitehip infinitehip:3k 128k
ruler infinitehip-3k-exact infinitehip:3k-exact "4k 8k"
ruler infinitehip-3k-exact infinitehip:3k-exact 64k
ruler infinitehip-3k-exact infinitehip:3k-exact 128k
ruler infinitehip-3k-box infinitehip:3k-box 64k
ruler infinitehip-3k-box infinitehip:3k-box 128k
ruler infinitehip-3k-box infinitehip:3k-box "4k 8k"
rungs paul-graham
rungs squad
# every method's row on the natural-text haystacks too (the rungs above decide; these complete the tables)
for hay in squad paul-graham; do
    ladder "$hay" streaming --attention streaming
    ladder "$hay" hip --attention hip
    ladder "$hay" quest --attention quest
done
# multi-key NIAH (the goal: infinitehip at 32K >= dense at 4K) and the long cells (>= 10 prompts at 256K, >= 5 at 1M;
# SmolLM2's KV is 22.5 KiB per token: 1M needs ~23 GiB)
job "ruler__niah_multikey_1__dense__4k" ruler --tasks niah_multikey_1 --lengths 4k --samples 20 --attention dense
# (label method): rows named "infinitehip" are the 3k preset, the default until 2026-11-25 (now 3k-box)
for pair in "infinitehip infinitehip:3k" "infinitehip-3k-box infinitehip:3k-box"; do
    set -- $pair
    job "ruler__niah_multikey_1__${1}__32k" ruler --tasks niah_multikey_1 --lengths 32k --samples 20 --attention "$2"
    job "passkey__filler__${1}__256k" passkey --haystack filler --lengths 256k --seeds 2 --attention "$2"
done
# where multi-key NIAH is lost: inside the trained length (dense and 3k-box at 4K/8K) and the oracle at 32K
job "ruler__niah_multikey_1__dense__8k" ruler --tasks niah_multikey_1 --lengths 8k --samples 20 --attention dense
job "ruler__niah_multikey_1__infinitehip-3k-box__4k-8k" ruler --tasks niah_multikey_1 --lengths 4k 8k --samples 20 \
    --attention infinitehip:3k-box
job "ruler__niah_multikey_1__oracle__32k" ruler --tasks niah_multikey_1 --lengths 32k --samples 20 \
    --attention infinitehip:oracle
# 1M: one job per depth (one prompt each, ~23 GiB of KV), so that each fits a call and several run at once
for pair in "infinitehip-3k-box infinitehip:3k-box" "infinitehip infinitehip:3k"; do
    set -- $pair
    for depth in 0.1 0.3 0.5 0.7 0.9; do
        job "passkey__filler__${1}__1M-d${depth#0.}" passkey --haystack filler --lengths 1M --seeds 1 \
            --depths "$depth" --attention "$2" --kv-cache-memory-gb 24
    done
done
}

# Qwen2.5-Coder (32K-trained; issue 28). Candidates for the wall at 512K-1M, all 3k-box with one change:
S0X2='{"budgets": [65536, 8192, 2048]}'            # stage 0 keeps twice the tokens
S0X4='{"budgets": [131072, 8192, 2048]}'           # stage 0 keeps four times the tokens (a quarter of 512K)
BOX32='{"chunk_sizes": [32, 16, 8], "exact_below": 16}'  # stage 0 boxes of 32 tokens (tighter bounds)
CUBOID='{"stage0_scores": "cuboid-mean"}'            # stage 0 scored from the cuboid's mean instead of min/max
trace() {  # trace LABEL LENGTHS DEPTHS PRESET [CONFIG]: where the needle is lost, per layer and stage
    job "trace__paul-graham__$1__$2" trace "$2" "$3" "$4" "${5:-}"
}
suite_qwen_wall() {  # where the needle is lost at 512K and 1M, and which candidate keeps it
    trace 3k-box 524288 0.1,0.3,0.5,0.7,0.9 3k-box
    trace s0x2 524288 0.1,0.3,0.5,0.7,0.9 3k-box "$S0X2"
    trace box32 524288 0.1,0.3,0.5,0.7,0.9 3k-box "$BOX32"
    trace cuboid 524288 0.1,0.3,0.5,0.7,0.9 3k-box "$CUBOID"
    trace 3k-box 1048576 0.2,0.5,0.8 3k-box
    trace s0x2 1048576 0.2,0.5,0.8 3k-box "$S0X2"
    trace box32 1048576 0.2,0.5,0.8 3k-box "$BOX32"
    trace cuboid 1048576 0.2,0.5,0.8 3k-box "$CUBOID"
    trace oracle 524288 0.5 oracle
}
suite_qwen_wall2() {  # where the wall starts (128K-512K), and whether the oracle's budget or the method's is short
    trace 3k-box 131072 0.1,0.3,0.5,0.7,0.9 3k-box
    trace 3k-box 262144 0.1,0.3,0.5,0.7,0.9 3k-box
    trace oracle 262144 0.1,0.3,0.5,0.7,0.9 oracle
    trace oracle8k 524288 0.1,0.5,0.9 oracle '{"budgets": [8192], "early_last_budget": 16384}'
    trace 3k-box-big 524288 0.1,0.5,0.9 3k-box '{"budgets": [65536, 16384, 8192], "early_last_budget": 16384}'
    trace oracle-b 524288 0.1,0.9 oracle
}
suite_qwen() {  # the quality tables of docs/quality.md on Qwen: inside the window, then beyond
    local t
    for m in "dense dense" "infinitehip-3k-box infinitehip:3k-box"; do
        set -- $m
        job "passkey__paul-graham__${1}__4k-8k-16k-32k" passkey --haystack paul-graham --lengths 4k 8k 16k 32k \
            --attention "$2"
        for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multivalue vt; do
            job "ruler__${t}__${1}__4k-8k-16k-32k" ruler --tasks "$t" --lengths 4k 8k 16k 32k --samples 20 \
                --attention "$2"
        done
    done
    job "passkey__paul-graham__infinitehip-3k-box__64k-128k" passkey --haystack paul-graham --lengths 64k 128k \
        --attention infinitehip:3k-box
    for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1; do
        job "ruler__${t}__infinitehip-3k-box__64k-128k" ruler --tasks "$t" --lengths 64k 128k --samples 20 \
            --attention infinitehip:3k-box
    done
    job "passkey__paul-graham__dense__64k-128k" passkey --haystack paul-graham --lengths 64k 128k --attention dense
    job "passkey__paul-graham__dense+yarn4__64k-128k" passkey --haystack paul-graham --lengths 64k 128k \
        --attention dense --rope-scaling '{"rope_type": "yarn", "factor": 4}'
    job "passkey__paul-graham__oracle__128k" passkey --haystack paul-graham --lengths 128k --attention infinitehip:oracle
    for t in niah_single_2 niah_multikey_1; do
        job "ruler__${t}__dense__64k" ruler --tasks "$t" --lengths 64k --samples 20 --attention dense
    done
}
suite_qwen_next() {  # the cells issue 28 still lacks, in priority order (the next session's first runs)
    local t
    # the remedy for the misses inside the window: exact attention while a sequence is inside the trained 32K
    for t in niah_multikey_1 niah_multivalue niah_single_3; do
        job "ruler__${t}__3k-box-dense32k__16k-32k" ruler --tasks "$t" --lengths 16k 32k --samples 20 \
            --attention infinitehip:3k-box --attention-config '{"dense_below": 32768}'
    done
    # where the 128K misses go: the oracle's budget and attention positions (far needles fail, dense + YaRN too)
    job "passkey__paul-graham__oracle8k-de__128k" passkey --haystack paul-graham --lengths 128k \
        --attention infinitehip:oracle --attention-config '{"budgets": [8192], "early_last_budget": 16384, "attend_rope": "de"}'
    job "passkey__paul-graham__oracle32k__128k" passkey --haystack paul-graham --lengths 128k \
        --attention infinitehip:oracle --attention-config '{"budgets": [32768], "early_last_budget": 32768}'
    # beyond: >= 10 prompts per cell at 256K-1M for the default and the oracle rungs
    job "passkey__paul-graham__infinitehip-3k-box__256k" passkey --haystack paul-graham --lengths 256k \
        --attention infinitehip:3k-box
    job "passkey__paul-graham__oracle8k__256k" passkey --haystack paul-graham --lengths 256k \
        --attention infinitehip:oracle --attention-config '{"budgets": [8192], "early_last_budget": 16384}'
    for t in niah_single_1 niah_single_2; do
        job "ruler__${t}__infinitehip-3k-box__256k" ruler --tasks "$t" --lengths 256k --samples 10 \
            --attention infinitehip:3k-box
        job "ruler__${t}__infinitehip-3k-box__512k" ruler --tasks "$t" --lengths 512k --samples 10 \
            --attention infinitehip:3k-box
    done
    job "ppl__paul-graham__dense__32k" ppl --text-source paul-graham --lengths 32k --samples 2 --attention dense
    job "ppl__paul-graham__infinitehip-3k-box__32k-512k" ppl --text-source paul-graham --lengths 32k 128k 512k \
        --samples 2 --attention infinitehip:3k-box
}
# the default's cells on Qwen (infinitehip:3k-box, label infinitehip-3k-box; passkey in the essays)
DEFAULT=infinitehip:3k-box
ORACLE8K='{"budgets": [8192], "early_last_budget": 16384}'  # the exact top 8K tokens: 4x the oracle's budget
DENSE32K='{"dense_below": 32768}'  # exact attention while a sequence is inside the trained 32K
TRAINED='{"dense_below":"trained"}'  # the same, from the model's own trained context (no spaces: a job splits on them)
pk() {  # pk LENGTHS [eval args...]: the default's passkey cell(s), label infinitehip-3k-box
    job "passkey__paul-graham__infinitehip-3k-box__${1// /-}" passkey --haystack paul-graham --lengths $1 "${@:2}" \
        --attention "$DEFAULT"
}
rl() {  # rl TASK LENGTHS SAMPLES: the default's RULER cell(s)
    job "ruler__$1__infinitehip-3k-box__${2// /-}" ruler --tasks "$1" --lengths $2 --samples "$3" --attention "$DEFAULT"
}
pk_1m() {  # pk_1m SEEDS: the default's 1M passkey, one job per depth (a call's deadline cuts little)
    local d
    for d in 0.1 0.3 0.5 0.7 0.9; do
        job "passkey__paul-graham__infinitehip-3k-box__1M-d${d#0.}" passkey --haystack paul-graham --lengths 1M \
            --seeds "$1" --depths "$d" --attention "$DEFAULT"
    done
}
rl_1m() {  # rl_1m TASK SAMPLES: the default's 1M RULER cell, one job per seed (42-46)
    rl_1m_turns "$2" "$1"
}
rl_1m_turns() {  # rl_1m_turns SAMPLES TASK...: rl_1m of each task, seed by seed with the tasks in turn
    local s t n=$1
    shift
    for s in 42 43 44 45 46; do
        for t in "$@"; do
            job "ruler__${t}__infinitehip-3k-box__1M-s$s" ruler --tasks "$t" --lengths 1M --samples "$n" --seed "$s" \
                --attention "$DEFAULT"
        done
    done
}
oracle8k_256k() {
    job "passkey__paul-graham__oracle8k__256k" passkey --haystack paul-graham --lengths 256k --seeds 2 \
        --attention infinitehip:oracle --attention-config "$ORACLE8K"
}
ppl_essays_512k() {  # the same windows' ends at every length, dense beside the default inside the window
    job "ppl__paul-graham__dense+3k-box__32k-512k" ppl --text-source paul-graham --lengths 32k 128k 512k \
        --samples 1 --attention dense "$DEFAULT" --max-dense-length 32768
}
ppl_hotpotqa_1m() {  # the essays are ~700K tokens: too short for 1M
    job "ppl__hotpotqa__dense+3k-box__32k-1M" ppl --text-source hotpotqa --lengths 32k 128k 512k 1M --samples 1 \
        --attention dense "$DEFAULT" --max-dense-length 32768
}
dense32k_256k() {  # the candidate default past the window
    job "passkey__paul-graham__3k-box-dense32k__256k" passkey --haystack paul-graham --lengths 256k --seeds 2 \
        --attention "$DEFAULT" --attention-config "$DENSE32K"
}
streaming16k() {  # streaming with the memory of cascading:16k (16,384 tokens)
    job "passkey__paul-graham__streaming-16k__64k-128k" passkey --haystack paul-graham --lengths 64k 128k \
        --attention streaming --attention-config '{"n_sink": 64, "n_window": 16320}'
}
suite_qwen_remedy() {  # exact attention inside the trained 32K (dense_below 32768) against the default, in one run:
    # inside the window with dense beside, and past it on the two tasks the default loses most
    local t m
    for m in "dense dense {}" "3k-box-dense32k infinitehip:3k-box {\"dense_below\":32768}"; do
        set -- $m
        for t in niah_multikey_1 niah_multivalue niah_single_3; do
            job "ruler__${t}__${1}__16k-32k" ruler --tasks "$t" --lengths 16k 32k --samples 20 --attention "$2" \
                --attention-config "$3"
        done
    done
    for m in "infinitehip-3k-box infinitehip:3k-box {}" "3k-box-dense32k infinitehip:3k-box {\"dense_below\":32768}"; do
        set -- $m
        job "passkey__paul-graham__${1}__64k-128k" passkey --haystack paul-graham --lengths 64k 128k --attention "$2" \
            --attention-config "$3"
        job "ruler__niah_single_3__${1}__64k-128k" ruler --tasks niah_single_3 --lengths 64k 128k --samples 20 \
            --attention "$2" --attention-config "$3"
    done
}
suite_qwen_rest() {  # the 0.5B cells issue 28 still lacks after runs 1-5 (docs/quality.md), ~2 calls of 560 s
    ppl_hotpotqa_1m
    rl_1m niah_single_2 2
    pk_1m 2
    rl niah_multikey_1 "64k 128k" 20
    job "ruler__niah_multikey_1__dense__32k" ruler --tasks niah_multikey_1 --lengths 32k --samples 20 --attention dense
    rl niah_single_1 512k 10
    oracle8k_256k
    # the positions-only rung at 128K: every key attended, only the positions remapped (the selection ruled out)
    job "passkey__paul-graham__positions-st__128k" passkey --haystack paul-graham --lengths 128k \
        --attention infinitehip:positions-st
}
suite_qwen15_rest() {  # the 1.5B cells after run 4: 512K and 1M, ~3 calls
    pk 512k --seeds 2
    rl niah_single_2 512k 10
    pk_1m 2
    rl_1m niah_single_2 2
}
suite_qwen_final() {  # the 0.5B cells issue 28 still lacks after run 6, in priority order (one lease, BG=1)
    pk_1m 2
    oracle8k_256k
    local t
    for t in niah_single_3 niah_multikey_1; do rl "$t" 256k 10; done
    # where niah_single_2 is lost at 512K: the exact top-2K oracle on the same prompts as run 5's default
    job "ruler__niah_single_2__oracle__512k" ruler --tasks niah_single_2 --lengths 512k --samples 10 \
        --attention infinitehip:oracle
    for t in niah_single_3 niah_multikey_1; do rl "$t" 512k 10; done
    job "passkey__paul-graham__minference-calibrated__16k-32k" passkey --haystack paul-graham --lengths 16k 32k \
        --attention minference --attention-config '{"patterns": "qwen2.5-coder-0.5b"}'
    for t in niah_single_3 niah_multikey_1; do rl_1m "$t" 2; done
}
suite_qwen_trained() {  # the default against itself with {"dense_below": "trained"} (exact attention inside the
    # trained 32K), dense beside inside the window, in one run: the suite a default change needs (issue 28/31)
    local t m
    for m in "dense dense {}" "3k-box-trained $DEFAULT $TRAINED"; do
        set -- $m
        job "passkey__paul-graham__${1}__4k-8k-16k-32k" passkey --haystack paul-graham --lengths 4k 8k 16k 32k \
            --attention "$2" --attention-config "$3"
        for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multivalue vt; do
            job "ruler__${t}__${1}__4k-8k-16k-32k" ruler --tasks "$t" --lengths 4k 8k 16k 32k --samples 20 \
                --attention "$2" --attention-config "$3"
        done
    done
    for m in "infinitehip-3k-box $DEFAULT {}" "3k-box-trained $DEFAULT $TRAINED"; do
        set -- $m
        job "passkey__paul-graham__${1}__64k-128k" passkey --haystack paul-graham --lengths 64k 128k \
            --attention "$2" --attention-config "$3"
        for t in niah_single_1 niah_single_2 niah_single_3 niah_multikey_1; do
            job "ruler__${t}__${1}__64k-128k" ruler --tasks "$t" --lengths 64k 128k --samples 20 --attention "$2" \
                --attention-config "$3"
        done
    done
}
suite_qwen_close() {  # issue 28's last 0.5B cells (one lease, BG=1, P=6 KV_GB=12): where niah_single_2 is lost
    # past 128K (the exact top-2K oracle at 256K on run 4's prompts), then the whole qwen_trained suite, then the 512K
    # cells of niah_single_3 and multikey
    job "ruler__niah_single_2__oracle__256k" ruler --tasks niah_single_2 --lengths 256k --samples 10 \
        --attention infinitehip:oracle
    suite_qwen_trained
    local t
    for t in niah_single_3 niah_multikey_1; do rl "$t" 512k 10; done
}
suite_qwen_close2() {  # what qwen_close's deadline cut (run 8): the trained rows past the window, then 512K
    local t
    for t in niah_single_2 niah_single_3 niah_multikey_1; do
        job "ruler__${t}__3k-box-trained__64k-128k" ruler --tasks "$t" --lengths 64k 128k --samples 20 \
            --attention "$DEFAULT" --attention-config "$TRAINED"
    done
    for t in niah_single_3 niah_multikey_1; do rl "$t" 512k 10; done
}
suite_qwen_wall512() {  # issue 28's last 0.5B cells (one lease, BG=1, P=5 KV_GB=14): niah_single_3 and multikey
    # at 512K, niah_single_3's own oracle rung at 256K (where its fall past 128K is), then both at 1M
    local t
    for t in niah_single_3 niah_multikey_1; do rl "$t" 512k 10; done
    job "ruler__niah_single_3__oracle__256k" ruler --tasks niah_single_3 --lengths 256k --samples 10 \
        --attention infinitehip:oracle
    rl_1m_turns 2 niah_single_3 niah_multikey_1  # the two tasks in turn: a deadline cuts both alike
}
suite_qwen_wall512b() {  # what run 10 left (P=4 KV_GB=14): multikey's oracle rung at 512K (its miss is not located),
    # then the 1M jobs its deadline cut, so that both 1M cells hold 10 prompts
    job "ruler__niah_multikey_1__oracle__512k" ruler --tasks niah_multikey_1 --lengths 512k --samples 10 \
        --attention infinitehip:oracle
    local j
    for j in "niah_multikey_1 45" "niah_single_3 46" "niah_multikey_1 46"; do
        set -- $j
        job "ruler__$1__infinitehip-3k-box__1M-s$2" ruler --tasks "$1" --lengths 1M --samples 2 --seed "$2" \
            --attention "$DEFAULT"
    done
}
suite_qwen_s12() {  # one background lease (P=6 KV_GB=12): multikey's oracle rung at 512K (6 prompts: the oracle
    # scores every key, ~20 min for 10 alone), then niah_single_3 at 256K for the default and four variants of it on
    # the same 10 prompts: which stage loses it (default 6/10 in run 7, the oracle 9/10 in run 10)
    job "ruler__niah_multikey_1__oracle__512k" ruler --tasks niah_multikey_1 --lengths 512k --samples 6 \
        --attention infinitehip:oracle
    job "ruler__niah_single_3__infinitehip-3k-box__256k" ruler --tasks niah_single_3 --lengths 256k --samples 10 \
        --attention "$DEFAULT"
    local v
    for v in "s0x2 $S0X2" "s0x4 $S0X4" "box32 $BOX32" "big {\"budgets\": [65536, 16384, 4096], \"early_last_budget\": 8192}"; do
        set -- $v
        job "ruler__niah_single_3__infinitehip-3k-box-$1__256k" ruler --tasks niah_single_3 --lengths 256k \
            --samples 10 --attention "$DEFAULT@$1" --attention-config "{\"$DEFAULT@$1\": ${v#* }}"
    done
}
suite_qwen_s13() {  # is niah_single_3's loss at 256K the decode masks' refresh? (P=8 KV_GB=8) Run 12's misses are
    # garbled copies of the needle's UUID, and the oracle, which recomputes its mask at every decode step, finds 9/10:
    # every stage every step (r1), the last stage every step (r1last), on RULER seeds 42 and 43; the default and the
    # doubled budgets (big) on seed 43 beside them
    local v seed
    for seed in 42 43; do
        for v in "r1 {\"refresh\": [1, 1, 1]}" "r1last {\"refresh\": [16, 8, 1]}"; do
            set -- $v
            job "ruler__niah_single_3__infinitehip-3k-box-$1__256k-s$seed" ruler --tasks niah_single_3 --lengths 256k \
                --samples 10 --seed "$seed" --attention "$DEFAULT@$1" --attention-config "{\"$DEFAULT@$1\": ${v#* }}"
        done
    done
    for seed in 43 44; do
        job "ruler__niah_single_3__infinitehip-3k-box__256k-s$seed" ruler --tasks niah_single_3 --lengths 256k \
            --samples 10 --seed "$seed" --attention "$DEFAULT"
    done
    v='{"budgets": [65536, 16384, 4096], "early_last_budget": 8192}'
    job "ruler__niah_single_3__infinitehip-3k-box-big__256k-s43" ruler --tasks niah_single_3 --lengths 256k \
        --samples 10 --seed 43 --attention "$DEFAULT@big" --attention-config "{\"$DEFAULT@big\": $v}"
    job "ruler__niah_single_3__infinitehip-3k-box-r1__256k-s44" ruler --tasks niah_single_3 --lengths 256k \
        --samples 10 --seed 44 --attention "$DEFAULT@r1" --attention-config "{\"$DEFAULT@r1\": {\"refresh\": [1, 1, 1]}}"
}
# the suites qwen_fresh and qwen_fresh2 ran when the default's schedule was (16, 8, 4) (runs 14-15); since then the
# default's is FRESH's, so they now compare it with itself and LOOK1 with (8, 4, 1) under it: qwen_r16 is the next one
FRESH='{"refresh": [8, 4, 1]}'  # the last stage recomputed at every decode step (run 13: 20/20 at 128K)
LOOK1='{"lookahead": 1}'         # each kept chunk's successor kept too during decode (no extra recomputation)
R1681='{"refresh": [16, 8, 1]}'  # only the last stage at every step: cheaper than (8, 4, 1) where stage 0 costs most
suite_qwen_fresh() {  # the candidates against the default past the window, the default in the same run, by priority
    # (P=8 KV_GB=8; the 1M jobs ask for 14 GiB themselves): what a default change needs (docs/quality.md, run 13)
    local t L v
    for L in "256k 42 10" "128k 42 10" "512k 42 10" "1M 42 2"; do
        set -- $L
        local len=$1 seed=$2 n=$3 kv=()
        [ "$len" = 1M ] && kv=(--kv-cache-memory-gb 14)
        for t in niah_single_3 niah_single_2 niah_multikey_1; do
            job "ruler__${t}__infinitehip-3k-box__${len}-s$seed" ruler --tasks "$t" --lengths "$len" --samples "$n" \
                --seed "$seed" --attention "$DEFAULT" "${kv[@]}"
            for v in "fresh $FRESH" "look1 $LOOK1"; do
                set -- $v
                job "ruler__${t}__infinitehip-3k-box-$1__${len}-s$seed" ruler --tasks "$t" --lengths "$len" \
                    --samples "$n" --seed "$seed" --attention "$DEFAULT@$1" \
                    --attention-config "{\"$DEFAULT@$1\": ${v#* }}" "${kv[@]}"
            done
        done
        [ "$len" = 128k ] && for v in "- -" "fresh $FRESH" "look1 $LOOK1"; do  # the essays passkey, 20 prompts
            set -- $v
            if [ "$1" = - ]; then pk 128k; else
                job "passkey__paul-graham__infinitehip-3k-box-$1__128k" passkey --haystack paul-graham --lengths 128k \
                    --attention "$DEFAULT@$1" --attention-config "{\"$DEFAULT@$1\": ${v#* }}"
            fi
        done
    done
}
ppl_step() {  # where perplexity steps up between 32K and 128K (+11.7% at 128K in run 6): the default beside dense,
    # the exact top-k oracle (the selection ruled out) and every key with remapped positions (positions only)
    job "ppl__hotpotqa__step-rungs__32k-128k" ppl --text-source hotpotqa --lengths 32k 48k 64k 96k 128k --samples 1 \
        --attention dense "$DEFAULT" infinitehip:oracle infinitehip:positions-st infinitehip:positions-de
}
suite_qwen_fresh2() {  # qwen_fresh's RULER cells with the three runs in one eval, each prompt prefilled once
    # (--share-prefill: they differ only in decode-time fields); 512K then 1M (P=3 KV_GB=8; 1M asks for 14 GiB)
    local t L cfg="{\"$DEFAULT@fresh\": $FRESH, \"$DEFAULT@look1\": $LOOK1}"
    # first, a cell run 14 measured with one run per job (docs/results/qwen05-ladder-h200-run14-128k): its
    # predictions, prompt by prompt, say whether the shared prefill reproduces separate runs on the GPU
    job "ruler__niah_single_3__infinitehip-3k-box-variants__128k-s42" ruler --tasks niah_single_3 --lengths 128k \
        --samples 10 --seed 42 --attention "$DEFAULT" "$DEFAULT@fresh" "$DEFAULT@look1" --attention-config "$cfg" \
        --share-prefill
    for L in "512k 42 10" "ppl" "1M 42 2" "256k 43 10" "128k 43 10"; do
        set -- $L
        if [ "$1" = ppl ]; then ppl_step; continue; fi
        local len=$1 seed=$2 n=$3 kv=()
        [ "$len" = 1M ] && kv=(--kv-cache-memory-gb 14)
        for t in niah_single_3 niah_single_2 niah_multikey_1; do
            job "ruler__${t}__infinitehip-3k-box-variants__${len}-s$seed" ruler --tasks "$t" --lengths "$len" \
                --samples "$n" --seed "$seed" --attention "$DEFAULT" "$DEFAULT@fresh" "$DEFAULT@look1" \
                --attention-config "$cfg" --share-prefill "${kv[@]}"
        done
    done
}
suite_qwen_r16() {  # the next schedule candidate against the default (8, 4, 1), as qwen_fresh2 (P=3 KV_GB=8)
    local t L cfg="{\"$DEFAULT@r1681\": $R1681}"
    for L in "512k 42 10" "256k 43 10" "1M 42 2" "128k 43 10"; do
        set -- $L
        local len=$1 seed=$2 n=$3 kv=()
        [ "$len" = 1M ] && kv=(--kv-cache-memory-gb 14)
        for t in niah_single_3 niah_single_2 niah_multikey_1; do
            job "ruler__${t}__infinitehip-3k-box-r1681__${len}-s$seed" ruler --tasks "$t" --lengths "$len" \
                --samples "$n" --seed "$seed" --attention "$DEFAULT" "$DEFAULT@r1681" --attention-config "$cfg" \
                --share-prefill "${kv[@]}"
        done
    done
    ppl_step
    # the positions-only rungs ran in run 16 (SUITE=qwen_positions); one job per rung there: together they outran a
    # 1000 s budget
}
R1641='{"refresh": [16, 4, 1]}'  # stage 0 half as often as (8, 4, 1): halves the 1M decode's refresh copies
R3241='{"refresh": [32, 4, 1]}'  # a quarter as often: stage 0's masks as old as "install ahead" with (16, 4, 1)
ruler_grid() {  # ruler_grid LABEL CFG SHARE METHOD...: niah_single_3, niah_single_2 and niah_multikey_1 at 512K,
    # 256K and 128K (10 prompts each, run 15's seeds), then 1M (2 prompts, 14 GiB of KV), every METHOD on the same
    # prompts; SHARE "--share-prefill" (decode-only candidates: each prompt prefilled once) or "" (prefill changes)
    local label=$1 cfg=$2 share=$3 t L len seed n
    shift 3
    for L in "512k 42 10" "256k 43 10" "128k 43 10" "1M 42 2"; do
        read -r len seed n <<< "$L"
        local kv=()
        [ "$len" = 1M ] && kv=(--kv-cache-memory-gb 14)
        for t in niah_single_3 niah_single_2 niah_multikey_1; do
            job "ruler__${t}__${label}__${len}-s$seed" ruler --tasks "$t" --lengths "$len" --samples "$n" \
                --seed "$seed" --attention "$@" --attention-config "$cfg" ${share:+"$share"} "${kv[@]}"
        done
    done
}
suite_qwen_r16b() {  # stage 0's refresh interval (docs/design-refresh-installs.md, options 4 and 5): the default
    # (8, 4, 1) against (16, 4, 1), (32, 4, 1) and (16, 8, 1), each prompt prefilled once (P=3 KV_GB=8); run 15's
    # seeds, so the default's rows repeat its cells; 512K first (where schedules parted in run 15), 1M last
    ruler_grid infinitehip-3k-box-stage0 \
        "{\"$DEFAULT@r1641\": $R1641, \"$DEFAULT@r3241\": $R3241, \"$DEFAULT@r1681\": $R1681}" --share-prefill \
        "$DEFAULT" "$DEFAULT@r1641" "$DEFAULT@r3241" "$DEFAULT@r1681"
}
QS2='{"query_stride": [2, 2, 2]}'  # every stage scores a prefill block with every 2nd row (HiP's b_sq)
BQ128='{"block_q": 128}'  # prefill query blocks of 128 rows (each key tile gathered once per 128 rows)
suite_qwen_stride() {  # the default against query_stride 2 in every stage and against 128-row blocks (prefill
    # selection changes: no shared prefill, each prompt prefilled by each), the same tasks and seeds as qwen_r16b;
    # 512K first (where the stages prune hardest), 1M last (P=3 KV_GB=8)
    ruler_grid infinitehip-3k-box-qs2 "{\"$DEFAULT@qs2\": $QS2, \"$DEFAULT@bq128\": $BQ128}" "" \
        "$DEFAULT" "$DEFAULT@qs2" "$DEFAULT@bq128"
}
AHEAD16='{"refresh": [16, 4, 1], "ahead": true}'  # (16, 4, 1) with stage 0 one refresh late (its pages copied ahead)
suite_qwen_ahead() {  # run 17's next step: the default (8, 4, 1), (16, 4, 1) and (16, 4, 1) with `ahead`, on the
    # answers long enough to reach past decode step 16, where they part (niah_single_3's UUIDs, 29-35 tokens;
    # niah_multivalue's four 7-digit values), each prompt prefilled once (P=3 KV_GB=8); run 17's seeds; then the 1M
    # cells of niah_single_3 (2 prompts)
    local t L cfg="{\"$DEFAULT@r1641\": $R1641, \"$DEFAULT@ahead16\": $AHEAD16}"
    for L in "512k 42 10" "256k 43 10" "128k 43 10" "1M 42 2"; do
        set -- $L
        local len=$1 seed=$2 n=$3 kv=() tasks="niah_single_3 niah_multivalue"
        [ "$len" = 1M ] && kv=(--kv-cache-memory-gb 14) && tasks=niah_single_3
        for t in $tasks; do
            job "ruler__${t}__infinitehip-3k-box-ahead__${len}-s$seed" ruler --tasks "$t" --lengths "$len" \
                --samples "$n" --seed "$seed" --attention "$DEFAULT" "$DEFAULT@r1641" "$DEFAULT@ahead16" \
                --attention-config "$cfg" --share-prefill "${kv[@]}"
        done
    done
}
suite_qwen_positions() {  # issue 28's last cells, run 16 (BG=1 P=3 KV_GB=8 MBT=32768; it ran as qwen_close, a name
    # that shadowed run 8's suite above): the positions-only rungs (real since run 15), then the default (8, 4, 1)
    # where only the old schedule was measured: the essays passkey and niah_single_1 past 128K
    # one job per rung: run 16 ran both in one job, which ran out of time (the rungs decode eagerly, ~0.3 tok/s at
    # 128K); positions-st's 20 prompts finished in its log (docs/results/qwen05-ladder-h200-run16, .cut.log)
    job "passkey__paul-graham__positions-de__128k" passkey --haystack paul-graham --lengths 128k --seeds 2 \
        --attention infinitehip:positions-de
    ppl_step
    pk 256k --seeds 2
    rl niah_single_1 256k 10
    rl niah_single_1 512k 10
    pk 512k --seeds 2
    job "ruler__niah_single_1__infinitehip-3k-box__1M-s42" ruler --tasks niah_single_1 --lengths 1M --samples 2 \
        --seed 42 --attention "$DEFAULT" --kv-cache-memory-gb 14
    job "passkey__paul-graham__positions-st__128k" passkey --haystack paul-graham --lengths 128k --seeds 2 \
        --attention infinitehip:positions-st
}
suite_qwen15_final() {  # the 1.5B past the window in one lease (BG=1, P=3 KV_GB=31): 512K with 10 prompts, 1M with 5
    pk 512k --seeds 2
    rl niah_single_2 512k 10
    pk_1m 1
    rl_1m niah_single_2 1
}
suite_qwen15() {  # issue 28's 1.5B rows: passkey and niah_single_2 at 32K (dense beside), 128K, 512K, 1M
    local m
    for m in "dense dense" "infinitehip-3k-box infinitehip:3k-box"; do
        set -- $m
        job "passkey__paul-graham__${1}__32k" passkey --haystack paul-graham --lengths 32k --attention "$2"
        job "ruler__niah_single_2__${1}__32k" ruler --tasks niah_single_2 --lengths 32k --samples 20 --attention "$2"
    done
    pk 128k
    rl niah_single_2 128k 20
    pk 512k --seeds 2
    rl niah_single_2 512k 10
    pk_1m 1
    rl_1m niah_single_2 1
}
suite_gemma() {  # issue 33's ladder on Gemma 3 270M (MODEL=/tmp/m/gemma3-270m.gguf; trained to 32K, window 512):
    # dense against the default (infinitehip, its sparse attention on the 3 global layers only) inside the window,
    # then the default beyond it, passkey in the essays first (the goal's task), then RULER niah_single_1 and 2
    local m t
    for m in dense infinitehip; do
        job "passkey__paul-graham__${m}__8k-16k-32k" passkey --haystack paul-graham --lengths 8k 16k 32k \
            --attention "$m"
    done
    job "passkey__paul-graham__infinitehip__64k-128k" passkey --haystack paul-graham --lengths 64k 128k \
        --attention infinitehip
    job "passkey__paul-graham__infinitehip__256k" passkey --haystack paul-graham --lengths 256k --attention infinitehip
    job "passkey__paul-graham__infinitehip__512k" passkey --haystack paul-graham --lengths 512k --seeds 2 \
        --attention infinitehip
    for t in 1 5 9; do  # 1M: one job per depth (a deadline cuts little), 2 keys each
        job "passkey__paul-graham__infinitehip__1M-d$t" passkey --haystack paul-graham --lengths 1M --seeds 2 \
            --depths "0.$t" --attention infinitehip
    done
    for t in niah_single_1 niah_single_2; do
        for m in dense infinitehip; do
            job "ruler__${t}__${m}__8k-16k-32k" ruler --tasks "$t" --lengths 8k 16k 32k --samples 20 --attention "$m"
        done
        job "ruler__${t}__infinitehip__64k-128k" ruler --tasks "$t" --lengths 64k 128k --samples 20 \
            --attention infinitehip
    done
    job "passkey__paul-graham__dense__64k" passkey --haystack paul-graham --lengths 64k --seeds 2 --attention dense
    for t in 3 7; do
        job "passkey__paul-graham__infinitehip__1M-d$t" passkey --haystack paul-graham --lengths 1M --seeds 2 \
            --depths "0.$t" --attention infinitehip
    done
}
suite_"${SUITE:-smollm2}"
if [ -n "${LIST:-}" ]; then printf '%s\n' "${JOBS[@]}"; exit 0; fi  # LIST=1: print the suite's jobs, run nothing
if [ -n "${BG:-}" ]; then  # a run longer than one call: under setsid it outlives the call (until the machine goes back)
    # from a snapshot of the tree: the device tool copies the tree again at every later call, and a job that imported
    # a module during such a copy once found it missing (run 9; docs/quality.md)
    rm -rf /tmp/ladder-bg /tmp/ladder-src; mkdir -p /tmp/ladder-bg && cp -a . /tmp/ladder-src
    (cd /tmp/ladder-src && PYTHONPATH="/tmp/ladder-src:${PYTHONPATH:-}" BG= OUT=/tmp/ladder-bg setsid nohup \
        bash scripts/device_ladder.sh "$budget" > /tmp/ladder-bg/driver.log 2>&1 < /dev/null &)
    echo "started under setsid for $budget s: /tmp/ladder-bg/driver.log; collect with COLLECT=1"; exit 0
fi
if [ -n "${COLLECT:-}" ]; then  # wait for the background run (at most WAIT_S), then pack what exists into $OUT
    if [ ! -e /tmp/ladder-bg/driver.log ]; then  # a fresh machine: the one that ran it went back (30 s idle)
        echo "no background run on this machine (it is a fresh one: the machine of the BG=1 call went back); nothing"
        echo "to collect: start it again, and issue the collect calls in the same batch of calls as the start"
        exit 1
    fi
    for _ in $(seq "${WAIT_S:-560}"); do [ -e /tmp/ladder-bg/ladder.tgz ] && break; sleep 1; done
    mkdir -p "$out"; grep '^==' /tmp/ladder-bg/driver.log | tail -40
    [ -e /tmp/ladder-bg/ladder.tgz ] && echo "the background run is done" || echo "still running"
    rm -f /tmp/ladder/*.part.png; tar czf "$out/ladder.tgz" -C /tmp ladder
    python3 scripts/ladder_table.py /tmp/ladder | tee "$out/ladder_tables.md"; exit 0
fi

mkdir -p "$out"
ident="$(stat -c %s "$model" 2>/dev/null) $model"  # the model's size names it well enough here
if [ -e /tmp/ladder/.model ] && [ "$(cat /tmp/ladder/.model)" != "$ident" ]; then
    mv /tmp/ladder "/tmp/ladder.$(date +%s)"  # another model's reports: kept aside, never merged with these
fi
mkdir -p /tmp/ladder && echo "$ident" > /tmp/ladder/.model

start=$SECONDS
launch() {  # launch NAME KIND ARGS...
    local name=$1 kind=$2; shift 2
    local left=$((budget - (SECONDS - start)))
    local extra=()
    [ "$kind" = passkey ] && extra=(--depths 0.1 0.3 0.5 0.7 0.9 --seeds 4 --needles classic secret code)
    ( if [ "$kind" = trace ]; then  # trace LENGTHS DEPTHS PRESET CONFIG
          PRESET=$3 HAYSTACK=paul-graham NEEDLE=secret KV_GB=$KV_GB timeout "$left" python3 \
              scripts/passkey_needle_trace.py "$model" "$1" "$2" "/tmp/ladder/$name.part" ${4:+"$4"} \
              > "/tmp/ladder/$name.log" 2>&1
      else
          timeout "$left" python3 -m longreach eval "$kind" --model "$model" --kv-cache-memory-gb "$KV_GB" \
              --max-num-batched-tokens "${MBT:-8192}" \
              "${extra[@]}" "$@" --out "/tmp/ladder/$name.part" > "/tmp/ladder/$name.log" 2>&1
      fi
      rc=$?
      [ $rc = 0 ] && mv "/tmp/ladder/$name.part" "/tmp/ladder/$name.json"
      echo "== $name: exit $rc after $((SECONDS - start)) s" ) &
}
for j in "${JOBS[@]}"; do
    eval "set -- $j"
    name=$1; shift
    [ -e "/tmp/ladder/$name.json" ] && continue
    [[ "$name" =~ ${ONLY:-.} ]] || continue
    while [ "$(jobs -rp | wc -l)" -ge "$P" ]; do wait -n; done
    [ $((budget - (SECONDS - start))) -lt 150 ] && break
    echo "== $name: start at $((SECONDS - start)) s"
    launch "$name" "$@"
done
wait
rm -f /tmp/ladder/*.part.png
tar czf "$out/ladder.tgz" -C /tmp ladder  # one file: the device tool brings back a limited number of files
python3 scripts/ladder_table.py /tmp/ladder | tee "$out/ladder_tables.md"
echo "done: $(ls /tmp/ladder/*.json 2>/dev/null | wc -l) of ${#JOBS[@]} jobs"
