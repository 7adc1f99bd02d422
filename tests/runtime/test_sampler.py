"""The sampler: greedy, each filter, penalties, min_tokens, logprobs and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch
from kvfleet_runtime.layers.sampler import (
    SampledToken,
    Sampler,
    SamplingBatch,
    _top_k_top_p,
    apply_penalties,
    make_generator,
)
from kvfleet_runtime.sampling_params import SamplingParams
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

VOCAB = 64
# the GPU runs repeat the CPU checks where kernels differ: CUDA generators, sort, scatter
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def make_batch(params: list[SamplingParams], outputs: list[list[int]] | None = None,
               prompts: list[list[int]] | None = None, device: str = "cpu") -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params=params,
                         prompt_token_ids=prompts or [[1, 2, 3]] * n,
                         output_token_ids=outputs or [[] for _ in range(n)],
                         generators=[make_generator(p.seed, device) for p in params])


def sample_many(probs: list[float], num: int, device: str = "cpu", **knobs) -> list[int]:
    """`num` independent draws from one distribution, as `num` rows of one batch."""
    logits = torch.tensor(probs, device=device).log().expand(num, -1).contiguous()
    torch.manual_seed(0)
    batch = make_batch([SamplingParams(**knobs)] * num, device=device)
    return [t.token_id for t in Sampler()(logits, batch)]


def chi_square(drawn: list[int], probs: list[float]) -> float:
    observed = torch.bincount(torch.tensor(drawn), minlength=len(probs)).tolist()
    return sum((o - len(drawn) * p) ** 2 / (len(drawn) * p)
               for o, p in zip(observed, probs, strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device):
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    out = Sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * 8, device=device))
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()


def test_greedy_rows_amid_random_rows_keep_their_argmax():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = Sampler()(logits, make_batch(params))
    argmax = logits.argmax(dim=-1).tolist()
    assert [out[i].token_id for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_logits_sample_as_their_fp32_widening(device, monkeypatch):
    # the model hands over logits in its own dtype; greedy rows without penalties take the
    # argmax as they are (never widened), every other path computes in fp32
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(6, VOCAB, generator=gen) * 4).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1      # a tie: the first index wins
    logits = logits.to(device)
    widened = logits.float()
    import kvfleet_runtime.layers.sampler as sampler_module
    seen = []
    real = sampler_module.greedy_argmax
    monkeypatch.setattr(sampler_module, "greedy_argmax", lambda x: seen.append(x.dtype) or real(x))
    sampler = Sampler()
    greedy = make_batch([SamplingParams(temperature=0.0)] * 6, device=device)
    ids, logprobs = sampler.sample_on_device(logits, greedy)
    assert logprobs is None and seen == [torch.bfloat16]
    assert ids.tolist() == widened.argmax(dim=-1).tolist() and ids[0].item() == 7
    # a penalty: processed in fp32 (the bf16 subtraction 2.9 - 1.0 would round differently)
    penalised = make_batch([SamplingParams(temperature=0.0, frequency_penalty=0.01)] * 6,
                           outputs=[[int(i)] for i in widened.argmax(dim=-1)], device=device)
    reference = widened.clone()
    reference[torch.arange(6), widened.argmax(dim=-1)] -= 0.01
    ids, _ = sampler.sample_on_device(logits, penalised)
    assert seen[-1] == torch.float32 and ids.tolist() == reference.argmax(dim=-1).tolist()
    # logprobs and random rows: under the fp32 widening
    mixed = make_batch([SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=3)] * 3,
                       device=device)
    ids, logprobs = sampler.sample_on_device(logits, mixed)
    chosen = torch.log_softmax(widened, -1).gather(1, ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(logprobs.chosen, chosen)
    assert ids[0].item() == 7 and ids[2].item() == widened[2].argmax().item()


def test_fused_draw_serves_temperature_only_batches(monkeypatch):
    # the sampler's one-kernel draw (kvfleet_kernels.argmax.sample_rows; GPU only, forced here
    # into the interpreter): greedy rows keep their argmax, after their penalties; random rows
    # follow softmax(x / T)
    import kvfleet_runtime.layers.sampler as sampler_module
    monkeypatch.setattr(sampler_module, "fused_draw", lambda *a: True)
    logits = torch.tensor([[0.3, -1.0, 1.2, 0.0]]).expand(400, -1).contiguous()
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)] + [SamplingParams()] * 399
    torch.manual_seed(0)
    ids, _ = Sampler().sample_on_device(logits, make_batch(params, outputs=[[2]] * 400))
    assert ids[0].item() == 0                # 1.2 - 2.0 (one earlier 2) < 0.3
    assert chi_square(ids[1:].tolist(), torch.softmax(logits[0], 0).tolist()) < 16.3   # unpenalised


def test_fused_draw_takes_only_what_it_implements():
    from kvfleet_runtime.layers.sampler import fused_draw
    cpu = torch.zeros(2, VOCAB)
    assert not fused_draw(cpu, [SamplingParams()] * 2, [None, None])     # a GPU kernel
    if not torch.cuda.is_available():
        return
    gpu = cpu.cuda()
    assert fused_draw(gpu, [SamplingParams(temperature=0.7), SamplingParams(temperature=0)],
                      [None, None])
    assert fused_draw(gpu, [SamplingParams(top_k=VOCAB)] * 2, [None, None])
    for p in (SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(min_p=0.1)):
        assert not fused_draw(gpu, [p, SamplingParams()], [None, None])
    assert not fused_draw(gpu, [SamplingParams(seed=1)] * 2, [make_generator(1, "cuda"), None])


def test_low_temperature_sampling_equals_greedy():
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    greedy = Sampler()(logits, make_batch([SamplingParams(temperature=0.0)] * 16))
    cold = Sampler()(logits, make_batch([SamplingParams(temperature=1e-3)] * 16))
    assert [t.token_id for t in cold] == [t.token_id for t in greedy]


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_2_never_samples_the_third(device):
    drawn = sample_many([0.4, 0.35, 0.25], 3000, device, top_k=2)
    assert set(drawn) == {0, 1}


@pytest.mark.parametrize(("top_p", "allowed"), [(0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
@pytest.mark.parametrize("device", DEVICES)
def test_top_p_keeps_the_smallest_set_holding_top_p(top_p, allowed, device):
    assert set(sample_many([0.5, 0.3, 0.15, 0.05], 3000, device, top_p=top_p)) == allowed


def reference_top_k_top_p(row: torch.Tensor, k: int, p: float) -> set[int]:
    """The kept ids, the slow way: k best, then the fewest of those holding p of their mass."""
    best = row.topk(k).indices.tolist()
    probs = torch.softmax(row[best], dim=0).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(best, probs, strict=True):
        kept.append(token)
        mass += prob
        if mass >= p:
            break
    return set(kept)


def test_top_k_top_p_filter_matches_a_reference_on_both_paths():
    vocab = 4096                      # larger than the top-k candidate limit: rows off it sort
    x = torch.randn(2, vocab, generator=torch.Generator().manual_seed(7)) * 3
    few = _top_k_top_p(x[:1], [40], [0.8])                          # topk candidates
    mixed = _top_k_top_p(x, [40, vocab], [0.8, 0.9])                # full sort
    for filtered in (few[0], mixed[0]):
        assert set(torch.isfinite(filtered).nonzero().flatten().tolist()) == \
            reference_top_k_top_p(x[0], 40, 0.8)
    assert set(torch.isfinite(mixed[1]).nonzero().flatten().tolist()) == \
        reference_top_k_top_p(x[1], vocab, 0.9)
    kept = torch.isfinite(few[0])
    assert torch.equal(few[0][kept], x[0][kept]), "kept logits are left as they were"


@pytest.mark.parametrize(("min_p", "allowed"), [(0.2, {0, 1, 2}), (0.5, {0, 1})])
def test_min_p_drops_tokens_below_min_p_times_the_top(min_p, allowed):
    assert set(sample_many([0.5, 0.3, 0.15, 0.05], 3000, min_p=min_p)) == allowed


def test_top_k_then_top_p_renormalise_between_them():
    # after top_k=3 the mass is [0.4, 0.3, 0.2] / 0.9, so {0, 1} holds 0.78 >= top_p
    # (without renormalising it would hold 0.7 and token 2 would survive)
    assert set(sample_many([0.4, 0.3, 0.2, 0.1], 3000, top_k=3, top_p=0.75)) == {0, 1}


@pytest.mark.parametrize("device", DEVICES)
def test_sampling_at_temperature_one_follows_the_distribution(device):
    probs = [0.3, 0.25, 0.2, 0.15, 0.07, 0.03]
    chi2 = chi_square(sample_many(probs, 20000, device), probs)
    assert chi2 < 25.0  # 5 degrees of freedom: p(chi2 > 25) ~ 1e-4


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_follow_the_distribution(device):
    probs = [0.5, 0.3, 0.2]
    num = 3000
    logits = torch.tensor(probs, device=device).log().expand(num, -1).contiguous()
    batch = make_batch([SamplingParams(seed=i) for i in range(num)], device=device)
    chi2 = chi_square([t.token_id for t in Sampler()(logits, batch)], probs)
    assert chi2 < 20.0  # 2 degrees of freedom: p(chi2 > 20) ~ 5e-5


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    batch = make_batch([params], outputs=[[1, 3, 3]], prompts=[[0]])
    out = apply_penalties(logits, batch)
    expected = [2.0 / 1.5,                       # prompt token: repetition only
                -1.0 * 1.5 - 0.5 * 1 - 0.25,     # output once: negative logit is multiplied
                0.5,                             # unseen
                3.0 / 1.5 - 0.5 * 2 - 0.25,      # output twice
                -2.0, 1.0]
    torch.testing.assert_close(out[0], torch.tensor(expected), atol=1e-6, rtol=0)
    assert logits[0, 0] == 2.0, "the raw logits must stay untouched"


def test_repetition_penalty_matches_hf_processor():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, VOCAB, generator=gen) * 4
    prompts = [torch.randint(0, VOCAB, (12,), generator=gen).tolist() for _ in range(3)]
    outputs = [torch.randint(0, VOCAB, (5,), generator=gen).tolist() for _ in range(3)]
    params = [SamplingParams(repetition_penalty=1.3)] * 3
    ours = apply_penalties(logits, make_batch(params, outputs=outputs, prompts=prompts))
    hf = RepetitionPenaltyLogitsProcessor(penalty=1.3)
    for i in range(3):
        ids = torch.tensor([prompts[i] + outputs[i]])
        torch.testing.assert_close(ours[i:i + 1], hf(ids, logits[i:i + 1].clone()),
                                   atol=1e-6, rtol=0)


def test_penalty_changes_the_greedy_choice_but_not_the_raw_logprob():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=1)
    [tok] = Sampler()(logits, make_batch([params], outputs=[[0]]))
    assert tok.token_id == 1
    assert tok.logprob == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item(), abs=1e-6)
    assert tok.rank == 2


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_masks_eos_and_stop_token_ids_until_reached(device):
    eos, stop = 5, 7
    logits = torch.zeros(1, VOCAB)
    logits[0, eos], logits[0, stop], logits[0, 9] = 10.0, 9.0, 8.0
    logits = logits.to(device)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    params._eos_token_ids = {eos}
    sampler = Sampler()
    for output, expected in [([1], 9), ([1, 2], 9), ([1, 2, 3], eos)]:
        batch = make_batch([params], outputs=[output], device=device)
        assert sampler(logits, batch)[0].token_id == expected


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_adds_to_the_logits_and_steers_greedy_but_not_the_raw_logprob(device):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7)).to(device)
    low = logits[0].argmin().item()
    params = [SamplingParams(temperature=0.0, logit_bias={low: 100.0}, logprobs=0),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={3: -2.5, 4: 1.25})]
    batch = make_batch(params, device=device)
    processed = apply_penalties(logits, batch)
    expected = logits.clone()
    expected[0, low] += 100.0
    expected[2, 3] -= 2.5
    expected[2, 4] += 1.25
    torch.testing.assert_close(processed, expected, atol=1e-5, rtol=0)
    out = Sampler()(logits, batch)
    assert [t.token_id for t in out] == expected.argmax(dim=-1).tolist()
    assert out[0].token_id == low
    assert out[0].logprob == pytest.approx(
        torch.log_softmax(logits[0].float(), -1)[low].item(), abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_of_minus_100_bans_a_token_from_random_draws(device):
    probs = [0.5, 0.3, 0.2]
    drawn = sample_many(probs, 400, device=device, logit_bias={0: -100.0})
    assert 0 not in drawn and set(drawn) == {1, 2}


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids_confine_greedy_and_random_rows(device):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(8)).to(device)
    allowed = [5, 17, 40]
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.0, seed=3, allowed_token_ids=allowed),
              SamplingParams(temperature=0.9, allowed_token_ids=allowed, logit_bias={40: 50.0}),
              SamplingParams(temperature=0.0)]
    out = [t.token_id for t in Sampler()(logits, make_batch(params, device=device))]
    assert out[0] == allowed[int(logits[0, allowed].argmax())]
    assert out[1] in allowed
    assert out[2] == 40
    assert out[3] == int(logits[3].argmax())


def test_logit_bias_and_allowed_token_ids_are_checked():
    with pytest.raises(ValueError, match=r"logit_bias must be biases in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 150})
    with pytest.raises(ValueError, match="logit_bias must be a map of token ids"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    params = SamplingParams(logit_bias={3: 1.0, 99: 2.0}, allowed_token_ids=[1, 64])
    with pytest.raises(ValueError, match=r"logit_bias must name token ids in \[0, 64\); got \[99\]"):
        params.check_token_ids(64)
    params.logit_bias = None
    with pytest.raises(ValueError, match=r"allowed_token_ids .* got \[64\]"):
        params.check_token_ids(64)
    params.check_token_ids(65)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_ranks_and_top_k_match_log_softmax(device):
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, VOCAB, generator=gen) * 2
    params = [SamplingParams(logprobs=5), SamplingParams(logprobs=0, temperature=0.0),
              SamplingParams(logprobs=None), SamplingParams(logprobs=3, top_k=4, seed=1),
              SamplingParams(logprobs=20, repetition_penalty=1.8),
              SamplingParams(logprobs=1, temperature=0.5)]
    out = Sampler()(logits.to(device), make_batch(params, outputs=[[0, 1, 2]] * 6, device=device))
    reference = torch.log_softmax(logits, dim=-1)
    for i, (tok, p) in enumerate(zip(out, params, strict=True)):
        row = reference[i]
        assert tok.logprob == pytest.approx(row[tok.token_id].item(), abs=1e-6)
        if p.logprobs is None:
            assert tok.rank is None and tok.top_ids is None
            continue
        assert tok.rank == int((row > row[tok.token_id]).sum()) + 1
        values, ids = row.topk(p.logprobs)
        assert tok.top_ids == ids.tolist()
        assert tok.top_logprobs == pytest.approx(values.tolist(), abs=1e-6)
    assert out[1].rank == 1


def test_prompt_logprobs_score_the_next_prompt_token():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(6))
    next_ids = [3, 17, 0, 63]
    out = Sampler().prompt_logprobs(logits, next_ids, k=2)
    reference = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(out):
        assert tok.token_id == next_ids[i]
        assert tok.logprob == pytest.approx(reference[i, next_ids[i]].item(), abs=1e-6)
        assert tok.rank == int((reference[i] > reference[i, next_ids[i]]).sum()) + 1
        assert tok.top_ids == reference[i].topk(2).indices.tolist()


def seeded_run(position: int, companions: list[SamplingParams], seed: int, device: str,
               vocab: int, steps: int = 20) -> list[int]:
    """Sample `steps` tokens for one seeded row placed at `position` among `companions`."""
    target = SamplingParams(seed=seed, temperature=0.9, top_p=0.95)
    params = companions[:position] + [target] + companions[position:]
    batch = make_batch(params, device=device)       # generators live as long as the request
    noise = torch.Generator().manual_seed(99)
    tokens: list[int] = []
    for _ in range(steps):
        logits = torch.randn(len(params), vocab, generator=noise)
        logits[position] = torch.randn(vocab, generator=torch.Generator().manual_seed(len(tokens)))
        out: list[SampledToken] = Sampler()(logits.to(device), batch)
        tokens.append(out[position].token_id)
        for row, tok in zip(batch.output_token_ids, out, strict=True):
            row.append(tok.token_id)
    return tokens


# on the GPU: a real vocabulary and 63 companions, where kernels may pick other launch shapes
@pytest.mark.parametrize(("device", "vocab", "repeat"),
                         [("cpu", VOCAB, 1), pytest.param("cuda", 49152, 9, marks=pytest.mark.gpu)])
def test_seeded_row_is_reproducible_regardless_of_batch_composition(device, vocab, repeat):
    companions = [SamplingParams(), SamplingParams(seed=7), SamplingParams(temperature=0.0),
                  SamplingParams(top_k=5, seed=8), SamplingParams(min_p=0.1),
                  SamplingParams(repetition_penalty=1.2, seed=9), SamplingParams(top_p=0.5)]
    alone = seeded_run(0, [], 1234, device, vocab)
    torch.manual_seed(123)                    # the unseeded companions draw from the global RNG
    amid = seeded_run(3, companions * repeat, 1234, device, vocab)
    assert alone == amid
    assert seeded_run(0, [], 4321, device, vocab) != alone, "another seed, another sequence"


def test_mismatched_batch_is_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="generators"):
        SamplingBatch(params=[SamplingParams()], prompt_token_ids=[[1]],
                      output_token_ids=[[]], generators=[])
    with pytest.raises(ValueError, match="2 rows"):
        Sampler()(torch.zeros(2, VOCAB), make_batch([SamplingParams()]))


def test_empty_batch_samples_nothing():
    assert Sampler()(torch.zeros(0, VOCAB), make_batch([])) == []


def test_sampling_params_clone_is_equal_and_shares_no_mutable_state():
    p = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["x", "yz"], stop_token_ids=[7],
                       max_tokens=9, logprobs=2, logit_bias={1: 2.0}, allowed_token_ids=[1, 2])
    p._eos_token_ids = {2}
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("w")
    c.stop_token_ids.append(8)
    c._eos_token_ids.add(4)
    c.logit_bias[5] = 1.0
    c.allowed_token_ids.append(5)
    c.max_tokens = 3
    assert p.stop == ["x", "yz"] and p.stop_token_ids == [7] and p._eos_token_ids == {2}
    assert p.logit_bias == {1: 2.0} and p.allowed_token_ids == [1, 2]
    assert p.max_tokens == 9
