"""MTP speculative decoding: lossless greedy, exact state after rewind, lossless sampling, no leaks."""

import random

import pytest
import torch

from hybrid_engine import LLM, EngineConfig, LLMEngine, SamplingParams

from engine_checks import assert_no_leak, budget_for_blocks
from spec_models import make_spec_checkpoint
from staggered import run_staggered

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.fixture(scope="module")
def spec_ckpts(tmp_path_factory):
    return {f: make_spec_checkpoint(tmp_path_factory.mktemp(f), f, embed_scale=1.6) for f in FAMILIES}


def spec(k):
    return {"method": "mtp", "num_speculative_tokens": k}


def workload(seed=0, n=6):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 70))] for _ in range(n)]
    arrivals = sorted(rng.randrange(8) for _ in range(n))
    return prompts, arrivals


@pytest.mark.parametrize("family", FAMILIES)
def test_lossless_greedy_all_k_with_chunked_prefill_and_preemption(spec_ckpts, family):
    folder = str(spec_ckpts[family])
    prompts, arrivals = workload()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # The plain path: no speculation, no prefix caching (the runs below have it on, the default).
    ref_engine = LLMEngine(EngineConfig(model=folder, dtype="float32", enable_prefix_caching=False))
    reference = [o.token_ids for o in run_staggered(ref_engine, prompts, params, arrivals)]
    for k in (1, 2, 3, 5):
        probe = LLMEngine(EngineConfig(model=folder, dtype="float32", speculative_config=spec(k), max_num_seqs=6,
                                       max_num_batched_tokens=6 * (1 + k)))
        # Room for all slots (and prefix checkpoints) but only 14 blocks of 16 tokens: forces preemptions.
        tight = budget_for_blocks(probe, 14)
        for cfg in (dict(max_num_batched_tokens=6 * (1 + k) + 10),          # chunked prefill
                    dict(max_num_batched_tokens=64, cache_memory_bytes=tight)):
            engine = LLMEngine(EngineConfig(model=folder, dtype="float32", speculative_config=spec(k),
                                            max_num_seqs=6, **cfg))
            assert [o.token_ids for o in run_staggered(engine, prompts, params, arrivals)] == reference, (k, cfg)
            assert_no_leak(engine)
            st = engine.spec_stats
            assert 0.2 <= st.acceptance_rate <= 0.8, (k, st.as_dict())
            assert any(n > 0 for n in st.accepted_per_position)         # multi-token acceptances
            assert st.num_accepted < st.num_drafted                     # and rejections
            if "cache_memory_bytes" in cfg:
                assert engine.num_preemptions > 0


