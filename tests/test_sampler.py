"""SamplingParams validation and the batched sampler, checked against hand-computed formulas."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_engine.sampler import (Sampler, SamplingRow, apply_penalties, greedy_token_ids, greedy_tokens,
                                   mask_banned_tokens, position_uniform, processed_probs)
from hybrid_engine.sampling_params import SamplingParams

VOCAB = 32
# Five tokens with known probabilities, so top-p and min-p cut points can be read off.
P5 = torch.tensor([0.05, 0.3, 0.1, 0.4, 0.15])
LOGITS5 = P5.log()

# chi-square critical values at alpha = 0.001, by degrees of freedom
CHI2_CRIT = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def make_row(prompt=(), output=(), seed=0, position=0, banned=(), **params):
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), seed, position, list(banned))


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def expected_from_kept(logits, kept):
    """softmax of `logits` restricted to the indices in `kept`."""
    out = torch.zeros_like(logits)
    idx = torch.tensor(sorted(kept))
    out[idx] = logits[idx].softmax(-1)
    return out


# ---------------------------------------------------------------- SamplingParams


def test_defaults_are_vllms_and_valid():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.ignore_eos, p.logprobs) == (16, 0, None, False, None)
    assert p.stop == [] and p.stop_token_ids == []
    p.validate(VOCAB)


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_boundary_values_are_valid():
    SamplingParams(
        temperature=0, top_p=1.0, top_k=VOCAB + 10, min_p=1.0, repetition_penalty=0.01,
        presence_penalty=-2, frequency_penalty=2, max_tokens=1, min_tokens=1, seed=0,
        stop=["x"], stop_token_ids=[0, VOCAB - 1], logprobs=0,
    ).validate(VOCAB)
    SamplingParams(top_k=1, min_p=0.0, seed=2**64 - 1, logprobs=VOCAB).validate(VOCAB)


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    assert not SamplingParams().is_greedy


NAN, INF = float("nan"), float("inf")
INVALID = [
    ("temperature", -0.1), ("temperature", NAN), ("temperature", INF), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", NAN),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", NAN),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", NAN),
    ("repetition_penalty", INF),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", NAN),
    ("frequency_penalty", 2.01), ("frequency_penalty", -3.0), ("frequency_penalty", NAN),
    ("max_tokens", 0), ("max_tokens", 4.0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", 1.0),
    ("seed", 1.5), ("seed", True), ("seed", "7"), ("seed", 2**64),
    ("stop", ["ok", ""]), ("stop", [3]), ("stop", 5),
    ("stop_token_ids", [VOCAB]), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("ignore_eos", "yes"),
    ("logprobs", -1), ("logprobs", 1.0), ("logprobs", VOCAB + 1),
]


@pytest.mark.parametrize("field,value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_field_is_named_in_the_error(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=rf"^{field} ") as err:
        params.validate(VOCAB)
    assert repr(getattr(params, field)) in str(err.value)


def test_empty_stop_string_is_invalid():
    with pytest.raises(ValueError, match=r"^stop .*\[''\]"):
        SamplingParams(stop="").validate(VOCAB)


def test_bad_vocab_size_is_named():
    with pytest.raises(ValueError, match="^vocab_size "):
        SamplingParams().validate(0)


# ---------------------------------------------------------------- greedy


def test_greedy_rows_take_the_argmax_in_fast_and_mixed_batches():
    logits = torch.randn(5, VOCAB, generator=seeded(0))
    greedy = [
        make_row(temperature=0.0), make_row(temperature=0.9, top_k=1), make_row(temperature=1e-7),
        make_row(temperature=0.0, top_p=0.1), make_row(temperature=0.0, min_p=0.9),
    ]
    argmax = logits.argmax(-1).tolist()
    assert Sampler()(logits, greedy).token_ids == argmax
    mixed = greedy + [make_row(temperature=1.0)]
    mixed_logits = torch.cat([logits, torch.randn(1, VOCAB)])
    assert Sampler()(mixed_logits, mixed).token_ids[:5] == argmax
    probs = processed_probs(logits, greedy)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


# ---------------------------------------------------------------- each transform against its formula


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-1.5, 0.0, 2.0, 2.0, float("inf"), float("-inf"), float("nan")]),
                         min_size=1, max_size=9), min_size=1, max_size=4).filter(lambda rows: len({len(r) for r in rows}) == 1),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_greedy_tokens_are_torch_argmax_with_ties_infinities_and_nans(rows, dtype, transposed):
    """Both paths (numpy's argmax for float32 on CPU, torch's max elsewhere) give argmax's index:
    the first maximum on ties, a NaN as the maximum, on contiguous and strided rows."""
    logits = torch.tensor(rows, dtype=dtype)
    if transposed:                                   # the same values in a column-major tensor
        logits = logits.t().contiguous().t()
    want = torch.argmax(logits, dim=-1).tolist()
    assert greedy_tokens(logits).tolist() == want and greedy_token_ids(logits) == want


def test_temperature_scales_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.5]])
    probs = processed_probs(logits, [make_row(temperature=0.5)])
    torch.testing.assert_close(probs[0], (logits[0] / 0.5).softmax(-1))


def test_top_k_keeps_the_k_best():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.5, 1.0, 0.0, -0.5])
    probs = processed_probs(logits[None], [make_row(top_k=3)])[0]
    torch.testing.assert_close(probs, expected_from_kept(logits, {3, 0, 5}))
    everything = processed_probs(logits[None], [make_row(top_k=100)])[0]
    torch.testing.assert_close(everything, logits.softmax(-1))


def test_top_p_of_one_keeps_the_whole_tail_despite_cumsum_rounding():
    # the float32 cumsum of many small probabilities reaches 1.0 before the last token
    logits = torch.randn(2, 2000, generator=seeded(0)) * 5
    probs = processed_probs(logits, [make_row(top_k=1500), make_row(top_p=1.0, top_k=-1)])
    assert (probs[0] > 0).sum() == 1500
    assert (probs[1] > 0).all()


@pytest.mark.parametrize("top_p,kept", [(0.3, {3}), (0.65, {3, 1}), (0.75, {3, 1, 4}), (0.96, {0, 1, 2, 3, 4})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    # sorted probabilities 0.4, 0.3, 0.15, 0.1, 0.05; cumulative 0.4, 0.7, 0.85, 0.95, 1.0
    probs = processed_probs(LOGITS5[None], [make_row(top_p=top_p)])[0]
    torch.testing.assert_close(probs, expected_from_kept(LOGITS5, kept))


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # top-3 renormalised: 0.4/0.85, 0.3/0.85 = 0.82 >= 0.8 already, so 0.15 goes (on the raw
    # distribution 0.4 + 0.3 = 0.7 < 0.8 would have kept it)
    probs = processed_probs(LOGITS5[None], [make_row(top_k=3, top_p=0.8)])[0]
    torch.testing.assert_close(probs, expected_from_kept(LOGITS5, {3, 1}))


@pytest.mark.parametrize(
    "min_p,kept",
    [(0.76, {3}), (0.74, {3, 1}), (0.5, {3, 1}), (0.3, {3, 1, 4}), (0.2, {3, 1, 4, 2}), (0.0, {0, 1, 2, 3, 4})],
)
def test_min_p_drops_tokens_below_min_p_times_the_max(min_p, kept):
    probs = processed_probs(LOGITS5[None], [make_row(min_p=min_p)])[0]
    torch.testing.assert_close(probs, expected_from_kept(LOGITS5, kept))


def test_min_p_uses_the_temperature_scaled_distribution():
    # at temperature 2 the probabilities go as sqrt(P5): .22 .55 .32 .63 .39; 0.6 * .63 = .38
    probs = processed_probs(LOGITS5[None], [make_row(temperature=2.0, min_p=0.6)])[0]
    torch.testing.assert_close(probs, expected_from_kept(LOGITS5 / 2, {3, 1, 4}))


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.5, 1.0]])
    row = make_row(prompt=[0, 1], output=[1, 4, 4], repetition_penalty=2.0)
    expected = torch.tensor([[1.0, -2.0, 0.5, 3.0, -5.0, 1.0]])
    torch.testing.assert_close(apply_penalties(logits, [row]), expected)
    torch.testing.assert_close(processed_probs(logits, [row]), expected.softmax(-1))


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.5, 1.0]])
    row = make_row(prompt=[0, 3, 3], output=[1, 4, 4, 2], frequency_penalty=0.5, presence_penalty=0.25)
    expected = torch.tensor([[2.0, -1.75, -0.25, 3.0, -3.75, 1.0]])
    torch.testing.assert_close(apply_penalties(logits, [row]), expected)


def test_penalties_combine_per_row_and_leave_the_input_alone():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.5, 1.0]]).repeat(2, 1)
    before = logits.clone()
    rows = [
        make_row(prompt=[0, 3], output=[1, 4, 4, 2], repetition_penalty=2.0,
                 frequency_penalty=0.5, presence_penalty=0.25),
        make_row(prompt=[0, 3], output=[1, 4, 4, 2]),
    ]
    out = apply_penalties(logits, rows)
    # repetition first (over prompt + output), then frequency and presence (output only)
    torch.testing.assert_close(out[0], torch.tensor([1.0, -2.75, -0.5, 1.5, -6.25, 1.0]))
    torch.testing.assert_close(out[1], before[1])
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- sampling statistics

STAT_CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=3),
    "top_p": dict(top_p=0.75),
    "min_p": dict(min_p=0.3, temperature=1.5),
    "penalties": dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3),
}


def chi_square_check(tokens, probs):
    n = len(tokens)
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    expected = n * probs[support].double()
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    df = int(support.sum()) - 1
    assert stat < CHI2_CRIT[df], f"chi-square {stat:.1f} with {df} df"


@pytest.mark.parametrize("case", STAT_CASES)
def test_sampled_frequencies_follow_processed_probs(case):
    n = 4000
    rows = [make_row(prompt=[3], output=[1, 1, 4], seed=i, **STAT_CASES[case]) for i in range(n)]
    logits = LOGITS5.expand(n, -1)
    probs = processed_probs(LOGITS5[None], rows[:1])[0]
    chi_square_check(Sampler()(logits, rows).token_ids, probs)


@pytest.mark.parametrize("across", ["seeds", "positions"])
def test_position_keyed_draws_follow_the_distribution(across):
    """Many seeds at one position, and one seed over many positions (a request's own stream)."""
    n = 4000
    rows = [make_row(seed=i if across == "seeds" else 5, position=0 if across == "seeds" else i,
                     top_p=0.9, temperature=0.8) for i in range(n)]
    probs = processed_probs(LOGITS5[None], rows[:1])[0]
    chi_square_check(Sampler()(LOGITS5.expand(n, -1), rows).token_ids, probs)


def test_position_uniform_is_a_pure_function_in_range():
    values = [position_uniform(seed, p) for seed in (0, 1, 2**63, 2**64 - 1) for p in range(200)]
    assert values == [position_uniform(seed, p) for seed in (0, 1, 2**63, 2**64 - 1) for p in range(200)]
    assert all(0.0 <= u < 1.0 for u in values) and len(set(values)) == len(values)
    assert abs(sum(values) / len(values) - 0.5) < 0.05
    assert position_uniform(-1, 3) == position_uniform(2**64 - 1, 3)    # the seed is taken mod 2**64


# ---------------------------------------------------------------- reproducibility


def run_steps(batch_builder, target_position, steps=12):
    """Sample `steps` tokens for a seeded target row placed inside a batch of other rows."""
    step_logits = torch.randn(steps, 64, generator=seeded(99)) * 2
    tokens = []
    sampler = Sampler()
    for step in range(steps):
        target = make_row(output=tokens, seed=1234, position=step, top_p=0.95, temperature=1.2)
        others = batch_builder(step)
        rows = others[:target_position] + [target] + others[target_position:]
        logits = torch.randn(len(rows), 64)
        logits[target_position] = step_logits[step]
        tokens.append(sampler(logits, rows).token_ids[target_position])
    return tokens


def test_seeded_row_reproduces_regardless_of_batch_and_position():
    alone = run_steps(lambda g: [], 0)
    crowded = run_steps(
        lambda step: [make_row(temperature=0.0), make_row(seed=3, position=step),
                      make_row(seed=7, position=step, top_k=5), make_row(min_p=0.2, logprobs=2)],
        2,
    )
    first = run_steps(lambda step: [make_row(seed=7, position=step, temperature=2.0), make_row(top_p=0.5)], 0)
    assert alone == crowded == first
    assert len(set(alone)) > 3  # actually sampled, not a constant


def test_a_row_draws_the_same_token_however_many_positions_the_call_samples():
    """The verifier samples positions p..p+k in one call; a plain decode samples p alone."""
    logits = torch.randn(6, VOCAB, generator=seeded(3)) * 2
    rows = [make_row(seed=11, position=40 + j, temperature=1.1, top_p=0.95) for j in range(6)]
    together = Sampler()(logits, rows).token_ids
    one_at_a_time = [Sampler()(logits[j:j + 1], rows[j:j + 1]).token_ids[0] for j in range(6)]
    assert together == one_at_a_time


# ---------------------------------------------------------------- banned tokens


def test_banned_tokens_are_never_sampled():
    n = 2000
    rows = [make_row(seed=i, banned=[3, 1]) for i in range(n)]
    tokens = Sampler()(LOGITS5.expand(n, -1), rows).token_ids
    assert not {3, 1} & set(tokens)
    assert set(tokens) == {0, 2, 4}
    probs = processed_probs(LOGITS5[None], rows[:1])[0]
    torch.testing.assert_close(probs, expected_from_kept(LOGITS5, {0, 2, 4}))


def test_banned_argmax_makes_greedy_take_the_next_best():
    rows = [make_row(temperature=0.0, banned=[3]), make_row(temperature=0.0)]
    assert Sampler()(LOGITS5.expand(2, -1), rows).token_ids == [1, 3]
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert torch.equal(mask_banned_tokens(logits, [make_row(banned=[1])]), torch.tensor([[0.0, -INF, 1.0]]))


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_top_n_plus_chosen_from_raw_logits():
    logits = torch.randn(4, VOCAB, generator=seeded(5)) * 3
    rows = [
        make_row(logprobs=3, output=[0, 0], repetition_penalty=1.7, temperature=0.5, seed=0),
        make_row(logprobs=0, temperature=1.3),
        make_row(logprobs=None),
        # the greedy pick is not among the top 1 once the top token is banned
        make_row(logprobs=1, temperature=0.0, banned=[int(logits[3].argmax())]),
    ]
    out = Sampler()(logits, rows)
    raw = logits.log_softmax(-1)
    for i, n in [(0, 3), (1, 0), (3, 1)]:
        top = set(raw[i].topk(n).indices.tolist()) if n else set()
        chosen = out.token_ids[i]
        assert set(out.logprobs[i]) == top | {chosen}
        for token, value in out.logprobs[i].items():
            assert value == pytest.approx(raw[i, token].item(), abs=1e-5)
    assert out.logprobs[2] is None
    assert len(out.logprobs[3]) == 2


def test_logits_rows_must_match_requests():
    with pytest.raises(ValueError, match="2 rows"):
        Sampler()(torch.zeros(3, VOCAB), [make_row(), make_row()])


# ---------------------------------------------------------------- support, property-based


def reference_support(logits, params, slack):
    """Tokens a row may produce, in float64; `slack` > 0 widens the top-p and min-p cut
    points (the set a float32 sampler may reach), < 0 narrows them (the set it must reach)."""
    if params.is_greedy:
        return {max(range(len(logits)), key=lambda i: logits[i])}
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    k = len(order) if params.top_k == -1 else min(params.top_k, len(order))
    weights = [math.exp((logits[i] - logits[order[0]]) / params.temperature) for i in order[:k]]
    total = sum(weights)
    kept, mass = [], 0.0
    for i, w in zip(order, weights):
        if params.top_p < 1.0 and mass >= params.top_p + slack:
            break
        kept.append((i, w / total))
        mass += w / total
    p_max = kept[0][1]
    return {i for i, p in kept if p >= (params.min_p - slack) * p_max and (slack > 0 or p > 1e-30)}


row_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.one_of(st.just(-1), st.integers(1, 14)),
    top_p=st.floats(0.05, 1.0),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_sampled_tokens_lie_in_the_allowed_support(data):
    vocab = data.draw(st.integers(2, 12), label="vocab")
    batch = data.draw(st.integers(1, 4), label="batch")
    params = data.draw(st.lists(row_params, min_size=batch, max_size=batch), label="params")
    # distinct logits, so the sorted order (and with it the support) is unambiguous
    rows_logits = [
        [v / 5 for v in data.draw(st.lists(st.integers(-40, 40), min_size=vocab, max_size=vocab, unique=True))]
        for _ in range(batch)
    ]
    seed = data.draw(st.integers(0, 2**32), label="seed")
    rows = [SamplingRow(p, [], [], seed + i) for i, p in enumerate(params)]
    logits = torch.tensor(rows_logits)

    tokens = Sampler()(logits, rows).token_ids
    probs = processed_probs(logits, rows)
    for i, (row_logits, p) in enumerate(zip(rows_logits, params)):
        may = reference_support(row_logits, p, slack=1e-4)
        must = reference_support(row_logits, p, slack=-1e-4)
        assert tokens[i] in may
        assert must <= set(probs[i].nonzero().flatten().tolist()) <= may
        assert probs[i, max(range(vocab), key=lambda t: row_logits[t])] > 0
        assert probs[i].sum().item() == pytest.approx(1.0, abs=1e-5)
