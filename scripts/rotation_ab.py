"""Time exact chunk scoring and block-sparse attention with RoPE-moved keys at the 1M prefill and decode shapes, for
whichever longreach tree is first on the path: run it once per tree in one device call to compare two trees.

    python scripts/rotation_ab.py OUT_DIR TAG                 # this tree
    git archive OLD longreach | tar -x -C /tmp/old            # another tree (here, then carried to the device)
    AB_ROOT=/tmp/old python scripts/rotation_ab.py OUT_DIR old
    python scripts/rotation_ab.py --compare OUT_DIR old new   # the table, and whether the outputs are equal

The shape is the 8B one at a 891,289-token prefix (kernels/prune_stage.py's and bsa.py's 1M profile): 32 query and
8 KV heads of 128, fp8 KV rows with their scales in 16-token pages, 64-row query blocks of a 65,536-token prefill
step, or one decode row; exact scoring of 1,024 candidate chunks of 32 and of 8 tokens per block and KV head with
rt and ci pruning positions; attention over 256 selected 8-token blocks with st positions. Writes OUT_DIR/TAG.json
(median ms of CUDA-event timings) and OUT_DIR/TAG.pt (the outputs, for --compare).
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, os.environ.get("AB_ROOT") or str(ROOT))

import torch  # noqa: E402

HQ, HKV, D, PAGE, PREFIX, STEP = 32, 8, 128, 16, 891289, 65536


def measure(out: pathlib.Path, tag: str) -> None:
    from gpu.common import median_us, random_fp8_key_pages
    from longreach.attention.index import QueryBlocks, SparseIndex
    from longreach.kernels.bsa import block_sparse_attention_triton
    from longreach.kernels.prune_stage import chunk_scores_triton
    from longreach.models.config import RopeConfig
    from longreach.rope.scaling import rope_inv_freq
    from longreach.rope.strategies import RopeArgs

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    kc, table = random_fp8_key_pages(dev, g, PREFIX + STEP, PAGE, HKV, D)
    inv = rope_inv_freq(RopeConfig(theta=500000.0), D)[0].to(dev)
    ms, outs = {}, {}

    def time(key, fn, reps):
        outs[key] = fn().float().cpu()
        ms[key] = median_us(fn, reps) / 1e3
        print(f"{tag} {key:28} {ms[key]:9.3f} ms", flush=True)

    for mode in ("rt", "ci"):
        rope = RopeArgs(mode, inv, rope_from=131072, n_window=1024)
        for kind, bq, n in (("prefill", 64, STEP), ("decode", 1, 1)):
            nb = n // bq
            q = torch.randn(n, HQ, D, device=dev, generator=g).bfloat16()
            starts = torch.arange(nb, device=dev, dtype=torch.int32) * bq
            lens = torch.full((nb,), bq, dtype=torch.int32, device=dev)
            cand_end = (PREFIX + starts + bq - 1024).int()
            for chunk in (32, 8):
                hi = (cand_end // chunk).long()
                ids = (torch.rand(nb, HKV, 1024, device=dev, generator=g) * hi[:, None, None]).long()
                ids = ids.sort(-1).values.int()
                time(f"{mode} {kind} chunk {chunk}",
                     lambda: chunk_scores_triton(q, kc, table, starts, lens, cand_end, ids, chunk, True, 256, HKV,
                                                 max_rows=bq, rope=rope), 10 if kind == "prefill" else 50)
    rope = RopeArgs("st", inv, rope_from=131072, n_window=1024)
    big = torch.iinfo(torch.long).max
    for kind, bq, n, splits in (("prefill", 64, STEP, 1), ("decode", 1, 1, 16)):
        q = torch.randn(n, HQ, D, device=dev, generator=g).bfloat16()
        qb = QueryBlocks.build([n], [PREFIX], bq)
        blocks = (torch.rand(qb.num_blocks, HKV, 256, device=dev, generator=g) * (PREFIX // 8 - 200)).long()
        blocks = blocks.sort(-1).values
        blocks[..., 1:] = torch.where(blocks[..., 1:] == blocks[..., :-1], big, blocks[..., 1:])  # repeats: dropped
        blocks = blocks.sort(-1).values
        blocks = torch.where(blocks == big, -1, blocks).int()
        idx = SparseIndex(bq, 8, 256, 1024, HKV, qb, blocks, (blocks >= 0).sum(-1, dtype=torch.int32))
        time(f"st bsa {kind}", lambda: block_sparse_attention_triton(q, kc, kc, table[None], idx, D ** -0.5,
                                                                     num_splits=splits, rope=rope)[0],
             10 if kind == "prefill" else 50)
    torch.save(outs, out / f"{tag}.pt")
    (out / f"{tag}.json").write_text(json.dumps({"tag": tag, "device": torch.cuda.get_device_name(),
                                                 "root": os.environ.get("AB_ROOT") or str(ROOT), "ms": ms}, indent=1))


def compare(out: pathlib.Path, a: str, b: str) -> None:
    ms_a, ms_b = (json.loads((out / f"{t}.json").read_text())["ms"] for t in (a, b))
    out_a, out_b = (torch.load(out / f"{t}.pt") for t in (a, b))
    print(f"{'case':28} {a + ' ms':>10} {b + ' ms':>10} {'x':>6}  outputs")
    for key in ms_a:
        same = torch.equal(out_a[key], out_b[key])
        print(f"{key:28} {ms_a[key]:10.3f} {ms_b[key]:10.3f} {ms_a[key] / ms_b[key]:6.2f}  "
              f"{'equal' if same else 'differ'}")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        measure(pathlib.Path(sys.argv[1]), sys.argv[2])
