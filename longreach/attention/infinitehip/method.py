"""InfiniteHiP: multi-stage hierarchical context pruning (Lee, Park, Suh, Hwang 2025; App. A, Algorithms 1-4).

Per query block of b_q queries and selection group:
  candidates   [n_sink, end of the block - n_stream): keys before every query's window, so no stage needs a causal
               mask (Alg. 1, line 1);
  stage i      (l_c, k): cut the candidates into chunks of l_c tokens, pick one representative key per chunk and head
               with SelectRep, score the chunk by max over the group's heads and the block's queries of
               <q, k_rep>, keep the k / l_c best chunks (Alg. 2); the survivors are the next stage's candidates;
  SelectRep    (Alg. 3) a top-1 binary search: the range is halved ceil(log2 l_c) times; each half is represented
               by its *first* key and the half whose representative scores higher is kept.
The last stage's chunks (l_c^(N) tokens each) are the selected key blocks; sink and window are added by the executor.
During decode each stage's output is cached per sequence and layer and recomputed every n_refresh^(i) steps from the
(possibly recomputed) output of the stage before (Alg. 4).

Settled ambiguities (digest §8):
  * chunks are aligned to absolute positions (chunk j of stage i = positions [j*l_c, (j+1)*l_c)), so a chunk keeps
    its identity as the context grows (what mask caching needs) and the last stage's chunks are the executor's key
    blocks; the edge chunks of the candidate range are partial and SelectRep searches only their valid keys (§8.4
    padding). Each l_c must divide the previous one, so every later chunk lies inside one surviving chunk;
  * the union of survivors is kept sorted by position (§8.4 ordering); keys in both a survivor and a query's window
    are read once, as the executor's disjoint parts define (§8.4 de-duplication);
  * SelectRep halves a range of length n into [first, first + n//2) and [first + n//2, last] (balanced halves);
  * GQA (§8.3): the chunk score is pooled over the heads of a selection group, one selection per KV-head group by
    default (`granularity`; "layer" is the paper's max over all heads, see index.py for why per-group is default);
  * flash preset (§8.2): App. F's (96, 24, 8) is used for `3k-flash`; Table 4's timings imply (96, 32, 8), which is
    one `--attention-config '{"refresh": [96, 32, 8]}'` away;
  * a stage whose candidates already fit its budget keeps them all (no scoring);
  * a stage i is recomputed at decode step s when s % n_refresh^(i) == 0 or when an earlier stage was recomputed;
  * `rep_per_head` (longreach option; True = the paper): False runs SelectRep once per KV head, comparing halves by
    the max over all the query heads that read that KV head, so one key gather per probe serves all of them;
  * `exact_below` (longreach option; 0 = the paper's SelectRep everywhere): chunks of at most this many tokens are
    scored by their best key exactly instead of by SelectRep's approximation. Default 32, i.e. the last two stages
    of the 3k presets. At 8 (the last stage only), mean attention-mass recall on SmolLM2 (Paul Graham essays, 8K
    tokens, last 256 queries) rose from 0.962 to 0.982: SelectRep's first-key representatives miss the isolated
    high-scoring tokens that layers 3-10 of that model attend to (docs/sparse.md). At 32, passkey over 15 prompts
    per length went from 60/67/53% to 60/80/100% at 8K/16K/32K, and from 0/11% to 33/33% at 64K/128K (9 prompts
    each). The cost on an H200 is +36% end-to-end prefill at 128K (2.48 -> 3.38 s) and -5% decode tok/s
    (docs/quality.md, docs/benchmarks.md).
  * `stage0_scores` (longreach option; "selectrep" = the paper): "minmax" or "cuboid-mean" score stage 0's chunks
    from a box around each chunk's keys instead (kernels/chunk_box.py), so that stage 0 does not search inside its
    chunks; exact scoring still wins where `exact_below` covers stage 0. The ladder (docs/quality.md) located the
    needle's loss past 64K in stage 0's SelectRep, and the box keeps it: preset `3k-box` (64-token chunks, minmax)
    answers passkey in 90/100% at 64K/128K (20 prompts each; 3k: 40/20). The boxes are kept per sequence in a
    pool paged like the KV cache (infinitehip/boxes.py): each step boxes only the chunks its new keys touch, and
    decode reads them through a box table inside the CUDA graph; a Triton kernel scores them on a GPU. Not with
    de positions.
  * `lookahead` (longreach option, not in the paper; 0 = the paper): in decode only, each stage keeps its k / l_c
    survivors plus the next `lookahead` chunks after each (ids c+1..c+lookahead at that stage's granularity) that
    are candidates (inside [n_sink, the candidate end), as chunk_bounds says: never in a query's window), without
    duplicates, ascending; the next stage's candidates are the sub-chunks of all of them. Why: a stage's output is
    reused for refresh[i] steps, and a model copying forward (a needle read token by token) reads past the chunks
    that held its next tokens when the mask was computed: Qwen2.5-Coder-0.5B copied niah_single_3's UUID from a
    256K/128K prompt in 12/20 and 16/20 with refresh (16, 8, 4) against 30/30 and 20/20 with (1, 1, 1), which halves
    decode speed, the misses garbled copies (the 2026-11-27 H200 runs, docs/quality.md). A decode step then keeps
    up to (1 + lookahead) * k / l_c chunks per stage (`graph_stage_widths` sizes the captured step's buffers so);
    prefill, its selection graphs, `selected_budget` and the dense limits counted from it are unchanged.
  * `ahead` (longreach option, not in the paper; False = the paper): in decode only, a stage-0 refresh scores stage 0
    as usual but hands the next stages the stage-0 output of the refresh before, keeping the new one for the next
    refresh (a sequence's first refresh, with nothing kept, uses its own); rows of a captured step that do not
    refresh stage 0 keep both. Stage 0's output is then 1-2 refresh intervals old instead of 0-1. Why: with the KV
    cache offloaded, the new output's pages can be copied to the GPU while the steps between run
    (kvcache/prefetch.py) instead of inside the refresh step (docs/design-refresh-installs.md, option 5); the
    method hands them to the store (`SequenceKeys.install` with ahead) after stage 1's own installs.
RoPE (§1.5): the paper's strategies by default — chunk-indexed positions while pruning in layers 0-2, relative in the
rest, rolling (StreamingLLM) positions in the attention — applied to query blocks past the model's trained length
(`rope_from`); inside it true positions are exact and score better (rope/strategies.py).
"""
from __future__ import annotations

