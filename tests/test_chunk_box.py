"""Stage 0 from boxes around each chunk's keys (kernels/chunk_box.py, `stage0_scores` in attention/infinitehip.py)."""
import pytest
import torch

from longreach.kernels.chunk_box import ChunkBoxIndex, chunk_box_scores, chunk_boxes
from longreach.kernels.prune_stage import chunk_scores_reference
from longreach.models.config import RopeConfig
from longreach.rope.scaling import rope_inv_freq
from longreach.rope.strategies import RopeArgs


def _case(seed, L=400, Hq=4, Hkv=2, D=16, chunk=16, n_sink=8, n_window=32):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(L, Hkv, D, generator=g)
    rows = [(0, 8), (8, 1), (9, 5)]  # (first row, rows) of three blocks
    ends = torch.tensor([200, 301, L])  # each block's end; its candidates end n_window before
    qs = torch.randn(3, 8, Hq, D, generator=g)
    ok = torch.arange(8)[None, :] < torch.tensor([r for _, r in rows])[:, None]
    cand_end = ends - n_window
    C = -(-L // chunk)
    ids = torch.arange(C).expand(3, Hkv, C).clone()
    ids[ids * chunk >= cand_end[:, None, None]] = -1
    return qs, ok, keys, ids, cand_end, dict(chunk=chunk, n_sink=n_sink)


@pytest.mark.parametrize("mode", [None, "rt", "ci", "de"])
def test_minmax_box_bounds_the_exact_scores(mode):
    """The minmax box's score is an upper bound of the chunk's best key at the positions the strategy gives it (ci:
    the box scorer uses rt, so it bounds rt's exact scores); some blocks remapped, some not."""
    qs, ok, keys, ids, cand_end, kw = _case(0)
    inv = rope_inv_freq(RopeConfig(theta=10000.0), 16)[0]
    rope = None if mode is None else RopeArgs(mode, inv, rope_from=250, group=3, n_window=32)
    box = chunk_box_scores(qs, ok, keys, ids, kw["chunk"], kw["n_sink"], cand_end, 2, "minmax", rope)
    ref_rope = None if mode is None else RopeArgs("rt" if mode == "ci" else mode, inv, 250, 3, 32)
    exact = chunk_scores_reference(qs, ok, keys, ids, kw["chunk"], True, kw["n_sink"], cand_end, 2, rope=ref_rope)
    valid = torch.isfinite(exact)
    assert torch.equal(valid, torch.isfinite(box)) and int(valid.sum()) > 20
    assert bool((box[valid] >= exact[valid] - 1e-4).all())
    assert bool((box[valid] > exact[valid] + 1e-3).any())  # a bound, not the exact score


def test_one_key_chunks_score_exactly():
    qs, ok, keys, _, cand_end, kw = _case(1)
    ids = torch.arange(400).expand(3, 2, 400).clone()
    ids[ids >= cand_end[:, None, None]] = -1
    inv = rope_inv_freq(RopeConfig(theta=10000.0), 16)[0]
    rope = RopeArgs("rt", inv, rope_from=250, n_window=32)
    for kind in ("minmax", "cuboid-mean"):
        box = chunk_box_scores(qs, ok, keys, ids, 1, 8, cand_end, 2, kind, rope)
        exact = chunk_scores_reference(qs, ok, keys, ids, 1, True, 8, cand_end, 2, rope=rope)
        assert torch.allclose(box, exact, atol=1e-4)


def test_slicing_and_a_kept_index_change_nothing():
    qs, ok, keys, ids, cand_end, kw = _case(2)
    inv = rope_inv_freq(RopeConfig(theta=10000.0), 16)[0]
    rope = RopeArgs("rt", inv, rope_from=250, n_window=32)
    whole = chunk_box_scores(qs, ok, keys, ids, 16, 8, cand_end, 2, "cuboid-mean", rope)
    index = ChunkBoxIndex(16, "cuboid-mean")
    for _ in range(2):
        sliced = chunk_box_scores(qs, ok, keys, ids, 16, 8, cand_end, 2, "cuboid-mean", rope, index=index,
                                  max_bytes=1)
        assert torch.equal(whole, sliced)


@pytest.mark.parametrize("kind", ["minmax", "cuboid-mean"])
def test_a_growing_index_reads_only_new_keys_and_equals_boxes_built_afresh(kind):
    """Decode keeps the index across steps: as the sequence grows (across chunk boundaries, a partial last chunk in
    between), each call reads only keys not yet in a complete box, and the boxes equal those built from all keys,
    at true positions and moved (rt); a shorter sequence starts the index over."""
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(300, 2, 16, generator=g)
    inv = rope_inv_freq(RopeConfig(theta=10000.0), 16)[0]
    rope = RopeArgs("rt", inv, rope_from=100, group=3, n_window=32)
    index = ChunkBoxIndex(16, kind)
    reads = []

    def read(a, b):
        reads.append((a, b))
        return keys[a:b]

    prev = 0
    for L in (40, 41, 47, 48, 49, 100, 300):
        for mode in (None, "rt"):
            reads.clear()
            got = index.boxes(read, L, mode, rope)
            want = ChunkBoxIndex(16, kind).boxes(lambda a, b: keys[a:b], L, mode, rope)
            assert torch.equal(got, want) and got.shape[0] == -(-L // 16)
            assert min(a for a, _ in reads) == (prev // 16) * 16  # only keys not in a complete box yet
            assert max(b for _, b in reads) == L
        prev = L
    plain = chunk_boxes(keys[:300].float(), 16, kind)
    assert torch.allclose(index.boxes(read, 300), plain)
    reads.clear()
    index.boxes(read, 64)  # shorter: rebuilt from the start
    assert reads[0][0] == 0 and torch.allclose(index.boxes(read, 64), plain[:4])


def test_infinitehip_with_a_box_stage0(tmp_path):
    """Through the engine past the trained length: a box stage 0 keeps different chunks than SelectRep, still
    selects within budget, decodes eagerly (not graph-capturable), and a bad value is a clear error."""
    from conftest import make_tiny_hf_model

    from longreach.engine.llm import LLM
    from longreach.sampling_params import SamplingParams

    path = make_tiny_hf_model(tmp_path / "m", max_position_embeddings=256)[0]
    ids = torch.randint(3, 256, (900,), generator=torch.Generator().manual_seed(1)).tolist()
    kw = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.02, max_num_batched_tokens=256, max_model_len=1024)
    cfg = '{"n_sink": 8, "n_window": 32, "chunk_sizes": [64, 16], "budgets": [256, 64], "refresh": [2, 1], ' \
          '"early_last_budget": null, "dense_below": 0, "stage0_scores": "%s"}'
    logits = {}
    for kind in ("selectrep", "minmax"):
        llm = LLM(path, attention="infinitehip", attention_config=cfg % kind, **kw)
        logits[kind] = llm.engine.prompt_logits(ids)
        assert torch.isfinite(logits[kind]).all()
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert len(out[0].token_ids) == 4
        if kind == "minmax":
            assert "not graph-capturable" in (llm.engine.backend.graph_unsupported() or "")
    assert (logits["selectrep"][600:] - logits["minmax"][600:]).abs().max() > 1e-4
    # the boxes are kept per sequence and layer across prefill chunks (256 tokens here) and decode steps: the same
    # logits and tokens as boxes rebuilt from every key at each call, reading far fewer keys
    from longreach.kernels import chunk_box

    reads = {}
    real = chunk_box.ChunkBoxIndex.boxes
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for fresh in (False, True):
        count = reads.setdefault(fresh, [0])

        def boxes(self, read, length, mode=None, rope=None, fresh=fresh, count=count):
            if fresh:
                self._full.clear()

            def counted(a, b):
                count[0] += b - a
                return read(a, b)
            return real(self, counted, length, mode, rope)
        chunk_box.ChunkBoxIndex.boxes = boxes
        try:
            llm = LLM(path, attention="infinitehip", attention_config=cfg % "minmax", **kw)
            reads[fresh].append(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].token_ids)
            reads[fresh].append(llm.engine.prompt_logits(ids))
        finally:
            chunk_box.ChunkBoxIndex.boxes = real
    assert reads[False][1] == reads[True][1] and torch.equal(reads[False][2], reads[True][2])
    assert reads[False][0] < reads[True][0] / 2
    with pytest.raises(ValueError, match="stage0_scores must be one of selectrep, minmax, cuboid-mean"):
        LLM(path, attention="infinitehip", attention_config='{"stage0_scores": "bound"}', **kw)
