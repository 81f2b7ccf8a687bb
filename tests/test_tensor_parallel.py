"""Tensor parallelism, first milestone (issue 32): dense attention, CPU processes over gloo, fp32.

  * the shard math and the sharded loader, in one process: every rank's part reassembles into the unsharded weights
    (GQA heads split, one KV head replicated, a vocabulary that does not divide);
  * TP=2 == TP=1: greedy tokens equal and prompt logits within fp32 reduction-order error, with chunked prefill
    and mixed steps, for a model of 4 KV heads (2 per rank) and one of 1 KV head (replicated on both ranks);
  * shutdown: no worker process left after `close`; a killed worker makes rank 0 raise (naming it), not hang.

Each TP=2 engine spawns one worker (a few seconds on a 2-core CPU): the engines are shared per module.
"""
import os
import signal
import time

import pytest
import torch

from longreach import SamplingParams
from longreach.config import EngineConfig
from longreach.distributed.group import TPGroup
from longreach.engine.llm import LLM
from longreach.engine.tp_workers import WorkerDied
from longreach.models.loader import build_model, _safetensors_weights
from longreach.models.config import ModelConfig
from longreach.models.shard import ModelShard, allowed_sizes

from conftest import make_tiny_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", kv_cache_memory_gb=0.01, cpu_threads=1, block_size=8,
              max_num_batched_tokens=16, max_num_seqs=3)  # 16-token steps: prompts prefill in several chunks
SHAPES = {"kv4": dict(num_attention_heads=8, num_key_value_heads=4, hidden_size=128),  # 2 KV heads (4 query heads) per rank
          "kv1": dict(num_attention_heads=4, num_key_value_heads=1)}  # the one KV head on both ranks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (HF directory, the transformers model saved there)."""
    return {name: make_tiny_hf_model(tmp_path_factory.mktemp(name) / "m", vocab_size=250, **shape)
            for name, shape in SHAPES.items()}


@pytest.fixture(scope="module")
def paths(checkpoints):
    return {name: path for name, (path, _) in checkpoints.items()}


def _load(path: str, rank: int = 0, size: int = 1):
    import json

    with open(os.path.join(path, "config.json")) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    tp = TPGroup(rank, size)  # no process group: loading runs no collective
    return build_model(cfg, _safetensors_weights(path, torch.float32), torch.float32, torch.device("cpu"), tp)


# ---- shard math and loading, one process ----------------------------------------------------------------------------
def test_sizes_that_cannot_split_are_refused_with_the_allowed_ones():
    cfg = ModelConfig("llama", 250, 64, 96, 2, 8, 4, 8, 1e-5, 256, name="m")
    assert allowed_sizes(cfg) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="allowed: 1, 2, 4, 8"):
        ModelShard.of(cfg, 0, 3)
    gqa6 = ModelConfig("llama", 250, 64, 96, 2, 12, 6, 8, 1e-5, 256)
    assert allowed_sizes(gqa6) == [1, 2, 3, 6, 12]  # 4 neither divides 6 KV heads nor is a multiple of them
    one = ModelShard.of(cfg, 5, 8)  # 8 ranks, 4 KV heads: each KV head on two ranks (vLLM's rule: r * Hkv // N)
    assert list(one.q_heads) == [5] and list(one.kv_heads) == [2]


@pytest.mark.parametrize("what, kwargs, message", [
    ("sparse", dict(attention="streaming"), "sparse attention"),
    ("offload", dict(kv_offloading_size=1.0), "KV offloading"),
    ("fp8", dict(quantization="fp8"), "fp8 weights"),
    ("one gpu", dict(device="cuda:1"), "rank r runs on cuda:r"),
    ("size", dict(tensor_parallel_size=0), "positive integer"),
])
def test_config_refuses_what_this_milestone_does_not_split(what, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{"tensor_parallel_size": 2, **kwargs})


def _reassemble(parts: list[torch.Tensor], full: torch.Tensor, name: str, shards: list[ModelShard]) -> torch.Tensor:
    """The unsharded value of parameter `name` from each rank's part (the inverse of ModelShard.cut)."""
    cfg_rows = full.shape[0]
    if name.endswith("qkv_proj.weight"):
        d = shards[0].head_dim
        out = torch.full_like(full, float("nan"))
        hq = sum(len(s.q_heads) for s in shards) * d
        for s, part in zip(shards, parts):
            nq, nkv = len(s.q_heads) * d, len(s.kv_heads) * d
            out[s.q_heads.start * d:s.q_heads.stop * d] = part[:nq]
            hkv = (cfg_rows - hq) // 2
            for slot in (0, 1):  # k, v: a replicated head is written by each of its ranks, identically
                rows = part[nq + slot * nkv:nq + (slot + 1) * nkv]
                dst = out[hq + slot * hkv + s.kv_heads.start * d:hq + slot * hkv + s.kv_heads.stop * d]
                assert torch.isnan(dst).all() or torch.equal(dst, rows)
                dst.copy_(rows)
        return out
    if name.endswith("gate_up_proj.weight"):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return torch.cat(parts, dim=1)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        whole = torch.cat(parts)
        assert not whole[full.shape[0]:].any()  # the padding rows past the vocabulary are zero
        return whole[:full.shape[0]]
    assert all(torch.equal(p, parts[0]) for p in parts)  # norms: replicated
    return parts[0]


