"""Compile every Triton kernel for Hopper (sm_90) on this machine, no GPU needed, and report registers and spills.

    python scripts/compile_check.py [NAME ...]     # NAME: only the kernels whose label contains it (e.g. psa)

Triton lowers to PTX and assembles a cubin with its bundled ptxas, so compile errors and register spills show up
before any device time is spent. Each entry: kernel, a representative set of constexprs and argument types.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import inspect  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from longreach.kernels import (  # noqa: E402
    bsa,
    cascade_insert,
    combine,
    fp8_gemv,
    fused,
    key_boxes,
    key_mass,
    kv_store,
    offload_copy,
    page_reads,
    paged_decode,
    prune_stage,
    psa_decode,
    psa_waves,
    topk,
    vertical_slash,
)


def signature_problems(fn, pointer_types: dict[str, str], constexprs: dict, floats=()) -> list[str]:
    """What a case leaves out or names wrongly: every constexpr of the kernel needs a value and every pointer (the
    kernels' capitalised arguments; a capitalised integer is named with "i32") a type; names the kernel does not
    have are errors too. A kernel that gained an argument since its case was written would otherwise compile with
    the argument as an i32 (a wrong test)."""
    names = set(fn.arg_names)
    given = set(pointer_types) | set(constexprs) | set(floats)
    problems = [f"unknown argument {n}" for n in sorted(given - names)]
    params = inspect.signature(getattr(fn, "fn", fn)).parameters  # the Python function (JIT or interpreted)
    for name, p in params.items():
        if "constexpr" in str(p.annotation):
            if name not in constexprs:
                problems.append(f"constexpr {name} has no value")
        elif name[:1].isupper() and name not in pointer_types:
            problems.append(f"pointer {name} has no type")
    return problems


def compile_one(fn, pointer_types: dict[str, str], constexprs: dict, floats=(), num_warps: int = 4):
    problems = signature_problems(fn, pointer_types, constexprs, floats)
    if problems:
        raise ValueError(f"{fn.__name__}: " + "; ".join(problems))
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = pointer_types[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    # what the JIT specialises at launch: pointers and strides divisible by 16 (rows of 16-byte-aligned tensors)
    aligned = [n for n in fn.arg_names if n in pointer_types or n.startswith("stride_")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, attrs=attrs,
                                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def _resources(ptxas: str, ptx: str) -> tuple[str, str]:
    """Registers and spill-store bytes from `ptxas -v` on the kernel's PTX."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True,
                         text=True).stderr
    os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return (regs.group(1) if regs else "?"), (spill.group(1) if spill else "?")