import torch

from ...kernels.prune_ref import chunk_bounds
from ..sparse.selection import BlockQueries, SelectionMethod, SequenceKeys, StageAhead, use_kernels
from .config import DEFAULT_PRESET, PRESETS, InfiniteHiPConfig


class InfiniteHiP(SelectionMethod):
    name = "infinitehip"
    config_cls = InfiniteHiPConfig
    presets = PRESETS
    default_preset = DEFAULT_PRESET

    @property
    def block_k(self) -> int:
        return self.cfg.chunk_sizes[-1]

    def stage_budgets(self, layer: int) -> tuple[int, ...]:
        cfg = self.cfg
        if layer < cfg.early_layers and cfg.early_last_budget is not None:
            return (*cfg.budgets[:-1], cfg.early_last_budget)
        return cfg.budgets

    def selected_budget(self, layer: int) -> int:
        """The last stage's budget: what a prefill query block selects and what dense_below's None and "trained"
        limits count. A decode step with `lookahead` selects up to (1 + lookahead) times it (module docstring)."""
        return self.stage_budgets(layer)[-1]

    def _select(self, layer, q, blocks, keys, state, step):
        if state is None:  # prefill: every stage, for every block
            return torch.cat([stages[-1] for stages in self._sliced_stages(layer, q, blocks, keys)])
        cached = state.get("stages")
        first = 0 if cached is None else self.refresh_from(step)
        prev = cached[first - 1] if first > 0 else None
        ahead = StageAhead(state.get("ahead")) if self.cfg.ahead and first == 0 else None
        fresh = (self.run_stages(layer, q, blocks, keys, first, prev, lookahead=self.cfg.lookahead, ahead=ahead)
                 if first < len(self.cfg.refresh) else [])
        if ahead is not None:
            state["ahead"] = ahead.next
        state["stages"] = (cached[:first] if cached is not None else []) + fresh
        return state["stages"][-1]

    def _sliced_stages(self, layer, q, blocks, keys):
        cfg = self.cfg
        per_block = 0  # the kernel's working set is its output: no slicing needed
        if not use_kernels(q):
            widest = max([keys.length // cfg.chunk_sizes[0]] +
                         [k // l for k, l in zip(cfg.budgets[:-1], cfg.chunk_sizes[1:])])
            per_block = self.num_heads * widest * (q.shape[-1] + blocks.max_rows) * 4 * 3 * max(1, cfg.exact_below)
        for sl in self.slices(blocks.num_blocks, per_block):
            yield self.run_stages(layer, q, blocks[sl], keys)

    def stage_widths(self, layer: int, max_end: int, lookahead: int = 0) -> list[tuple[int, bool]]:
        """Per stage: (most valid candidates, stage 0's list width; whether scoring is needed), from host-side bounds
        only.

        A stage needs no scoring when even its widest candidate list fits its budget. Using bounds instead of the
        actual candidate counts keeps the stages free of device-to-host syncs (CUDA-graph capturable); when a bound
        says "score" but the real candidates fit, top-k keeps them all anyway. With `lookahead` a stage keeps up to
        (1 + lookahead) times its survivors, at most every candidate chunk of its size (its successors need not be
        its candidates).
        """
        cfg = self.cfg
        budgets = self.stage_budgets(layer)

        def every(l: int) -> int:  # chunks of l tokens that overlap [n_sink, candidate end)
            return max(0, -(-(max_end - cfg.n_window) // l) - cfg.n_sink // l)

        out = []
        width = 0
        for i, l in enumerate(cfg.chunk_sizes):
            if i == 0:
                width = every(l)
            else:
                up = cfg.chunk_sizes[i - 1]
                kept = min(width, budgets[i - 1] // up)
                if lookahead:
                    kept = min(kept * (1 + lookahead), every(up))
                width = kept * (up // l)
            out.append((width, width > budgets[i] // l))
        return out

    def graph_stage_widths(self, layer: int) -> tuple[int, ...] | None:
        return tuple((1 + self.cfg.lookahead) * (k // l) for k, l in zip(self.stage_budgets(layer),
                                                                          self.cfg.chunk_sizes))

    def box_spec(self) -> tuple[int, str] | None:
        cfg = self.cfg
        if cfg.stage0_scores == "selectrep" or cfg.chunk_sizes[0] <= cfg.exact_below:
            return None
        return cfg.chunk_sizes[0], cfg.stage0_scores

    def box_scores(self, layer, q, blocks, keys, ids, chunk, cand_end):
        """Stage 0's scores from boxes around each chunk's keys (kernels/chunk_box.py): the engine's kept boxes
        (infinitehip/boxes.py, read through the sequence's box table without host syncs; the Triton kernel on a
        GPU), else boxes built from the keys (torch ops)."""
        from ...kernels.chunk_box import chunk_box_scores

        stride = self.cfg.query_strides[0]
        qs, ok = self.query_rows(q, blocks, stride)
        boxes = keys.chunk_boxes(chunk)
        return chunk_box_scores(qs, ok, keys.dense() if boxes is None else None, ids, chunk, self.cfg.n_sink,
                                cand_end, self.groups, self.cfg.stage0_scores,
                                self.rope_args(layer, "prune", blocks.max_end), boxes=boxes, shared=blocks.shared,
                                stride=stride)

    def refresh_from(self, step: int) -> int:
        return next((i for i, r in enumerate(self.cfg.refresh) if step % r == 0), len(self.cfg.refresh))

    def refreshed_every_step(self, stage: int) -> bool:
        return self.cfg.refresh[stage] == 1

    def graph_last_direct(self) -> bool:
        return self.cfg.refresh[-1] == 1 and not self.cfg.lookahead

    def graph_ahead(self) -> bool:
        return self.cfg.ahead

    def graph_select(self, layer, q, blocks, keys, cached, row_first, level, out=None, ahead=None):
        prev = cached[level - 1] if level else None
        return self.run_stages(layer, q, blocks, keys, level, prev, keep=(cached, row_first),
                               lookahead=self.cfg.lookahead, last_out=out, ahead=ahead)

    def stage0_ahead(self, new: torch.Tensor, ahead: StageAhead, kept: torch.Tensor | None):
        """`ahead` at a stage-0 refresh: (what the next stages use, the stage-1 chunks to copy in for the next
        refresh). new (nb, G, C0): this refresh's output; kept (nb, 1, 1) rows that keep their cached stage 0 (a
        captured step's rows not refreshing it: they keep `held` too) or None. Sets `ahead.next`."""
        held = ahead.held
        if held is not None and held.shape != new.shape:  # an eager step whose stage-0 width changed: none kept
            held = None
        used = new if held is None else torch.where((held >= 0).any(-1, keepdim=True), held, new)
        ahead.next = new if held is None or kept is None else torch.where(kept, held, new)
        ratio = self.cfg.chunk_sizes[0] // self.cfg.chunk_sizes[1]
        nb, G, _ = new.shape
        # new's sub-chunks (a -1 gives negative ids: no pages); none for the rows that keep theirs
        pre = torch.add(self.arange(ratio, new.device, new.dtype), new[..., None], alpha=ratio).reshape(nb, G, -1)
        return used, (pre if kept is None else torch.where(kept, -1, pre))

    def runs_for_next(self, i: int, widths, keep, lookahead: int, ahead, ci: bool) -> int | None:
        """The next stage's chunk size, if stage i should score its candidates per run of that many keys so that the
        next stage takes its scores from them (`scores_from_runs`) instead of reading its keys again, else None.

        Exact, not a shortcut: stage i+1's candidates are sub-chunks of stage i's survivors, every key of which stage
        i scored against the same query rows at the same positions, and a chunk's exact score is its best key's, so
        the best key of each run is stage i+1's score of that sub-chunk. It needs both stages exact (`exact_below`),
        stage i+1 scoring (not every candidate fitting its budget), the same query rows (`query_stride`), key
        positions that do not depend on the candidate list (not `ci`, whose positions count the candidates), and
        every survivor scored in this call: no kept
        output (`keep`: a captured decode step's rows keep earlier outputs), no lookahead chunks (not candidates of
        stage i), and not stage 0 under `ahead` (the next stages then build on an earlier refresh's output)."""
        cfg = self.cfg
        if (i + 1 >= len(cfg.chunk_sizes) or cfg.chunk_sizes[i] > cfg.exact_below or ci or keep is not None
                or lookahead or (ahead is not None and i == 0) or cfg.query_strides[i] != cfg.query_strides[i + 1]):
            return None
        nxt = cfg.chunk_sizes[i + 1]
        return nxt if nxt <= cfg.exact_below and widths[i + 1][1] else None

    @staticmethod
    def scores_from_runs(ids: torch.Tensor, prev_ids: torch.Tensor, run_scores: torch.Tensor, ratio: int):
        """Scores (nb, G, C') of chunks `ids` (nb, G, C'), sub-chunks of the previous stage's candidates `prev_ids`
        (nb, G, C; ascending where >= 0, the rest after them) whose scores per run of `ratio` runs are `run_scores`
        (nb, G, C * ratio): run r of candidate c at c * ratio + r. A negative id (a dropped survivor's) or a parent
        that is not a candidate scores -inf. Device ops only (a search and a gather), no host sync."""
        parent = torch.div(ids, ratio, rounding_mode="floor")
        key = torch.where(prev_ids >= 0, prev_ids, torch.iinfo(prev_ids.dtype).max).contiguous()
        at = torch.searchsorted(key, parent.to(key.dtype).contiguous()).clamp(max=key.shape[-1] - 1)
        found = (ids >= 0) & (torch.gather(key, -1, at) == parent)
        score = torch.gather(run_scores, -1, at * ratio + (ids - parent * ratio))
        return torch.where(found, score, float("-inf"))

    def lookahead_chunks(self, ids: torch.Tensor, chunk: int, cand_end: torch.Tensor, n: int) -> torch.Tensor:
        """A stage's survivors ids (nb, G, C) (candidate chunks of `chunk` tokens, ascending, -1 padded) -> (nb, G,
        (1 + n) * C): the survivors and the next n chunks after each that are candidates, each once, ascending, -1
        padded. A survivor overlaps [n_sink, candidate end), so its successors start past n_sink, and one is a
        candidate (chunk_bounds) when it starts before the candidate end. Torch ops only (two sorts), no host sync."""
        nb, G, _ = ids.shape
        base = ids[..., None]
        cand = base + self.arange(n + 1, ids.device, ids.dtype)  # (nb, G, C, 1 + n)
        ok = (base >= 0) & (cand * chunk < cand_end[:, None, None, None])
        past = torch.iinfo(ids.dtype).max  # sorts after every id
        cand = torch.where(ok, cand, past).reshape(nb, G, -1).sort(dim=-1).values
        cand[..., 1:].masked_fill_(cand[..., 1:] == cand[..., :-1], past)  # a repeat: sorts to the end again
        cand = cand.sort(dim=-1).values
        return cand.masked_fill_(cand == past, -1)

    def run_stages(self, layer, q, blocks, keys, first: int = 0, prev: torch.Tensor | None = None,
                   return_counts: bool = False, keep: tuple[list[torch.Tensor], torch.Tensor] | None = None,
                   lookahead: int = 0, last_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ahead: StageAhead | None = None):
        """Outputs of stages first..N-1, each (nb, G, C_i) ascending chunk ids at that stage's granularity, -1 padded
        (and, with `return_counts`, the last stage's (nb, G) counts: the attention index without any repacking).

        `prev` is the output of stage first-1 (required when first > 0). No device-to-host sync.
        `keep` = (cached outputs of every stage, (nb,) first stage each block recomputes): a block whose first stage
        is past i keeps its cached output of stage i, and the next stage builds on whichever output the block kept
        (a captured decode step recomputes from the batch's earliest stage; see sparse/graph.py). A stage refreshed at
        every step (interval 1) is recomputed by every row that selects, so its output is never kept (two ops per
        layer fewer in each step of the default (8, 4, 1); a row that does not select in the layer reads every key
        block or attends densely there, and its cache starts afresh once it selects: graph.py's `step`).
        `lookahead`: each recomputed stage's survivors plus their next `lookahead` chunks (`lookahead_chunks`; the
        decode steps pass the config's, prefill none), so C_i is (1 + lookahead) times the survivors' width.
        `last_out`: (ids, counts) the last stage's top-k writes into (`graph_select`'s `out`: a captured step's index
        rows; the stage must be refreshed at every step, without lookahead); its output is then not in the list.
        `ahead`: at a decode step that recomputes stage 0 with the config's `ahead`, its kept output
        (`stage0_ahead`); the returned stage-0 output is then the one the next stages used.
        """
        cfg = self.cfg
        dev = q.device
        blocks = BlockQueries.build(blocks, dev)
        if isinstance(keys, torch.Tensor):
            keys = SequenceKeys.from_dense(keys)
        cand_end = self.candidate_end(blocks.ends) if blocks.cand_end is None else blocks.cand_end  # (nb,) exclusive
        budgets = self.stage_budgets(layer)
        widths = self.stage_widths(layer, blocks.max_end, lookahead)
        nb, G = blocks.num_blocks, self.groups
        outs = []
        prefetch = None  # `ahead`: stage 1's chunks of this refresh's stage 0, for the store to copy in
        runs = None  # (candidate ids, their scores per run of the next stage's chunk size): `runs_for_next`
        ci = self.rope_mode(layer, "prune") == "ci"
        for i in range(first, len(cfg.chunk_sizes)):
            l = cfg.chunk_sizes[i]
            width, needs_scores = widths[i]
            if i == 0:
                def stage0_ids(l=l, width=width):
                    lo = cfg.n_sink // l
                    hi = torch.div(cand_end + (l - 1), l, rounding_mode="floor")  # chunks that start before cand_end
                    ids = self.arange(lo + width, dev)[lo:]  # lo, lo + 1, ...: a view of a kept buffer, no kernel
                    return torch.where(ids[None, :] < hi[:, None], ids[None, :], -1)[:, None, :].expand(nb, G, width)

                # the same in every layer of a graph decode step (its blocks and candidate end are the step's)
                ids = blocks.shared(("stage0_ids", l, width, G), stage0_ids)
            else:
                # the survivors' sub-chunks; a dropped survivor (-1) gives negative ids, which no scorer scores
                # (-inf) and top_k never keeps, as it would -1 (and ci's count of candidates counts ids >= 0)
                ratio = cfg.chunk_sizes[i - 1] // l
                ids = torch.add(self.arange(ratio, dev, prev.dtype), prev[..., None], alpha=ratio).reshape(nb, G, -1)
            if needs_scores and i == 0 and cfg.stage0_scores != "selectrep" and l > cfg.exact_below:
                score = self.box_scores(layer, q, blocks, keys, ids, l, cand_end)
            elif needs_scores:
                if i == 1 and first == 0 and keys.install is not None:
                    # stage 0 was rescored from the whole context: its survivors are mostly new, and the store installs
                    # their pages now, so that their keys cross PCIe once and stage 1 reads them from the GPU
                    # (kvcache/offload.py `install_reads`); later stages' candidates are sub-chunks of these
                    keys.install(ids, l)
                    if prefetch is not None:  # after stage 1's installs, so that none of its pages is a victim
                        keys.install(prefetch, l, ahead=True)
                if runs is not None:  # every key of these chunks was scored by the stage before: no read
                    # (runs_for_next set them only for a next stage that scores exactly: this one)
                    score = self.scores_from_runs(ids, *runs, cfg.chunk_sizes[i - 1] // l)
                    runs = None  # this stage read no keys: nothing for the one after
                else:
                    sub = self.runs_for_next(i, widths, keep, lookahead, ahead, ci)
                    score = self.chunk_scores(layer, q, blocks, keys, ids, l, l <= cfg.exact_below, cand_end, sub=sub,
                                              stride=cfg.query_strides[i])
                    if sub is not None:
                        runs = (ids, score)
                        score = score.reshape(nb, G, -1, l // sub).amax(-1)
                    if keys.probes is not None and i > 0:  # the keys it just read, for the store (SequenceKeys.probes);
                        keys.probes(ids, l)  # stage 0's candidates are the whole context: never installed for it
            else:  # every candidate fits the budget
                _, _, valid = chunk_bounds(ids, l, cfg.n_sink, cand_end)
                score = torch.where(valid, 0.0, float("-inf"))
            k = budgets[i] // l
            if keep is None:  # no static width to match: never wider than the candidates (a budget of 1M tokens)
                k = min(k, max(1, width))
            # every scorer gives an invalid candidate (chunk_bounds) -inf, which top_k never keeps: its id needs no
            # masking to -1 first
            if last_out is not None and i == len(cfg.chunk_sizes) - 1:
                if lookahead or not self.refreshed_every_step(i):
                    raise ValueError("last_out needs a last stage refreshed at every step, without lookahead")
                self.top_k(ids, score, k, out=last_out)
                break
            prev, counts = self.top_k(ids, score, k)
            if i == 0 and ahead is not None and first == 0:
                kept = None if keep is None else (keep[1] > 0)[:, None, None]
                prev, prefetch = self.stage0_ahead(prev, ahead, kept)
            if lookahead:
                prev = self.lookahead_chunks(prev, l, cand_end, lookahead)
            if keep is not None and not self.refreshed_every_step(i):
                prev = torch.where((keep[1] > i)[:, None, None], keep[0][i], prev)
            if return_counts and (keep is not None or lookahead):
                counts = (prev >= 0).sum(-1, dtype=torch.int32)
            outs.append(prev)
        return (outs, counts) if return_counts else outs
