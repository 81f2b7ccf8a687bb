"""MInference: the online index building against brute force, the range executor, the Triton kernel in the
interpreter, the engine (chunked prefill, prefill/decode composition) and the calibration search on planted heads."""
import json
import math

import pytest
import torch

from longreach.attention.dense import causal_attention
from longreach.attention.executor import range_attention
from longreach.attention.index import QueryBlocks, RangeIndex
from longreach.attention.minference import MInference, MInferenceConfig
from longreach.kvcache.paged import gather_tokens

Hq, Hkv, D = 6, 2, 16


def _paged(L, page=4, seed=0, dtype=torch.float32, Hkv=Hkv, D=D):
    g = torch.Generator().manual_seed(seed)
    n_pages = -(-L // page) + 3
    kc = torch.randn(n_pages, page, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(n_pages, page, Hkv, D, generator=g).to(dtype)
    table = torch.randperm(n_pages, generator=g)[: -(-L // page)].int()
    return kc, vc, table


def _brute_keys(pattern, q, keys, pos0, length, row_pos, est, B, scale, head_group):
    """The keys a row reads under `pattern`, computed the slow, obvious way (one row, one group)."""
    kind = pattern[0]
    heads = head_group
    if kind == "a_shape":
        end = pos0 + length
        return {j for j in range(row_pos + 1) if j < pattern[1] or j >= end - pattern[2]}
    if kind == "vertical_slash":
        rows, first = est  # estimation rows (n, H_q, D) at positions first..
        n = rows.shape[0]
        L = first + n
        vert, slash = torch.zeros(L), torch.zeros(L)
        for h in heads:
            for r in range(n):
                p = first + r
                s = keys[: p + 1, h // (Hq // Hkv)] @ rows[r, h] * scale
                a = torch.softmax(s, 0)
                vert[: p + 1] += a
                for j in range(p + 1):
                    slash[p - j] += a[j]
        slash[0] = float("inf")
        V = set(torch.sort(vert, descending=True, stable=True).indices[: pattern[1]].tolist())
        S = set(torch.sort(slash, descending=True, stable=True).indices[: pattern[2]].tolist())
        out = {j for j in V if j <= row_pos}
        for o in S:
            out |= {j for j in range(max(0, pos0 - o), pos0 + length - o) if j <= row_pos}
        return out
    # block_sparse
    end = pos0 + length
    diag = (end - 1) // B
    qm = q.mean(0)  # (H_q, D) the block's mean query
    score = torch.zeros(diag + 1)
    for h in heads:
        km = torch.stack([keys[j * B: min((j + 1) * B, keys.shape[0]), h // (Hq // Hkv)].mean(0)
                          for j in range(diag + 1)])
        score += torch.softmax(km @ qm[h] * scale, 0)
    score[0] = score[diag] = float("inf")
    blocks = set(torch.sort(score, descending=True, stable=True).indices[: pattern[1]].tolist())
    return {j for j in range(row_pos + 1) if j // B in blocks}


@pytest.mark.parametrize("granularity", ["head", "kv_head"])
@pytest.mark.parametrize("pattern", [("vertical_slash", 5, 9), ("block_sparse", 4), ("a_shape", 5, 40)])
def test_index_building_matches_brute_force(pattern, granularity):
    """A chunk of 70 queries (not block-aligned) after 83 cached keys: every row's keys equal the brute-force set
    (every column, diagonal and block counted), ascending, causal, none twice, tiles of at most B keys."""
    B, ctx, n = 16, 83, 70
    L = ctx + n
    g = torch.Generator().manual_seed(len(pattern[0]) + len(granularity))
    q = torch.randn(n, Hq, D, generator=g)
    keys = torch.randn(L, Hkv, D, generator=g)
    m = MInference(MInferenceConfig(pattern=pattern, block=B, last_q=24, granularity=granularity), Hq, Hkv)
    qb = QueryBlocks.build([n], [ctx], B)
    assert qb.pos[0] == ctx and qb.length[0] == 16 * 6 - ctx  # the first block is partial
    blocks = list(zip(qb.start, qb.length, qb.pos))
    tiles, cols = m.build(0, q, blocks, keys, L, D ** -0.5)
    idx = m.index(qb, [tiles], [cols])
    per = Hq // m.groups
    est = (q[-24:], L - 24)
    for b in range(qb.num_blocks):
        qrows = q[qb.start[b]: qb.start[b] + qb.length[b]]
        for grp in range(m.groups):
            t = idx.tiles[b, grp, : int(idx.tile_counts[b, grp])]
            assert ((t[:, 1] - t[:, 0] <= B) & (t[:, 1] > t[:, 0])).all()
            assert (t[1:, 0] >= t[:-1, 1]).all()  # ascending, disjoint
            c = idx.columns[b, grp, : int(idx.col_counts[b, grp])]
            assert (c[1:] > c[:-1]).all()
            for s, e in t.tolist():  # no column inside a tile
                assert not ((c >= s) & (c < e)).any()
            for p in (qb.pos[b], qb.pos[b] + qb.length[b] - 1):
                got = idx.attended_positions(b, grp, p).tolist()
                assert len(got) == len(set(got)) and max(got) <= p
                want = _brute_keys(pattern, qrows, keys, qb.pos[b], qb.length[b], p, est, B, D ** -0.5,
                                   range(grp * per, (grp + 1) * per))
                assert set(got) == want, (b, grp, p)


def test_range_executor_full_selection_equals_dense():
    """Tiles covering [0, end) (all or part as columns) give dense causal attention, chunk after a cached prefix."""
    ctx, n, B = 37, 29, 8
    L = ctx + n
    kc, vc, table = _paged(L)
    q = torch.randn(n, Hq, D, generator=torch.Generator().manual_seed(1))
    ref = causal_attention(q, gather_tokens(kc, table, L), gather_tokens(vc, table, L), D ** -0.5)
    qb = QueryBlocks.build([n], [ctx], B)
    import longreach.attention.minference.index as mi

    for G in (1, Hkv, Hq):
        pos0, lens = torch.tensor(qb.pos), torch.tensor(qb.length)
        full = torch.stack([torch.zeros_like(pos0), pos0 + lens], -1)[:, None, None].expand(-1, G, 1, 2)
        tiles = mi.ranges_to_tiles(full.contiguous(), B).int()
        cols = torch.full((qb.num_blocks, G, 0), -1, dtype=torch.int32)
        idx = RangeIndex(B, B, G, qb, tiles, (tiles[..., 0] >= 0).sum(-1).int(), cols,
                         torch.zeros(qb.num_blocks, G, dtype=torch.int32))
        out, lse = range_attention(q, kc, vc, table[None], idx, D ** -0.5, max_bytes=1 << 14)
        assert (out - ref).abs().max() < 1e-5 and torch.isfinite(lse).all()
        fused, _ = range_attention(q, kc, vc, table[None], idx, D ** -0.5, need_lse=False)
        assert (fused - ref).abs().max() < 1e-5
    # every key as a column: the gathered path alone is dense too
    cols = torch.arange(L, dtype=torch.int32)[None, None].expand(qb.num_blocks, 1, L).contiguous()
    idx = RangeIndex(B, B, 1, qb, torch.full((qb.num_blocks, 1, 0, 2), -1, dtype=torch.int32),
                     torch.zeros(qb.num_blocks, 1, dtype=torch.int32), cols, torch.full((qb.num_blocks, 1), L).int())
    out, _ = range_attention(q, kc, vc, table[None], idx, D ** -0.5)
    assert (out - ref).abs().max() < 1e-5


KERNEL_CASES = [  # Hq, Hkv, D, page, block, granularity, patterns of the groups
    (6, 2, 16, 4, 16, "head", [("vertical_slash", 5, 7), ("block_sparse", 3), ("a_shape", 4, 20)] * 2),
    (6, 2, 32, 16, 16, "kv_head", [("vertical_slash", 9, 5), ("block_sparse", 2)]),
    (4, 1, 64, 8, 32, "kv_head", [("vertical_slash", 40, 3)]),  # GQA 4, more columns than one tile
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"h{c[0]}-kv{c[1]}-d{c[2]}-b{c[4]}-{c[5]}" for c in KERNEL_CASES])
def test_range_kernel_matches_executor(dtype, case):
    """Triton kernel (interpreter) vs the PyTorch executor on a batch of two sequences (one a chunk after a cached
    prefix), mixed patterns per group; NaN in every cache slot no sequence owns and in the poisoned outputs."""
    from longreach.kernels.vertical_slash import range_attention_triton

    Hq_, Hkv_, D_, page, B, gran, patterns = case
    g = torch.Generator().manual_seed(Hq_ + D_ + B)
    ctx, qlen = [45, 0], [40, 61]
    lengths = [c + n for c, n in zip(ctx, qlen)]
    need = [-(-x // page) for x in lengths]
    P = sum(need) + 2
    perm = torch.randperm(P, generator=g)
    tables = torch.zeros(2, max(need), dtype=torch.int32)
    tables[0, : need[0]], tables[1, : need[1]] = perm[: need[0]], perm[need[0]: sum(need)]
    kc = torch.randn(P, page, Hkv_, D_, generator=g).to(dtype)
    vc = torch.randn(P, page, Hkv_, D_, generator=g).to(dtype)
    kc[perm[sum(need):]] = vc[perm[sum(need):]] = float("nan")
    q = torch.randn(sum(qlen), Hq_, D_, generator=g).to(dtype)
    m = MInference(MInferenceConfig(block=B, last_q=16, granularity=gran), Hq_, Hkv_)
    qb = QueryBlocks.build(qlen, ctx, B)
    tiles, cols, row0 = [], [], 0
    for i, n in enumerate(qlen):
        blocks = [(qb.start[b] - row0, qb.length[b], qb.pos[b]) for b in qb.of_sequence(i)]
        t, c = m.build(0, q[row0:row0 + n].float(), blocks, (kc.float(), tables[i]), lengths[i], D_ ** -0.5,
                       patterns=patterns)
        tiles.append(t)
        cols.append(c)
        row0 += n
    idx = m.index(qb, tiles, cols)
    assert int(idx.col_counts.max()) > 0 and int(idx.tile_counts.max()) > 1
    ref, ref_lse = range_attention(q.float(), kc.float(), vc.float(), tables, idx, D_ ** -0.5)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], Hq_), float("nan"))
    range_attention_triton(q, kc, vc, tables, idx, D_ ** -0.5, block_n=B, out=out, lse=lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out.float() - ref).abs().max() <= tol
    assert (lse - ref_lse).abs().max() <= 1e-4


def test_range_kernel_reads_two_tiers_and_fp8_rows():
    """Through a page table (half the pages in a pool, poisoned host copies of them) the kernel gives the bits of a
    one-tier cache; fp8 rows are dequantised on load as the reference does."""
    from longreach.kernels.vertical_slash import range_attention_triton
    from longreach.kvcache.fp8 import quantize
    from tier_views import two_tiers

    g = torch.Generator().manual_seed(4)
    L, page, B = 70, 4, 16
    P = L // page + 4
    kc, vc = quantize(torch.randn(P, page, Hkv, D, generator=g)), quantize(torch.randn(P, page, Hkv, D, generator=g))
    table = torch.randperm(P, generator=g)[: -(-L // page)].int()
    q = torch.randn(L, Hq, D, generator=g)
    m = MInference(MInferenceConfig(block=B, last_q=16, pattern=("vertical_slash", 6, 5)), Hq, Hkv)
    qb = QueryBlocks.build([L], [0], B)
    t, c = m.build(0, q, list(zip(qb.start, qb.length, qb.pos)), (kc, table), L, D ** -0.5)
    idx = m.index(qb, [t], [c])
    a, _ = range_attention_triton(q, kc, vc, table[None], idx, D ** -0.5, block_n=B)
    ref, _ = range_attention(q, kc, vc, table[None], idx, D ** -0.5)
    assert (a - ref).abs().max() < 1e-5
    for units in (1, Hkv):  # a slot per page, and per KV head's page
        views = two_tiers(kc, vc, g, 0.5, units)
        b, _ = range_attention_triton(q, views[0], views[1], table[None], idx, D ** -0.5, block_n=B)
        assert torch.equal(a, b), units


# ---- through the engine ---------------------------------------------------------------------------------------------
SMALL = '{"block": 16, "last_q": 16, "pattern": ["vertical_slash", 6, 8], "segment": 64, "dense_below": 0}'
DECODE_IH = ('{"n_sink": 8, "n_window": 16, "block_q": 8, "chunk_sizes": [32, 8, 2], "budgets": [64, 16, 8], '
             '"early_layers": 1, "early_last_budget": 16, "refresh": [4, 2, 1], "dense_below": 0}')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_tiny_hf_model

    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama", max_position_embeddings=512)[0]


def _llm(path, **kw):
    from longreach.engine.llm import LLM

    return LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.01, **kw)


def test_chunked_prefill_equals_unchunked_and_differs_from_dense(tiny):
    """Chunks that are multiples of the estimation segment (64) see the indices of an unchunked prefill; a batch
    mixing a long and a short (dense_below) prompt equals each alone."""
    ids = torch.randint(3, 256, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = _llm(tiny, attention="minference", attention_config=SMALL).engine.prompt_logits(ids)
    chunked = _llm(tiny, attention="minference", attention_config=SMALL, max_num_batched_tokens=64
                   ).engine.prompt_logits(ids)
    assert (whole - chunked).abs().max() < 1e-4
    dense = _llm(tiny).engine.prompt_logits(ids)
    assert (whole - dense).abs().max() > 1e-3  # really sparse
    from longreach import SamplingParams

    cfg = SMALL.replace('"dense_below": 0', '"dense_below": 100')
    llm = _llm(tiny, attention="minference", attention_config=cfg)
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 256, (n,), generator=g).tolist()} for n in (170, 60)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == [llm.generate(p, params, use_tqdm=False)[0].token_ids for p in prompts]


def test_prefill_and_decode_methods_compose_through_the_engine(tiny):
    """minference prefill + infinitehip decode: the prefill is minference's (same first token), the decode is
    infinitehip's — equal to dense prefill + infinitehip decode when minference reads every key (an a_shape window
    as long as the prompt), different from minference + dense decode. Eager == the graph-decode path."""
    from longreach import SamplingParams

    ids = torch.randint(3, 256, (180,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(llm):
        return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids

    alone = run(_llm(tiny, attention="minference", attention_config=SMALL))
    explicit = run(_llm(tiny, attention="minference", attention_config=SMALL, decode_attention="dense"))
    assert alone == explicit  # dense decode is minference's default
    composed_llm = _llm(tiny, attention="minference", attention_config=SMALL, decode_attention="infinitehip",
                        decode_attention_config=DECODE_IH)
    assert composed_llm.engine.backend.name == "minference+infinitehip"
    composed = run(composed_llm)
    assert composed[0] == alone[0] and composed != alone
    full = SMALL.replace('["vertical_slash", 6, 8]', '["a_shape", 0, 512]')
    a = run(_llm(tiny, attention="minference", attention_config=full, decode_attention="infinitehip",
                 decode_attention_config=DECODE_IH))
    b = run(_llm(tiny, attention="dense", decode_attention="infinitehip", decode_attention_config=DECODE_IH))
    assert a == b
    graph = _llm(tiny, attention="minference", attention_config=SMALL, decode_attention="infinitehip",
                 decode_attention_config=DECODE_IH)
    graph.engine.runner.capture_graphs(emulate=True)
    assert graph.engine.runner._graph_sizes and run(graph) == composed


def test_composition_and_config_errors(tiny, tmp_path):
    with pytest.raises(ValueError, match="prefill-only method and cannot decode; --decode-attention takes one of"):
        _llm(tiny, attention="infinitehip", decode_attention="minference")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        _llm(tiny, attention="minference", decode_attention="nope:3k")
    with pytest.raises(ValueError, match="decode_attention_config needs decode_attention"):
        _llm(tiny, attention="minference", decode_attention_config="{}")
    with pytest.raises(ValueError, match="decode_attention 'infinitehip:x': unknown infinitehip preset 'x'"):
        _llm(tiny, attention="minference", decode_attention="infinitehip:x")
    with pytest.raises(ValueError, match="pattern must be one of"):
        _llm(tiny, attention="minference", attention_config='{"pattern": ["vs", 1, 2]}')
    with pytest.raises(ValueError, match="not a minference patterns file"):
        bad = tmp_path / "p.json"
        bad.write_text("{}")
        _llm(tiny, attention="minference", attention_config=json.dumps({"patterns": str(bad)}))
    with pytest.raises(ValueError, match="cannot read the minference patterns file"):
        _llm(tiny, attention="minference", attention_config='{"patterns": "/nonexistent.json"}')


# ---- calibration --------------------------------------------------------------------------------------------------
def _planted_model(path):
    """A tiny random Llama whose layer 0 has three planted heads (head_dim 64, RoPE base 10^4), via its weights:
    head 0 vertical (a constant query against keys flagged on tokens 240-255, in the slowest RoPE pair, so the
    score ignores distance), head 1 diagonal (query a, key sum_m R(o_m) a in the 14 fastest pairs: bands at offsets
    170, 300, 470), head 2 local + sink (query = key in four mid-frequency pairs, a smooth decay over ~100 tokens,
    plus the BOS token). Head 3 and layer 1 stay random."""
    from conftest import make_tiny_hf_model

    H, Dh, hid = 4, 64, 256
    p, model = make_tiny_hf_model(path, num_hidden_layers=2, hidden_size=hid, num_attention_heads=H,
                                  num_key_value_heads=H, intermediate_size=64, max_position_embeddings=4096)
    sd = model.state_dict()
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(256, hid, generator=g) * 0.01
    emb[:, 0] = 1.0  # a constant carrier: RMSNorm turns it into a constant input to the q/k projections
    emb[240:, 3:] = torch.randn(16, hid - 3, generator=g) * 0.05  # special tokens: distinct values ...
    emb[240:, 1] = 1.0  # ... and a flag the vertical head's keys read
    emb[1, 2] = 1.0  # BOS: the sink of head 2
    sd["model.embed_tokens.weight"].copy_(emb)
    wq, wk = sd["model.layers.0.self_attn.q_proj.weight"], sd["model.layers.0.self_attn.k_proj.weight"]
    wq.zero_()
    wk.zero_()
    half = Dh // 2
    theta = 10000.0 ** (-torch.arange(half).float() / half)
    wq[31, 0] = wk[31, 1] = 0.75  # head 0
    a = torch.zeros(Dh)
    a[:14] = 1.0
    a = a / a.norm() * math.sqrt(20 * 8) / 16  # peak logit ~20
    kvec = torch.zeros(Dh)
    for o in (170, 300, 470):
        c, s = torch.cos(o * theta), torch.sin(o * theta)
        kvec[:half] += a[:half] * c - a[half:] * s
        kvec[half:] += a[:half] * s + a[half:] * c
    wq[Dh:2 * Dh, 0], wk[Dh:2 * Dh, 0] = a, kvec  # head 1
    b = torch.zeros(Dh)
    b[15:19] = 1.0
    b = b / b.norm() * math.sqrt(12 * 8) / 16
    wq[2 * Dh:3 * Dh, 0], wk[2 * Dh:3 * Dh, 0] = b, b  # head 2
    wq[2 * Dh + 31, 0] += 0.6
    wk[2 * Dh + 31, 2] = 0.9
    model.load_state_dict(sd)
    model.save_pretrained(p)
    return p


def _byte_tokenizer(path):
    """A byte-level tokenizer with exactly 256 tokens (the tiny model's vocabulary), so the CLI can run on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))


def test_calibration_chooses_the_planted_patterns(tmp_path):
    """On the planted layer the search picks vertical-slash with enough verticals for the vertical head (40
    verticals: k_v 48, not 4), vertical-slash for the diagonal head, Λ-shape for the local head; every candidate
    costs about the Λ budget; the file loads and runs through the engine."""
    from longreach.attention.minference.search import SearchSpace
    from longreach.tools.calibrate import calibrate
    from longreach.config import EngineConfig
    from longreach.engine.llm_engine import LLMEngine

    path = _planted_model(tmp_path / "m")
    L = 1024
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 240, (L,), generator=g)
    ids[0] = 1
    spec = torch.randperm(L - 8, generator=g)[:40] + 4
    ids[spec] = torch.randint(240, 256, (40,), generator=g)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", max_model_len=L + 1,
                                    max_num_batched_tokens=L, max_num_seqs=1, kv_cache_memory_gb=0.05))
    space = SearchSpace(target=(16, 128), verticals=(4, 48), step=4)
    layers = calibrate(engine, ids.tolist(), space, block=16, progress=False)
    layer0 = layers[0]
    kinds = [c[0] for c in layer0["choice"]]
    assert kinds[:3] == ["vertical_slash", "vertical_slash", "a_shape"], layer0
    assert layer0["choice"][0][1] == 48
    assert all(abs(c - layer0["cost"][0]) <= 0.1 * layer0["cost"][0] for c in layer0["cost"]), layer0["cost"]
    kind = [c[0] for c in layer0["space"]]
    for head in (0, 1):  # vertical-slash clearly beats the other kinds on the vertical and the diagonal head
        errs = layer0["errors"][head]
        best_vs = min(e for e, k in zip(errs, kind) if k == "vertical_slash")
        assert best_vs * 1.5 < min(e for e, k in zip(errs, kind) if k != "vertical_slash"), (head, errs)
    errs = layer0["errors"][2]  # Λ is the best on the local head (block-sparse may tie: the same keys)
    assert errs[0] <= min(errs) * 1.001 and errs[0] * 3 < min(e for e, k in zip(errs, kind) if k == "vertical_slash")
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"format": "longreach-minference-patterns/1", "granularity": "head", "block": 16,
                             "layers": layers}))
    from longreach.engine.llm import LLM

    llm = LLM(path, device="cpu", dtype="float32", kv_cache_memory_gb=0.05, attention="minference",
              attention_config=json.dumps({"patterns": str(p), "block": 16, "dense_below": 0}))
    assert llm.engine.backend.method.layer_patterns(0)[2] == ("a_shape", 16, 128)
    llm.engine.prompt_logits(ids.tolist()[:300])


def test_calibrate_command_writes_provenance_and_the_file_loads(tmp_path, capsys):
    from longreach.cli import main

    model = tmp_path / "m"
    from conftest import make_tiny_hf_model

    make_tiny_hf_model(model, arch="llama", max_position_embeddings=1024)
    _byte_tokenizer(model)
    out = tmp_path / "P.json"
    argv = ["calibrate", "--method", "minference", "--model", str(model), "--task", "kv-retrieval", "--length", "512",
            "--out", str(out), "--target", "8,64", "--verticals", "4,16", "--step", "8", "--block", "16",
            "--granularity", "kv_head", "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    prov = data["provenance"]
    assert prov["length"] == 512 and prov["data"]["kind"] == "kv-retrieval" and len(prov["model_sha256"]) == 64
    assert prov["command"].startswith("longreach calibrate --method minference") and prov["longreach_version"]
    assert data["search_space"]["target"] == [8, 64] and data["granularity"] == "kv_head"
    assert len(data["layers"]) == 3 and all(len(x["choice"]) == 2 for x in data["layers"])
    from longreach.engine.llm import LLM

    llm = LLM(str(model), device="cpu", dtype="float32", kv_cache_memory_gb=0.05, attention="minference",
              attention_config=json.dumps({"patterns": str(out), "block": 16, "dense_below": 0}))
    assert llm.engine.backend.method.groups == 2
    assert main(["calibrate", "--method", "minference", "--model", str(model), "--task", "kv-retrieval",
                 "--out", str(tmp_path / "no" / "P.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_eval_method_specs_compose_prefill_and_decode():
    from longreach.tools.eval.common import method_config, parse_methods

    (a, b) = parse_methods(["minference:bs+infinitehip:3k-fast@x", "minference"])
    assert (a.name, a.preset, a.decode, a.label) == ("minference", "bs", "infinitehip:3k-fast",
                                                    "minference:bs+infinitehip:3k-fast@x")
    assert b.decode is None and b.label == "minference"
    cfg = {"minference": {"block": 32}, "infinitehip": {"exact_below": 0}}  # --attention-config, as the CLI parsed it
    assert method_config(a, cfg) == {"block": 32}
    assert method_config(parse_methods(["infinitehip:3k-fast"])[0], cfg) == {"exact_below": 0}
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        parse_methods(["minference+nope"])


def test_eval_config_of_a_composed_variant_reaches_its_decode_side_and_unread_keys_are_refused():
    """"infinitehip+psa@e50": the decode side reads "psa@e50" (then "psa"), not silently nothing; a keyed entry no
    listed method reads, if it names a label (variant or composition), is an error naming what each method reads;
    entries by method name may sit unread (one config for several runs)."""
    from longreach.tools.eval.common import decode_kwargs, decode_spec, method_config, parse_methods

    cfg = {"psa@e50": {"epsilon": 0.5}, "psa:0.9": {"microbatch": 8}, "psa": {"count_reads": True}}
    a, b, c = parse_methods(["infinitehip+psa@e50", "infinitehip+psa:0.9", "infinitehip+psa"], attention_config=cfg)
    assert decode_spec(a).label == "psa@e50" and decode_spec(b).label == "psa:0.9" and decode_spec(c).label == "psa"
    assert decode_kwargs(a, cfg)["decode_attention_config"] == {"epsilon": 0.5}
    assert decode_kwargs(b, cfg)["decode_attention_config"] == {"microbatch": 8}
    assert decode_kwargs(c, cfg)["decode_attention_config"] == {"count_reads": True}
    assert method_config(a, cfg) is None  # the prefill side (infinitehip) has no entry
    assert decode_spec(parse_methods(["infinitehip"])[0]) is None
    with pytest.raises(ValueError, match=r"entries no method reads: 'psa@e80'.*infinitehip\+psa@e50: "
                                         r"infinitehip\+psa@e50, infinitehip, psa@e50, psa"):
        parse_methods(["infinitehip+psa@e50"], attention_config={"psa@e80": {"epsilon": 0.8}})
    with pytest.raises(ValueError, match=r"entries no method reads: 'quest\+psa'"):
        parse_methods(["infinitehip+psa"], attention_config={"quest+psa": {}, "quest": {}})
    parse_methods(["infinitehip+psa"], attention_config={"quest": {"budget": 64}, "psa": {}})  # by name: fine
    # a flat object applies to every method: nothing to refuse; dense reads nothing
    parse_methods(["dense", "psa"], attention_config={"epsilon": 0.5})
