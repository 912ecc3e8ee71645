"""Continuous batching: batch invariance, chunked prefill, preemption, validation, aborts, no leaks."""

import random

import pytest
import torch

from hybrid_engine import LLM, LLMEngine, EngineConfig, SamplingParams

from checkpoints import make_hf_model, save_checkpoint
from engine_checks import assert_no_leak, budget_for_blocks


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    save_checkpoint(make_hf_model("qwen3_5", full_attention_interval=2), folder, tokenizer=True)
    return folder


def random_prompts(n, lo, hi, vocab=256, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_batch_invariance_chunked_prefill_and_preemption(dense_ckpt):
    prompts = random_prompts(16, 1, 300)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(16)]
    alone_llm = LLM(model=str(dense_ckpt), dtype="float32", enable_prefix_caching=False)   # the plain path
    alone = [alone_llm.generate(p, sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    assert_no_leak(alone_llm.engine)

    together = LLM(model=str(dense_ckpt), dtype="float32")
    assert [o.token_ids for o in together.generate(prompts, params, use_tqdm=False)] == alone
    assert_no_leak(together.engine)

    chunked = LLM(model=str(dense_ckpt), dtype="float32", max_num_seqs=16, max_num_batched_tokens=32)
    assert [o.token_ids for o in chunked.generate(prompts, params, use_tqdm=False)] == alone
    assert_no_leak(chunked.engine)

    # 16 state slots, the prefix checkpoints and 40 blocks of 16 tokens: far less KV than 16 requests need.
    probe = LLMEngine(EngineConfig(model=str(dense_ckpt), dtype="float32", max_num_seqs=16))
    budget = budget_for_blocks(probe, 40)
    tight = LLM(model=str(dense_ckpt), dtype="float32", max_num_seqs=16, max_num_batched_tokens=64,
                cache_memory_bytes=budget)
    assert [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == alone
    assert tight.engine.num_preemptions > 0
    assert_no_leak(tight.engine)


def test_outputs_in_input_order_with_text_and_metrics(dense_ckpt):
    llm = LLM(model=str(dense_ckpt), dtype="float32")
    outs = llm.generate(["def main():", "import os", "x = 1"], SamplingParams(temperature=0.0, max_tokens=5),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["def main():", "import os", "x = 1"]
    for o in outs:
        assert len(o.token_ids) <= 5 and o.finish_reason in ("stop", "length")
        assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.metrics["time_to_first_token"] > 0
    assert_no_leak(llm.engine)


def test_streaming_deltas_add_up(dense_ckpt):
    llm = LLM(model=str(dense_ckpt), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    final = llm.generate("class A:", params, use_tqdm=False)[0]
    ids, text = [], ""
    for delta in llm.generate_stream("class A:", params):
        ids += delta.new_token_ids
        text += delta.new_text
    assert ids == final.token_ids and text == final.text
    assert_no_leak(llm.engine)


def test_stop_strings_stop_tokens_eos_and_min_tokens(dense_ckpt):
    llm = LLM(model=str(dense_ckpt), dtype="float32")
    base = llm.generate("for i in", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0]
    tok = base.token_ids[5]
    out = llm.generate("for i in", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                   stop_token_ids=[tok]), use_tqdm=False)[0]
    first = base.token_ids.index(tok)
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == tok
    # min_tokens bans the stop token until enough tokens exist.
    out = llm.generate("for i in", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                   stop_token_ids=[tok], min_tokens=first + 2), use_tqdm=False)[0]
    assert len(out.token_ids) >= first + 2
    # A stop string from the middle of the greedy text: the output is cut right before its
    # first occurrence. The tokenizer is trained on text, so 30 tokens decode to plenty.
    text = base.text
    assert len(text) >= 20, text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = llm.generate("for i in", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                   stop=[stop]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert_no_leak(llm.engine)


def test_logprobs_are_the_reference_log_softmax_top_n_plus_chosen(dense_ckpt):
    """Each step's logprobs: the 3 most likely tokens and the sampled one, with the values of
    transformers' log-softmax over the same prefix (fp32)."""
    llm = LLM(model=str(dense_ckpt), dtype="float32")
    prompt = [5, 6, 7]
    out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3),
                       use_tqdm=False)[0]
    hf = make_hf_model("qwen3_5", full_attention_interval=2)           # the fixture's model
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    reference = logits[len(prompt) - 1:-1].log_softmax(dim=-1)
    assert len(out.logprobs) == 6
    for lp, t, ref in zip(out.logprobs, out.token_ids, reference):
        top3 = set(ref.topk(3).indices.tolist())
        assert set(lp) == top3 | {t}
        for token, value in lp.items():
            assert abs(value - ref[token].item()) < 1e-4, (token, value, ref[token].item())


def test_seeded_sampling_independent_of_batch(dense_ckpt):
    llm = LLM(model=str(dense_ckpt), dtype="float32")
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    alone = llm.generate([1, 2, 3], p, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=7) for i in range(3)]
    mixed = llm.generate([[9] * 20, [1, 2, 3], [4, 4], [8]], [others[0], p, others[1], others[2]],
                         use_tqdm=False)
    assert mixed[1].token_ids == alone


@pytest.mark.parametrize("prompt, params, match", [
    ([], None, "empty"),
    ("", None, "empty"),
    ([1, 999999], None, "vocabulary"),
    ([1] * 5000, None, "maximum"),
    ([1, 2], SamplingParams(temperature=float("nan")), "temperature"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_k=0), "top_k"),
    ([1, 2], SamplingParams(min_p=1.5), "min_p"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2], SamplingParams(seed="x"), "seed"),
    ([1, 2], SamplingParams(stop=[""]), "stop"),
])
def test_generate_validates_before_running(dense_ckpt, prompt, params, match):
    llm = LLM(model=str(dense_ckpt), dtype="float32", max_model_len=4096)
    good = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=match) as e:
        llm.generate([[1, 2, 3], prompt], [good, params or good], use_tqdm=False)
    assert "prompt 1" in str(e.value)
    assert_no_leak(llm.engine)