@pytest.mark.parametrize("shape, size", [("kv4", 2), ("kv4", 4), ("kv1", 2), ("kv1", 4)])
def test_sharded_loader_reassembles_the_unsharded_weights(paths, shape, size):
    full = dict(_load(paths[shape]).named_parameters())
    ranks = [_load(paths[shape], r, size) for r in range(size)]
    shards = [m.shard for m in ranks]
    assert shards[0].vocab_rows == -(-250 // size)
    for name, value in full.items():
        parts = [dict(m.named_parameters())[name].detach() for m in ranks]
        if size > 1 and name.endswith(("qkv_proj.weight", "o_proj.weight", "down_proj.weight")):
            assert parts[0].numel() < value.numel()  # a rank holds a part, not the whole
        assert torch.equal(_reassemble(parts, value.detach(), name, shards), value.detach()), name


def test_random_weights_are_the_same_model_cut_into_parts():
    from longreach.models.random_init import SHAPES as RANDOM, build_random_model

    cfg = RANDOM["tiny"].config
    full = dict(build_random_model(cfg, torch.float32, torch.device("cpu")).named_parameters())
    ranks = [build_random_model(cfg, torch.float32, torch.device("cpu"), tp=TPGroup(r, 2)) for r in range(2)]
    for name, value in full.items():
        parts = [dict(m.named_parameters())[name].detach() for m in ranks]
        assert torch.equal(_reassemble(parts, value.detach(), name, [m.shard for m in ranks]), value.detach())


# ---- TP=2 == TP=1, two processes --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(paths):
    made = {}
    for name, path in paths.items():
        made[name] = (LLM(path, **ENGINE), LLM(path, tensor_parallel_size=2, **ENGINE))
    yield made
    for one, two in made.values():
        two.close()


def _prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=g).tolist()} for n in (37, 5, 50, 21)]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tp2_greedy_tokens_equal_tp1_with_chunked_prefill(engines, shape):
    one, two = engines[shape]
    prompts = _prompts()
    want = [o.token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    assert all(len(t) == GREEDY.max_tokens for t in got)
    two.engine.blocks.check_integrity()
    assert two.engine.blocks.num_free_blocks == two.engine.blocks.num_blocks
    assert two.engine.rank_model_config.num_kv_heads == max(SHAPES[shape]["num_key_value_heads"] // 2, 1)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_tp2_prompt_logits_equal_tp1(engines, checkpoints, shape):
    """Within fp32's reduction-order error: |TP2 - TP1| <= 1e-5 of the logits' scale (these random weights make
    logits of ~10), and TP2 as close to a float64 run of the checkpoint as TP1 is (TP1's own error is ~3e-5)."""
    one, two = engines[shape]
    tokens = _prompts(seed=1)[2]["prompt_token_ids"]  # 50 tokens: four 16-token chunks
    want, got = one.engine.prompt_logits(tokens), two.engine.prompt_logits(tokens)
    assert got.shape == want.shape == (len(tokens), 250)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale
    with torch.no_grad():
        exact = checkpoints[shape][1].double()(torch.tensor([tokens])).logits[0]
    err_one, err_two = ((x.double() - exact).abs().max().item() for x in (want, got))
    assert err_two <= 2 * err_one + 1e-6


def test_tp2_gemma3_equals_tp1(tmp_path):
    """Gemma 3's options under TP=2 (test_gemma3.py's tiny model: sliding-window layers with their own RoPE, GeGLU,
    the four norms, scaled embeddings, logit soft-capping applied on rank 0 after the gather): greedy tokens decoded
    past the window and prompt logits equal TP=1's."""
    from test_gemma3 import _tiny_gemma3

    path = _tiny_gemma3(tmp_path / "g3", final_logit_softcapping=30.0)[0]
    cfg = dict(ENGINE, max_model_len=256)
    one, two = LLM(path, **cfg), LLM(path, tensor_parallel_size=2, **cfg)
    try:
        prompts = _prompts(seed=2)
        want = [o.token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]
        assert [o.token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)] == want
        tokens = prompts[2]["prompt_token_ids"]
        a, b = one.engine.prompt_logits(tokens), two.engine.prompt_logits(tokens)
        assert (a - b).abs().max().item() <= 1e-5 * a.abs().max().item()
    finally:
        two.close()


# ---- shutdown and failure ---------------------------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_close_leaves_no_worker_process(paths):
    llm = LLM(paths["kv1"], tensor_parallel_size=2, **ENGINE)
    procs = list(llm.engine.workers.processes)
    assert llm.generate(_prompts()[1], GREEDY, use_tqdm=False)[0].token_ids
    llm.close()
    assert [p.exitcode for p in procs] == [0] * len(procs)  # left on the stop plan, not terminated
    assert all(_gone(p.pid) for p in procs)
    llm.close()  # idempotent


def test_a_killed_worker_makes_rank_0_raise_not_hang(paths):
    llm = LLM(paths["kv4"], tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    t0 = time.perf_counter()
    with pytest.raises(WorkerDied, match="rank 1"):
        llm.generate(_prompts()[0], GREEDY, use_tqdm=False)
    assert time.perf_counter() - t0 < 10
    llm.close()
    assert _gone(worker.pid)