def committed_state(engine, rid):
    """A request's committed GDN state (per layer) and KV of its computed tokens."""
    req = engine.requests[rid]
    rc = engine.cache.get(rid)
    n, bs = req.num_computed_tokens, engine.cache.spec.block_size
    pos = torch.arange(n)
    blocks = torch.tensor(rc.block_table)[pos // bs]
    kv_caches = engine.cache.pools.kv_caches[:len(engine.model_config.full_attention_layers)]
    kv = [c[blocks, :, pos % bs].clone() for c in kv_caches]
    conv = [c[rc.slot].clone() for c in engine.cache.pools.conv_states]
    rec = [c[rc.slot].clone() for c in engine.cache.pools.recurrent_states]
    return n, conv, rec, kv


def snapshots(engine, prompts, params):
    snaps, accepted_per_step = {}, []
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    while engine.has_unfinished_requests():
        before = {rid: r.spec_stats.num_accepted for rid, r in engine.requests.items() if r.spec_stats}
        engine.step()
        step_acc = set()
        for rid, r in engine.requests.items():
            if r.num_computed_tokens > 0 and not r.is_finished:
                n, conv, rec, kv = committed_state(engine, rid)
                snaps[(rid, n)] = (conv, rec, kv)
                if rid in before:
                    step_acc.add(r.spec_stats.num_accepted - before[rid])
        accepted_per_step.append(step_acc)
    return snaps, accepted_per_step


@pytest.mark.parametrize("family, k", [("qwen3_5", 3), ("qwen3_next", 2)])
def test_committed_state_after_every_verify_equals_non_speculative(spec_ckpts, family, k):
    folder = str(spec_ckpts[family])
    prompts, _ = workload(seed=1, n=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref, _ = snapshots(LLMEngine(EngineConfig(model=folder, dtype="float32")), prompts, params)
    got, accepted = snapshots(LLMEngine(EngineConfig(model=folder, dtype="float32", speculative_config=spec(k))),
                              prompts, params)
    compared = 0
    for key, (conv, rec, kv) in got.items():
        rconv, rrec, rkv = ref[key]
        for a, b in zip(conv + rec, rconv + rrec):
            assert (a - b).abs().max().item() <= 1e-5, key
        # K/V of the accepted range: the same values up to float32 rounding (a verify's k+1 rows
        # and a decode's one row go through different BLAS kernels), so relative to their size.
        for a, b in zip(kv, rkv):
            assert (a - b).abs().max().item() <= 1e-5 * max(1.0, b.abs().max().item()), key
        compared += 1
    assert compared >= 20
    # Requests in one step accepted different numbers of drafts: each used its own count.
    assert any(len(s) > 1 for s in accepted)


def test_stale_or_nan_state_in_free_slots_is_never_read_nor_written(spec_ckpts):
    """PEERS 2 and 3: a fresh request never starts from another's state (has_initial_state is
    per request), and nothing padded is written to a state slot no request owns."""
    folder = str(spec_ckpts["qwen3_5"])
    prompts = [[5], [7, 8], [9, 10, 11], list(range(40))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = LLM(model=folder, dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM(model=folder, dtype="float32", speculative_config=spec(3))
    cache = llm.engine.cache
    for t in cache.pools.conv_states + cache.pools.recurrent_states + cache.pools.kv_caches:
        t.fill_(float("nan"))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    # Only 4 requests x (1 + 3) slots were ever handed out; every other slot is still NaN.
    used = 4 * 4
    for t in cache.pools.conv_states + cache.pools.recurrent_states:
        untouched = t[used:]
        assert torch.isnan(untouched).all()


def chi_square_p(a: torch.Tensor, b: torch.Tensor, bins: int = 6) -> float:
    """p-value of a two-sample chi-square test on count vectors: the `bins - 1` most frequent
    tokens and one bin for the rest (few bins keep the power to see a small shift of mass)."""
    keep = torch.zeros_like(a, dtype=torch.bool)
    keep[(a + b).argsort(descending=True)[:bins - 1]] = True
    a = torch.cat([a[keep], a[~keep].sum().view(1)]).double()
    b = torch.cat([b[keep], b[~keep].sum().view(1)]).double()
    nz = (a + b) > 0
    a, b = a[nz], b[nz]
    na, nb = a.sum(), b.sum()
    ea, eb = (a + b) * na / (na + nb), (a + b) * nb / (na + nb)
    stat = (((a - ea) ** 2) / ea + ((b - eb) ** 2) / eb).sum()
    return torch.special.gammaincc(torch.tensor((a.numel() - 1) / 2.0, dtype=torch.float64), stat / 2).item()


ALPHA = 0.01
# The full test draws enough samples to catch a 2% shift of probability mass (see the power
# check below); it takes minutes on 2 cores, so the default run does a quicker one that
# catches a 5% shift, and CI runs the full one with `-m slow`.
N_FULL, N_QUICK = 16000, 4000


def first_tokens(folder, params, speculative, n):
    llm = LLM(model=folder, dtype="float32", max_num_seqs=500, max_num_batched_tokens=4000,
              speculative_config=speculative, seed=0)
    outs = llm.generate([[3, 1, 4, 1, 5]] * n, params, use_tqdm=False)
    counts = torch.zeros(4, 256)
    for o in outs:
        for j, t in enumerate(o.token_ids):
            counts[j, t] += 1
    assert_no_leak(llm.engine)
    return counts, llm.engine.spec_stats


def check_lossless(folder, params, n):
    """The first 4 emitted tokens have the same distribution with and without speculation."""
    base, _ = first_tokens(folder, params, None, n)
    got, stats = first_tokens(folder, params, spec(2), n)
    assert stats.num_accepted > 0 and stats.num_accepted < stats.num_drafted
    for j in range(4):
        assert chi_square_p(got[j], base[j]) > ALPHA, j


SAMPLING_CASES = [
    SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, max_tokens=4, ignore_eos=True),
]


@pytest.mark.parametrize("params", SAMPLING_CASES)
def test_sampling_with_speculation_is_lossless_quick(spec_ckpts, params):
    check_lossless(str(spec_ckpts["qwen3_5"]), params, N_QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("params", SAMPLING_CASES)
def test_sampling_with_speculation_is_lossless_full(spec_ckpts, params):
    check_lossless(str(spec_ckpts["qwen3_5"]), params, N_FULL)


@pytest.mark.parametrize("n, shift", [(N_FULL, 0.02), (N_QUICK, 0.05)])
def test_chi_square_power_at_these_sizes(n, shift):
    """Moving `shift` of the probability mass between the two likeliest tokens, on
    distributions shaped like the tested ones, is detected at ALPHA in >= 90% of trials."""
    g = torch.Generator().manual_seed(0)
    detected = 0
    for _ in range(20):
        p = torch.softmax(torch.randn(256, generator=g) * 2.5, dim=0)
        q = p.clone()
        order = p.argsort(descending=True)
        q[order[0]] -= shift
        q[order[1]] += shift
        a = torch.bincount(torch.multinomial(p, n, replacement=True, generator=g), minlength=256)
        b = torch.bincount(torch.multinomial(q, n, replacement=True, generator=g), minlength=256)
        detected += chi_square_p(a.float(), b.float()) <= ALPHA
    assert detected >= 18


def test_penalties_min_tokens_and_stop_tokens_with_speculation(spec_ckpts):
    folder = str(spec_ckpts["qwen3_5"])
    prompts, _ = workload(seed=3, n=4)
    cases = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
             SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, frequency_penalty=0.5, logprobs=2)]
    base = LLM(model=folder, dtype="float32")
    sp = LLM(model=folder, dtype="float32", speculative_config=spec(3))
    for params in cases:
        ref = base.generate(prompts, params, use_tqdm=False)
        got = sp.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        if params.logprobs:
            for a, b in zip(got, ref):
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert la.keys() == lb.keys()
                    assert max(abs(la[t] - lb[t]) for t in la) < 1e-4
    # A stop token inside the accepted drafts ends the request right there.
    plain = base.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    stop = plain[6]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    out = sp.generate(prompts[0], params, use_tqdm=False)[0]
    assert out.token_ids == plain[:plain.index(stop) + 1] and out.finish_reason == "stop"
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop],
                            min_tokens=plain.index(stop) + 2)
    assert sp.generate(prompts[0], params, use_tqdm=False)[0].token_ids == \
        base.generate(prompts[0], params, use_tqdm=False)[0].token_ids
    assert_no_leak(sp.engine)