def test_engine_api_rejects_bad_request_and_aborts_free_memory(dense_ckpt):
    engine = LLMEngine(EngineConfig(model=str(dense_ckpt), dtype="float32"))
    a = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    with pytest.raises(ValueError):
        engine.add_request([1, 10**9], SamplingParams())
    b = engine.add_request(list(range(40)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    blocks_before = engine.cache.num_free_blocks
    engine.abort_request(b)
    assert engine.cache.num_free_blocks > blocks_before
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert list(done) == [a] and len(done[a].token_ids) == 50
    assert_no_leak(engine)


def test_200_random_requests_with_aborts_and_invalid(dense_ckpt):
    rng = random.Random(1234)
    engine = LLMEngine(EngineConfig(model=str(dense_ckpt), dtype="float32", max_num_seqs=8,
                                    max_num_batched_tokens=64, cache_memory_bytes=None))
    live, rejected, finished, aborted = set(), 0, 0, 0
    pending = 200
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if not pending:
                break
            pending -= 1
            n = rng.randint(0, 60)
            prompt = [rng.randrange(256) for _ in range(n)]
            if rng.random() < 0.1 and prompt:
                prompt[0] = 256 + rng.randrange(10)            # outside the vocabulary
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([-1, 5]),
                top_p=rng.choice([1.0, 0.8]), max_tokens=rng.randint(1, 12),
                seed=rng.choice([None, rng.randrange(100)]), repetition_penalty=rng.choice([1.0, 1.2]),
                logprobs=rng.choice([None, 2]))
            try:
                live.add(engine.add_request(prompt, params))
            except ValueError:
                rejected += 1
        if live and rng.random() < 0.08:
            victim = rng.choice(sorted(live))
            engine.abort_request(victim)
            live.discard(victim)
            aborted += 1
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                finished += 1
                assert 1 <= len(out.token_ids) <= 12
    assert rejected > 0 and aborted > 0 and finished > 100
    assert finished + aborted + rejected == 200
    assert_no_leak(engine)


def test_chat_uses_the_tokenizer_chat_template(dense_ckpt):
    llm = LLM(model=str(dense_ckpt), dtype="float32")
    messages = [{"role": "user", "content": "print hello"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.chat(messages, params, use_tqdm=False)[0]
    prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "print hello" in prompt and out.prompt == prompt
    assert out.token_ids == llm.generate(prompt, params, use_tqdm=False)[0].token_ids
    assert_no_leak(llm.engine)
