"""Sampling: filters, distribution, seeded determinism; stop strings, stop tokens, EOS, max/min tokens."""
import pytest
import torch

from longreach import SamplingParams
from longreach.engine.llm import LLM
from longreach.engine.sampler import Sampler, seeded_generator
from longreach.engine.sequence import Sequence


def _seqs(params_list, seeded=False):
    seqs = []
    for i, p in enumerate(params_list):
        s = Sequence(i, str(i), 0, [1], p, frozenset(), 10)
        if seeded:
            s.generator = seeded_generator(p.seed, 0, torch.device("cpu"))
        seqs.append(s)
    return seqs


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=2.0, top_p=1e-6), SamplingParams(temperature=1.0, min_p=1.0),
              SamplingParams(temperature=0, top_k=3)]
    assert Sampler(torch.device("cpu"), 0)(logits, _seqs(params)) == logits.argmax(-1).tolist()


def test_sample_frequencies_follow_temperature_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    sampler = Sampler(torch.device("cpu"), 0)
    p = SamplingParams(temperature=0.7)
    counts = torch.zeros(5)
    n = 6000
    for _ in range(n // 200):
        toks = sampler(logits.expand(200, 5).contiguous(), _seqs([p] * 200))
        counts += torch.bincount(torch.tensor(toks), minlength=5)
    expected = torch.softmax(logits[0] / 0.7, -1) * n
    assert ((counts - expected).abs() <= 4 * expected.sqrt() + 5).all(), (counts, expected)


def test_top_k_top_p_min_p_never_sample_outside_their_sets():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, -2.0]])
    probs = torch.softmax(logits[0], -1)
    sampler = Sampler(torch.device("cpu"), 1)
    cases = [(SamplingParams(top_k=2), {0, 1}),
             (SamplingParams(top_p=float(probs[:2].sum()) - 1e-4), {0, 1}),  # two tokens reach the mass
             (SamplingParams(min_p=float(probs[2] / probs[0]) - 1e-4), {0, 1, 2})]
    for params, allowed in cases:
        toks = sampler(logits.expand(400, 6).contiguous(), _seqs([params] * 400))
        assert set(toks) == allowed, (params, set(toks))


def test_seeded_rows_ignore_their_batch_companions():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, seed=123)
    other = SamplingParams(temperature=1.0)
    alone = [Sampler(torch.device("cpu"), 0)(logits[2:3], _seqs([p], seeded=True))[0] for _ in range(3)]
    batch_seqs = _seqs([other, other, p, other])
    batch_seqs[2].generator = seeded_generator(123, 0, torch.device("cpu"))
    mixed = Sampler(torch.device("cpu"), 99)(logits, batch_seqs)[2]
    assert alone[0] == alone[1] == alone[2] == mixed


@pytest.fixture(scope="module")
def llm(smollm2):
    out = LLM.__new__(LLM)
    out.engine, out.config = smollm2, smollm2.config
    return out


def test_seeded_generation_is_deterministic_across_batches(llm):
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=20)
    a = llm.generate("Tell me a story about a dragon.", p, use_tqdm=False)[0].token_ids
    b = llm.generate(["Write a poem.", "Tell me a story about a dragon.", "Hi"],
                     [SamplingParams(temperature=1.0, max_tokens=20), p, SamplingParams(max_tokens=5)],
                     use_tqdm=False)[1].token_ids
    c = llm.generate("Tell me a story about a dragon.", SamplingParams(temperature=0.9, top_p=0.95, seed=43,
                                                                       max_tokens=20), use_tqdm=False)[0].token_ids
    assert a == b
    assert a != c


def test_stop_string_cuts_the_text(llm):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    full = llm.chat(q, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert full.text == "The capital of France is Paris."
    cut = llm.chat(q, SamplingParams(temperature=0, max_tokens=20, stop=["France"]), use_tqdm=False)[0].outputs[0]
    assert cut.text == "The capital of " and cut.finish_reason == "stop" and cut.stop_reason == "France"
    kept = llm.chat(q, SamplingParams(temperature=0, max_tokens=20, stop=["is P", "zzz"],
                                      include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == "The capital of France is P" and kept.stop_reason == "is P"


def test_stop_token_ids_max_tokens_and_eos(llm):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    full = llm.chat(q, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    third = full.token_ids[2]
    out = llm.chat(q, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[third]), use_tqdm=False)[0]
    assert out.token_ids == full.token_ids[:3] and out.outputs[0].stop_reason == third
    short = llm.chat(q, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert short.token_ids == full.token_ids[:3] and short.outputs[0].finish_reason == "length"
    # EOS (<|im_end|>) ends the answer and is not in the text; ignore_eos / min_tokens go past it
    assert full.token_ids[-1] == 2 and full.outputs[0].stop_reason is None
    longer = llm.chat(q, SamplingParams(temperature=0, max_tokens=len(full.token_ids) + 4, ignore_eos=True),
                      use_tqdm=False)[0]
    assert len(longer.token_ids) == len(full.token_ids) + 4 and longer.token_ids[:len(full.token_ids)] == full.token_ids
    at_least = llm.chat(q, SamplingParams(temperature=0, max_tokens=30, min_tokens=len(full.token_ids) + 2),
                        use_tqdm=False)[0]
    assert len(at_least.token_ids) >= len(full.token_ids) + 2