def test_spec_stats_on_outputs(spec_ckpts):
    llm = LLM(model=str(spec_ckpts["qwen3_5"]), dtype="float32", speculative_config=spec(2))
    out = llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]
    s = out.metrics["spec_decode"]
    assert s["num_drafted"] == 2 * s["num_verify_steps"] > 0
    assert 1.0 <= s["mean_accept_length"] <= 3.0
    assert len(s["acceptance_rate_per_position"]) == 2


def test_speculation_needs_mtp_weights(tmp_path):
    from checkpoints import make_hf_model, save_checkpoint
    save_checkpoint(make_hf_model("qwen3_5"), tmp_path)
    with pytest.raises(ValueError, match="mtp"):
        LLM(model=str(tmp_path), speculative_config=spec(2))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=str(tmp_path), speculative_config=spec(9))


def test_200_random_speculative_requests_with_aborts_mid_verify(spec_ckpts):
    rng = random.Random(99)
    engine = LLMEngine(EngineConfig(model=str(spec_ckpts["qwen3_5_moe"]), dtype="float32",
                                    speculative_config=spec(3), max_num_seqs=8, max_num_batched_tokens=64))
    live, done, aborted, rejected, pending = set(), 0, 0, 0, 200
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if not pending:
                break
            pending -= 1
            prompt = [rng.randrange(260) for _ in range(rng.randint(0, 50))]
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 16),
                                    seed=rng.choice([None, 5]), top_k=rng.choice([-1, 4]), ignore_eos=True)
            try:
                live.add(engine.add_request(prompt, params))
            except ValueError:
                rejected += 1
        decoding = [r for r in live if engine.requests[r].draft_token_ids]
        if decoding and rng.random() < 0.1:      # abort while it holds drafts and draft slots
            victim = rng.choice(sorted(decoding))
            engine.abort_request(victim)
            live.discard(victim)
            aborted += 1
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                done += 1
    assert aborted > 0 and rejected > 0 and done + aborted + rejected == 200
    assert_no_leak(engine)


def test_speculation_off_keeps_no_mtp_weights_nor_kv_pool(spec_ckpts, tmp_path):
    folder = spec_ckpts["qwen3_5"]
    off = LLMEngine(EngineConfig(model=str(folder), dtype="float32"))
    on = LLMEngine(EngineConfig(model=str(folder), dtype="float32", speculative_config=spec(2)))
    attention_layers = len(off.model_config.full_attention_layers)
    assert off.model.mtp is None and off.drafter is None
    assert not any(name.startswith("mtp.") for name, _ in off.model.named_parameters())
    assert off.cache.spec.num_attention_layers == len(off.cache.pools.kv_caches) == attention_layers
    assert on.model.mtp is not None and len(on.cache.pools.kv_caches) == attention_layers + 1
    # The mtp.* tensors are still checked when they are not kept.
    import shutil
    from safetensors.torch import load_file, save_file
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :-1].contiguous()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mtp.fc.weight"):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))