def cascading_cases(bf: str, f32: str, i32: str) -> list:
    """Cascading: block-sparse attention over one-token pages with keys rotated in the kernel (RoPE strategy "cache",
    code 4), prefill and split decode; the key-mass kernel for SmolLM2's (3 heads per KV head, d64) and Llama-3.1-8B's
    (4, d128) groups, prefill rows and one decode row."""
    cases = []
    for name, bq, bm, split in (("cascading bsa prefill bq64", 64, 128, False), ("cascading bsa decode", 1, 16, True)):
        cases.append((name + " rope cache", bsa._bsa_kernel,
                      dict(Q=bf, K=bf, V=bf, KH=bf, VH=bf, Slots=i32, BlockTables=i32, QbSeq=i32, QbStart=i32,
                           QbLen=i32, QbPos=i32, Blocks=i32, Counts=i32, PairGroup=i32, PairKv=i32, InvFreq=f32,
                           Out=bf, Lse=f32, OutP=f32, LseP=f32),
                      dict(HPP=4, HEADS_PER_PROG=max(1, bm // bq), N_HSUB=max(1, 4 // max(1, bm // bq)), BQ_PAD=bq,
                           BLOCK_M=bm, BLOCK_N=64, HEAD_DIM=128, BK=64, PAGE=1, SPLIT=split, ROPE=4,
                           DOT_PRECISION="tf32", TIERED=False, FP8=False, HALVES=True), ["qk_scale"]))
    for label, hpp, hpp_pad, rows, d in (("key_mass d128 g4 prefill", 4, 4, 16, 128),
                                         ("key_mass d64 g3 prefill", 3, 4, 16, 64),
                                         ("key_mass d128 g4 decode", 4, 4, 4, 128)):
        cases.append((label, key_mass._key_mass_kernel,
                      dict(Q=bf, K=bf, BlockTables=i32, SeqStart=i32, SeqLen=i32, FirstPos=i32, NumKeys=i32, Lse=f32,
                           W=f32, InvFreq=f32, Out=f32),
                      dict(HPP=hpp, HPP_PAD=hpp_pad, ROWS=rows, BLOCK_N=64, HEAD_DIM=d, PAGE=1, ROPE=True, FP8=False,
                           DOT_PRECISION="tf32"), ["qk_scale"]))
    i64 = "*i64"
    cases.append(("cascade insert", cascade_insert._insert_kernel,
                  dict(Score=f32, Mass=f32, EmaSlots=i64, EmaKey=i64, EmaDecay=f32, Plan=i64, Cur=i64, Pool=i64,
                       Src=i64), dict(FIELDS=12, BLOCK=1024), []))
    for hq, hkv, d in ((9, 3, 64), (32, 8, 128)):
        cases.append((f"cascade rope h{hq}/{hkv} d{d}", cascade_insert._rope_kernel,
                      dict(Q=bf, K=bf, KS=bf, PS=i32, Slots="*i64", Pos=i32, UC=f32, US=f32, VC=f32, VS=f32,
                           QOut=bf), dict(BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
                                           HALF=d // 2), []))
    for d in (64, 128):
        for phase in (0, 1):
            cases.append((f"cascade move d{d} phase {phase}", cascade_insert._move_kernel,
                          dict(Dst=i64, Src=i64, K=bf, V=bf, Score=f32, Pos=i32, TK=bf, TV=bf, TS=f32, TP=i32),
                          dict(PHASE=phase, BLOCK_W=32, HEAD_DIM=d), []))
    return cases


def all_cases() -> list:
    """(label, kernel, pointer types, constexprs, float arguments) of every case."""
    cases = []
    bf, f32, i32, f8 = "*bf16", "*fp32", "*i32", "*fp8e4nv"
    # each attention kernel as a one-tier cache, through the offloading page table (decode only: prefill reads a
    # staging area), and with fp8 KV (rows with scales), without and with key re-rotation (RoPE strategies)
    # TIERED 9: a slot per KV head's page, 8 KV heads (kernels/paged.py's code 1 + H_kv)
    variants = ((" ", bf, False), (" tiered", bf, True), (" fp8", f8, False), (" tiered fp8", f8, True),
                (" tiered heads", bf, 9), (" tiered heads fp8", f8, 9))
    for suffix, kv, tiered in variants:
        cases.append(("paged_decode d128 g4" + suffix, paged_decode._paged_decode_kernel,
                      dict(Q=bf, K=kv, V=kv, KH=kv, VH=kv, Slots=i32, BlockTables=i32, SeqLens=i32, OutPartial=f32,
                           LsePartial=f32),
                      dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, PAGE=16, BLOCK_N=64, DOT_PRECISION="tf32",
                           TIERED=tiered, FP8=kv == f8), ["qk_scale"]))
        for name, bq, bm, split in (("bsa prefill bq64", 64, 128, False), ("bsa decode", 1, 16, True)):
            if tiered and split is False:
                continue
            for rope in (0, 1):
                cases.append((name + suffix + (" rope st" if rope else ""), bsa._bsa_kernel,
                              dict(Q=bf, K=kv, V=kv, KH=kv, VH=kv, Slots=i32, BlockTables=i32, QbSeq=i32, QbStart=i32,
                                   QbLen=i32, QbPos=i32, Blocks=i32, Counts=i32, PairGroup=i32, PairKv=i32,
                                   InvFreq=f32, Out=bf, Lse=f32, OutP=f32, LseP=f32),
                              dict(HPP=4, HEADS_PER_PROG=max(1, bm // bq), N_HSUB=max(1, 4 // max(1, bm // bq)),
                                   BQ_PAD=bq, BLOCK_M=bm, BLOCK_N=64, HEAD_DIM=128, BK=8, PAGE=16, SPLIT=split,
                                   ROPE=rope, DOT_PRECISION="tf32", TIERED=tiered, FP8=kv == f8, HALVES=rope != 0),
                              ["qk_scale"]))
    # minference: key ranges + gathered columns, per head (64 rows) and per KV group (2 heads x 64 rows)
    for suffix, kv, tiered in variants:
        for label, hpp, bm in (("minference range per-head bq64", 1, 64), ("minference range kv-group bq64", 4, 128)):
            cases.append((label + suffix, vertical_slash._range_attention_kernel,
                          dict(Q=bf, K=kv, V=kv, KH=kv, VH=kv, Slots=i32, BlockTables=i32, QbSeq=i32, QbStart=i32,
                               QbLen=i32, QbPos=i32, Tiles=i32, TileCounts=i32, Cols=i32, ColCounts=i32,
                               PairGroup=i32, PairKv=i32, Out=bf, Lse=f32),
                          dict(HPP=hpp, HEADS_PER_PROG=bm // 64, N_HSUB=max(1, hpp // (bm // 64)), BQ_PAD=64,
                               BLOCK_M=bm, BLOCK_N=64, HEAD_DIM=128, PAGE=16, DOT_PRECISION="tf32", TIERED=tiered,
                               FP8=kv == f8), ["qk_scale"]))
    cases += cascading_cases(bf, f32, i32)
    cases.append(("combine", combine._combine_kernel, dict(OutP=f32, LseP=f32, Out=bf, Lse=f32),
                  dict(S_PAD=32, HEAD_DIM=128), []))
    for label, chunk, exact, per_head, bq_pad, hpp_pad, block_c, tiles in (
            ("prune stage1 selectrep/head bq64", 256, False, True, 64, 4, 32, 1),
            ("prune stage1 selectrep/kv bq64", 256, False, False, 64, 4, 32, 4),
            ("prune stage3 exact bq64", 8, True, False, 64, 4, 16, 4),
            ("prune stage2 exact bq64 runs of 8", 32, True, False, 64, 4, 4, 4),
            ("prune decode selectrep/kv", 256, False, False, 4, 4, 64, 1),
            ("prune decode exact", 8, True, False, 4, 4, 16, 1)):
        for suffix, kv, tiered in variants:
            if tiered and "decode" not in label:
                continue
            for rope in (0, 2):
                cases.append((label + suffix + (" rope ci" if rope else ""), prune_stage._chunk_score_kernel,
                              dict(Q=bf, K=kv, KH=kv, Slots=i32, BlockTable=i32, QbStart=i32, QbLen=i32, CandEnd=i32,
                                   Ids=i32, Scores=f32, InvFreq=f32, NChunk=i32),
                              dict(HPP=4, PAIRS_PER_GROUP=1, PAIR_KV_DIV=1, CHUNK=chunk, EXACT=exact,
                                   PER_HEAD=per_head, N_ITER=max(0, (chunk - 1).bit_length()), BQ_PAD=bq_pad,
                                   HPP_PAD=hpp_pad, BLOCK_C=block_c, TILES=tiles, TILE_FIRST=False, HEAD_DIM=128,
                                   PAGE=16, ROPE=rope, DOT_PRECISION="tf32", TIERED=tiered, FP8=kv == f8,
                                   HALVES=exact and rope != 0, SUB=8 if "runs of 8" in label else chunk,
                                   STRIDE=1), []))
    # exact scoring's long-prefill layout (one-tier staging only: decode keeps the first layout): 256-row tiles of
    # stage 1 (32-token chunks, 4 a tile) and stage 2 (8-token chunks, 16 a tile), as stored and moved (rt, ci), one
    # row tile per block and several (atomic max); stage 1 also with a score per 8-key run (stage 2's, reused)
    for label, chunk, block_c, block_m, sub in (("prune rows stage1 exact", 32, 4, 256, 32),
                                                ("prune rows stage1 exact runs of 8", 32, 4, 256, 8),
                                                ("prune rows stage1 exact runs of 8 m128 atomic", 32, 4, 128, 8),
                                                ("prune rows stage2 exact", 8, 16, 256, 8),
                                                ("prune rows stage2 exact m128 atomic", 8, 16, 128, 8),
                                                # query stride 2: 32 of a 64-row block's rows, 4 heads: 128 rows
                                                ("prune rows stage1 exact stride 2", 32, 4, 128, 32)):
        for suffix, kv in ((" ", bf), (" fp8", f8)):
            for rope in (0, 1, 2):
                cases.append((label + suffix + f" rope {rope}", prune_stage._exact_rows_kernel,
                              dict(Q=bf, K=kv, KH=kv, Slots=i32, BlockTable=i32, QbStart=i32, QbLen=i32, CandEnd=i32,
                                   Ids=i32, Scores=f32, InvFreq=f32, NChunk=i32),
                              dict(ROPE=rope, HPP=4, PAIRS_PER_GROUP=1, PAIR_KV_DIV=1, CHUNK=chunk,
                                   BQ_PAD=32 if "stride" in label else 64, BLOCK_M=block_m, BLOCK_C=block_c,
                                   HEAD_DIM=128, PAGE=16, DOT_PRECISION="tf32", TIERED=False, FP8=kv == f8,
                                   ATOMIC=block_m < 256 and "stride" not in label, HALVES=rope != 0, SUB=sub,
                                   STRIDE=2 if "stride" in label else 1),
                              []))
    cases.append(("topk single tile", topk._topk_kernel,
                  dict(Ids=i32, Scores=f32, Out=i32, Counts=i32, C="i32", K="i32"), dict(BLOCK=4096, SINGLE=True), []))
    cases.append(("topk tiled", topk._topk_kernel, dict(Ids=i32, Scores=f32, Out=i32, Counts=i32, C="i32", K="i32"),
                  dict(BLOCK=4096, SINGLE=False), []))
    for kv in (bf, f8):
        cases.append((f"offload copy_chunks {kv}", offload_copy._copy_chunks_kernel,
                      dict(Src=kv, SrcIdx="*i64", Dst=kv, DstIdx="*i64", E="i32"), dict(BLOCK=4096), []))
        cases.append((f"offload copy_chunks looping {kv}", offload_copy._copy_chunks_loop_kernel,
                      dict(Src=kv, SrcIdx="*i64", Dst=kv, DstIdx="*i64", n="i32", E="i32"),
                      dict(ROWS=4, BLOCK=4096), []))
        cases.append((f"offload scatter_rows {kv}", offload_copy._scatter_rows_kernel,
                      dict(Src=kv, Rows="*i64", Dst=kv, R="i32"), dict(BLOCK=1024), []))
    # the model's fused per-layer kernels and the fused KV write (kernels/fused.py, kernels/kv_store.py)
    cases.append(("fused add_rms_norm h4096", fused._add_rms_norm_kernel,
                  dict(X=bf, R=bf, W=bf, Out=bf, ResOut=bf, N="i32"), dict(HAS_RES=True, BLOCK=4096), ["eps"]))
    cases.append(("fused rope d128", fused._rope_kernel, dict(X=bf, Cos=bf, Sin=bf), dict(HALF=64, BLOCK=64), []))
    cases.append(("fused silu_mul", fused._silu_mul_kernel, dict(GU=bf, Out=bf, N="i32"), dict(BLOCK=1024), []))
    for kv, row, fp8 in ((bf, 128, False), (f8, 144, True)):
        for tiered in (False, True, 9):
            cases.append((f"kv_store {kv}{' tiered' if tiered else ''}{' heads' if tiered == 9 else ''}",
                          kv_store._store_kv_kernel,
                          dict(K=bf, V=bf, Slots="*i64", KD=kv, VD=kv, KH=kv, VH=kv, SlotOf=i32),
                          dict(BS=16, H=8, ROW=row, D=128, BLOCK_D=128, FP8=fp8, TIERED=tiered), []))
    for label, units in (("page_reads mark", 1), ("page_reads mark heads", 8)):
        cases.append((label, page_reads._mark_reads_kernel,
                      dict(Wanted="*u8", Tables=i32, Seq="*i64", First="*i64", Last="*i64", Blocks=i32, P="i32",
                           W="i32", G="i32", K="i32"),
                      dict(BS=16, PER=1, SINK_PAGES=4, SPAN=65, BLOCK_SEL=256, BLOCK_FIXED=128, U=units, HPG=1,
                           GPH=1), []))
    # the weight-only fp8 GEMV of decode rows (kernels/fp8_gemv.py): bf16 activations, one split and split-K, and fp32
    for label, x, bk, split in (("bf16", bf, 256, False), ("bf16 split", bf, 256, True), ("fp32", f32, 128, False)):
        cases.append((f"fp8_gemv {label}", fp8_gemv._fp8_gemv_kernel,
                      dict(X=x, W=f8, S=f32, Bias=x, Y=x, P=f32, M="i32", N="i32", K="i32"),
                      dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, SPLIT=split, HAS_BIAS=True,
                           DOT_PRECISION="ieee" if x == f32 else "tf32"), []))
    # its fma strategy as `launch_config` sizes it for Llama-8B's projections (K a multiple of BLOCK_K): one row at
    # BLOCK_N 8 and 16, split-K, 4 and 16 rows (smaller tiles), fp32 activations, a K that needs masks
    for label, x, rows, bn, bk, even, split in (("bf16 m1 n8", bf, 1, 8, 1024, True, False),
                                                ("bf16 m1 n16", bf, 1, 16, 1024, True, False),
                                                ("bf16 m1 n4 split", bf, 1, 4, 1024, True, True),
                                                ("bf16 m4", bf, 4, 8, 512, True, False),
                                                ("bf16 m16", bf, 16, 4, 256, True, False),
                                                ("fp32 m1", f32, 1, 8, 1024, True, False),
                                                ("bf16 m1 k-mask", bf, 1, 8, 1024, False, False)):
        cases.append((f"fp8_gemv fma {label}", fp8_gemv._fp8_gemv_fma_kernel,
                      dict(X=x, W=f8, S=f32, Bias=x, Y=x, P=f32, M="i32", N="i32", K="i32"),
                      dict(ROWS=rows, BLOCK_N=bn, BLOCK_K=bk, VEC=4 if x == f32 else 8, STAGES=3, EVEN_K=even,
                           SPLIT=split, HAS_BIAS=True), []))
    cases.append(("fp8_gemv reduce", fp8_gemv._fp8_gemv_reduce_kernel, dict(P=f32, Bias=bf, Y=bf, N="i32"),
                  dict(BLOCK=1024, HAS_BIAS=True), []))
    # key boxes (kernels/key_boxes.py): the build kernel per 64-token chunk with both flavours (infinitehip's box
    # stage 0: as stored, and moved to the pruning position) and per 16-token KV page with one (PSA's metadata, keys
    # moved to position 0 with `rope: rank`; Quest's page bounds); the score kernel through a box table (fp32 queries
    # per block, two flavours) and through the block tables (PSA: one bf16 decode row per block; Quest: bf16 rows)
    for suffix, kv, tiered in variants:
        for label, unit, per, mean, flavours, move in (("chunk64 flavours2", 64, 16, False, 2, True),
                                                       ("page16", 16, 1, True, 1, False),
                                                       ("page16 moved", 16, 1, True, 1, True)):
            cases.append((f"key_boxes build d128 {label}" + suffix, key_boxes._box_build_kernel,
                          dict(K=kv, KH=kv, Slots=i32, BlockTables=i32, Lens=i32, Lo=i32, Hi=i32, BoxTables=i32,
                               Pool=bf, InvFreq=f32),
                          dict(UNIT=unit, PAGE=16, PER=per, HEAD_DIM=128, MEAN=mean, FLAVOURS=flavours, MOVE=move,
                               TIERED=tiered, FP8=kv == f8), []))
    for label, q, per, block_m, moved, precision in (("chunks fp32 q moved", f32, 16, 64, True, "tf32"),
                                                     ("pages bf16 decode", bf, 1, 16, False, "tf32"),
                                                     ("pages bf16 q", bf, 1, 64, False, "tf32")):
        cases.append((f"key_boxes score d128 g4 {label}", key_boxes._box_score_kernel,
                      dict(Q=q, Moved=i32, Pool=bf, Table=i32, CandHi=i32, Out=f32),
                      dict(HPP=4, PAIRS_PER_KV=1, PER=per, BLOCK_M=block_m, BLOCK_C=64, HEAD_DIM=128, MOVED=moved,
                           DOT_PRECISION=precision), []))
    # the box score kernel's long-prefill layout: 256-row tiles of fp32 queries (two flavours) rounded to the bf16
    # store's dtype, one tile per block and two (atomic max)
    for block_m, atomic in ((256, False), (128, True)):
        cases.append((f"key_boxes score rows d128 g4 m{block_m}", key_boxes._box_score_rows_kernel,
                      dict(Q=f32, Moved=i32, Pool=bf, Table=i32, CandHi=i32, Out=f32),
                      dict(HPP=4, PAIRS_PER_KV=1, PER=16, BLOCK_M=block_m, BLOCK_C=64, HEAD_DIM=128, MOVED=True,
                           DOT_PRECISION="tf32", ATOMIC=atomic, LOWP=True), []))
    # psa: the progressive decode loop and the parallel waves (Llama-8B's GQA 4, pages of 16 and 32), each as stored
    # and with `rope: rank`'s key rotation (ROPE); its metadata build and block scoring are the key-box cases above
    for suffix, kv, tiered in variants:
        for page, mb in ((16, 4), (32, 4)):
            for rope in (False, True):
                label = f"psa decode d128 g4 page{page} m{mb}" + suffix + (" rank" if rope else "")
                cases.append((label, psa_decode._psa_decode_kernel,
                              dict(Q=bf, K=kv, V=kv, KH=kv, VH=kv, Slots=i32, BlockTables=i32, SeqLens=i32, Ranked=i32,
                                   CandHi=i32, InvFreq=f32, Out=bf, Lse=f32, Count=i32),
                              dict(HPG=4, BLOCK_M=16, MB=mb, PAGE=page, BLOCK_N=64, HEAD_DIM=128, DOT_PRECISION="tf32",
                                   TIERED=tiered, FP8=kv == f8, ROPE=rope), ["qk_scale", "log2_odds"]))
        for rope in (False, True):
            cases.append(("psa waves d128 g4 page16 m4" + suffix + (" rank" if rope else ""),
                          psa_waves._psa_wave_kernel,
                          dict(Q=bf, K=kv, V=kv, KH=kv, VH=kv, Slots=i32, BlockTables=i32, SeqLens=i32, Ranked=i32,
                               CandHi=i32, InvFreq=f32, Part=f32, PartAcc=f32, State=f32, StateAcc=f32, Flags=i32),
                          dict(HPG=4, BLOCK_M=16, BLOCK_H=4, MB=4, PAGE=16, BLOCK_N=64, HEAD_DIM=128,
                               DOT_PRECISION="tf32", TIERED=tiered, FP8=kv == f8, FIRST=True, ROPE=rope),
                          ["qk_scale"]))
    for first, last in ((True, False), (False, True)):
        cases.append((f"psa waves merge d128 g4{' first' if first else ''}{' last' if last else ''}",
                      psa_waves._psa_wave_merge_kernel,
                      dict(CandHi=i32, Part=f32, PartAcc=f32, State=f32, StateAcc=f32, Flags=i32, Out=bf, Lse=f32,
                           Count=i32),
                      dict(HPG=4, BLOCK_H=4, MB=4, HEAD_DIM=128, COLS=32, CHUNK=32, FIRST=first, LAST=last),
                      ["log2_odds"]))
    return cases


def main() -> int:
    only = sys.argv[1:]
    cases = [c for c in all_cases() if not only or any(o in c[0] for o in only)]
    failed = 0
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    print(f"{'kernel':<36} {'regs':>5} {'spill B':>8} {'shared':>8}")
    for label, fn, ptrs, consts, floats in cases:
        try:
            rows = consts.get("BLOCK_M", consts.get("HPP_PAD", 1) * consts.get("BQ_PAD", 1))
            warps = 8 if rows >= 128 or consts.get("BLOCK", 0) > 1024 else 4
            k = compile_one(fn, ptrs, dict(consts), floats, num_warps=warps)
            regs, spills = _resources(ptxas, k.asm["ptx"])
            print(f"{label:<36} {regs:>5} {spills:>8} {k.metadata.shared:>8}")
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"{label:<36} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
