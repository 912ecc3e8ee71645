"""`hybrid-engine serve` through the real openai client, on the embedded default model, against a
server on 127.0.0.1 started in the test: outputs equal LLM.generate's, streams join to the
non-streamed text, usage, n, stop strings, logprobs (echoed prompts' too), errors, auth,
tokenize, health, metrics."""

import json

import httpx
import openai
import pytest

from hybrid_engine import LLM
from hybrid_engine.serve.app import attach_engine, create_app
from hybrid_engine.serve.server import BackgroundServer
from serve_support import client, offline_params, running_server, wait_until_empty

PROMPTS = ["def read_config(path):", "import os\n", "class Stack:\n    def push(self, item):"]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    with running_server(llm) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    return client(server)


def greedy(llm, prompt, **kw):
    return llm.generate(prompt, offline_params(llm, temperature=0.0, **kw), use_tqdm=False)[0]


def stream_text(stream):
    deltas, final = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas.append(c.text)
            final = c.finish_reason or final
    return deltas, final


def test_completions_equal_llm_generate(llm, api):
    r = api.completions.create(model="default", prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    expected = [greedy(llm, p, max_tokens=12) for p in PROMPTS]
    assert [c.text for c in r.choices] == [o.text for o in expected]
    assert [c.finish_reason for c in r.choices] == [o.finish_reason for o in expected]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in expected)
    completion_tokens = sum(len(o.token_ids) for o in expected)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)
    ids = expected[0].prompt_token_ids
    by_ids = api.completions.create(model="default", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected[0].text


def test_completion_stream_joins_to_the_text(llm, api):
    expected = greedy(llm, PROMPTS[0], max_tokens=20)
    stream = api.completions.create(model="default", prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                    stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)


def test_echo_and_vllm_extras(llm, api):
    r = api.completions.create(model="default", prompt=PROMPTS[1], max_tokens=8, echo=True, temperature=0.7,
                               extra_body={"top_k": 1, "min_p": 0.05, "repetition_penalty": 1.0,
                                           "min_tokens": 8, "ignore_eos": True})
    expected = greedy(llm, PROMPTS[1], max_tokens=8, min_tokens=8, ignore_eos=True, repetition_penalty=1.0)   # top_k 1: greedy
    assert r.choices[0].text == PROMPTS[1] + expected.text
    assert r.usage.completion_tokens == 8


def test_chat_equals_llm_chat_and_streams_the_same(llm, api):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    expected = llm.chat(messages, offline_params(llm, temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    r = api.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)
    stream = api.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_n_with_a_seed_is_reproducible(llm, api):
    kw = dict(model="default", prompt=PROMPTS[2], max_tokens=10, temperature=1.0, n=3, seed=11)
    first, again = api.completions.create(**kw), api.completions.create(**kw)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    # choice i is the request with seed + i
    offline = [llm.generate(PROMPTS[2], offline_params(llm, temperature=1.0, max_tokens=10, seed=11 + i),
                            use_tqdm=False)[0].text for i in range(3)]
    assert texts == offline
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == sum(len(o.token_ids) for o in llm.generate(
        [PROMPTS[2]] * 3, [offline_params(llm, temperature=1.0, max_tokens=10, seed=11 + i) for i in range(3)],
        use_tqdm=False))
    streamed = ["", "", ""]
    for chunk in api.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts


def test_stop_strings_are_cut_and_never_half_streamed(llm, api):
    prompt = "def main():\n    "
    full = greedy(llm, prompt, max_tokens=30).text
    # a 4-character stop string whose first occurrence is at `cut`, several tokens in
    cut = next(i for i in range(10, len(full) - 4) if full.index(full[i:i + 4]) == i and full[i:i + 4].strip())
    stop = full[cut:cut + 4]
    kw = dict(model="default", prompt=prompt, max_tokens=30, temperature=0, stop=["never there", stop])
    r = api.completions.create(**kw)
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    sent = ""
    for chunk in api.completions.create(**kw, stream=True):
        for c in chunk.choices:
            sent += c.text
            assert full[:cut].startswith(sent), "streamed part of the stop string"
    assert sent == full[:cut]


def test_logprobs_in_both_formats(llm, api):
    expected = greedy(llm, PROMPTS[0], max_tokens=5, logprobs=2)
    r = api.completions.create(model="default", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([d[t] for d, t in zip(expected.logprobs, expected.token_ids)])
    assert [len(t) for t in lp.top_logprobs] == [2] * 5
    tok = llm.tokenizer
    assert lp.tokens == [tok.decode([t]) for t in expected.token_ids]
    messages = [{"role": "user", "content": "x = 1"}]
    offline = llm.chat(messages, offline_params(llm, temperature=0.0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    r = api.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([d[t] for d, t in zip(offline.logprobs, offline.token_ids)])
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(max(offline.logprobs[0].values()))
    streamed = []
    for chunk in api.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,
                                             logprobs=True, top_logprobs=3, stream=True):
        for c in chunk.choices:
            streamed += [t.logprob for t in (c.logprobs.content if c.logprobs else [])]
    assert streamed == pytest.approx([c.logprob for c in content])


def _prompt_part(llm, prompt, k):
    """The offline prompt logprobs of `prompt` (the embedded model's distribution) as the
    completions format lists them: per prompt token its logprob and its k best, the first null."""
    out = llm.generate(prompt, offline_params(llm, temperature=0.0, max_tokens=1, prompt_logprobs=k),
                       use_tqdm=False)[0]
    tok = llm.tokenizer
    values = [None] + [e[t] for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    tops = [None] + [{tok.decode([t]): v for t, v in sorted(e.items(), key=lambda kv: -kv[1])[:k]}
                     for e in out.prompt_logprobs[1:]]
    return out.prompt_token_ids, values, tops


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(llm, api):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, max_tokens 0 -> the prompt
    alone, its tokens' logprobs (the first null), top_logprobs and offsets."""
    ids, values, tops = _prompt_part(llm, PROMPTS[2], 3)
    tok = llm.tokenizer
    r = api.completions.create(model="default", prompt=PROMPTS[2], max_tokens=0, echo=True, logprobs=3,
                               temperature=0)
    choice = r.choices[0]
    assert choice.text == tok.decode(ids) and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(values[1:])
    for got, want in zip(lp.top_logprobs[1:], tops[1:]):
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    by_ids = api.completions.create(model="default", prompt=ids, max_tokens=0, echo=True, logprobs=3)
    assert by_ids.choices[0].logprobs.token_logprobs == lp.token_logprobs


def test_echo_with_logprobs_then_the_completion(llm, api):
    expected = greedy(llm, PROMPTS[0], max_tokens=4, logprobs=2)
    ids, values, _ = _prompt_part(llm, PROMPTS[0], 2)
    r = api.completions.create(model="default", prompt=PROMPTS[0], max_tokens=4, echo=True, logprobs=2,
                               temperature=0)
    choice = r.choices[0]
    assert choice.text == llm.tokenizer.decode(ids) + expected.text
    generated = [d[t] for d, t in zip(expected.logprobs, expected.token_ids)]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(values[1:] + generated)
    assert len(choice.logprobs.tokens) == len(ids) + 4 and r.usage.completion_tokens == 4
    # streamed: the echo comes with the prompt's logprobs, then the completion as usual
    chunks = [c.choices[0] for c in api.completions.create(model="default", prompt=PROMPTS[0], max_tokens=4,
                                                            echo=True, logprobs=2, temperature=0, stream=True)
              if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert chunks[0].text == llm.tokenizer.decode(ids)
    assert chunks[0].logprobs.token_logprobs == choice.logprobs.token_logprobs[:len(ids)]
    streamed = [v for c in chunks[1:] if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed == pytest.approx(generated)
    only = [c.choices[0] for c in api.completions.create(model="default", prompt=PROMPTS[0], max_tokens=0,
                                                          echo=True, logprobs=2, stream=True) if c.choices]
    assert [c.text for c in only] == [llm.tokenizer.decode(ids), ""] and only[-1].finish_reason == "length"
    assert only[0].logprobs.token_logprobs == choice.logprobs.token_logprobs[:len(ids)]


def _post(server, path, body, key=None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers=headers, timeout=30)


@pytest.mark.parametrize("path,body,names", [
    ("/v1/completions", "{not json", "malformed JSON"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"model": "default", "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": "default", "prompt": "x", "frobnicate": 1}, "frobnicate: unknown field"),
    ("/v1/completions", {"model": "default", "prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": "default", "prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 0}, "0 is allowed only with echo"),
    ("/v1/completions", {"model": "default", "prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"model": "default", "prompt": ""}, "prompt is empty"),
    ("/v1/completions", {"model": "default", "prompt": [99999]}, "outside the vocabulary"),
    ("/v1/completions", {"model": "default", "prompt": [1] * (MAX_MODEL_LEN + 5)}, "maximum is"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": MAX_MODEL_LEN}, "maximum context length"),
    ("/v1/completions", {"model": "default", "prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),
    ("/v1/chat/completions", {"model": "default", "messages": []}, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "bot", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x", "extra": 1}]},
     "messages[0].extra: unknown field"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs: only allowed with logprobs true"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, "stream_options: only allowed with stream"),
    ("/v1/completions", {"model": "default", "prompt": "x", "stream": False,
                         "stream_options": {"include_usage": True}}, "stream_options: only allowed with stream"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": None}]},
     "messages[0].content: required for role 'user'"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "x"},
                                                               {"role": "assistant"}]},
     "messages[1].content: required for role 'assistant'"),
    ("/v1/completions", '{"model": "default", "prompt": "\\ud800 x"}', "prompt: contains a lone UTF-16 surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": '
                             '"a\\udc00"}]}', "messages[1].content: contains a lone UTF-16 surrogate"),
    ("/v1/completions", {"model": "default", "prompt": "x", "stop": [f"s{i}" for i in range(257)]},
     "stop: at most 256 stop strings, got 257"),
    ("/tokenize", {"model": "default"}, "exactly one of prompt and messages"),
    ("/detokenize", {"model": "default", "tokens": [-1]}, "tokens"),
])
def test_bad_requests_are_400s_naming_the_problem(server, api, path, body, names):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert names in error["message"] and error["code"] == 400 and error["type"] == "BadRequestError"
    assert api.completions.create(model="default", prompt="x", max_tokens=2).choices   # still serving


def test_bad_parameters_through_the_openai_client(api):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        api.completions.create(model="default", prompt="x", temperature=-0.5, stream=True)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.completions.create(model="gpt-4", prompt="x")


def test_api_key(llm):
    with running_server(llm, api_key="sesame") as s:
        assert client(s, "sesame").completions.create(model="default", prompt="x", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").models.list()
        assert _post(s, "/v1/completions", {"prompt": "x"}).status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200   # no key needed


def test_health_is_503_while_loading(llm):
    app = create_app(None, model_name="default")
    with BackgroundServer(app) as s:
        assert httpx.get(s.url + "/health").status_code == 503
        r = _post(s, "/v1/completions", {"prompt": "x"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        attach_engine(app, llm.loop)
        assert httpx.get(s.url + "/health").status_code == 200
        assert client(s).completions.create(model="default", prompt="x", max_tokens=2).choices


def test_models_tokenize_detokenize(llm, api, server):
    models = api.models.list().data
    assert [m.id for m in models] == ["default"]
    ids = llm.tokenizer.encode(PROMPTS[2], add_special_tokens=False)
    r = _post(server, "/tokenize", {"model": "default", "prompt": PROMPTS[2]}).json()
    assert r == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"prompt": PROMPTS[2]}
    messages = [{"role": "user", "content": "hi"}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == llm.tokenizer.encode(prompt, add_special_tokens=False)


def test_metrics_count_requests_and_the_cache_empties(llm, server, api):
    before = _metric(server, 'vllm:request_success_total{finished_reason="length",model_name="default"}')
    for _ in range(2):
        api.completions.create(model="default", prompt=PROMPTS[1], max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    assert _metric(server, 'vllm:request_success_total{finished_reason="length",model_name="default"}') == before + 2
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:state_slot_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:spec_decode_num_drafts_total"):
        assert name in text, name
    assert _metric(server, 'vllm:num_requests_running{model_name="default"}') == 0
    usage = wait_until_empty(llm.loop)
    assert usage["blocks_used"] == 0 and usage["slots_used"] == 0


def _metric(server, line_start: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_overloaded_is_503_with_retry_after_and_clears(llm):
    # no waiting room: the 8 requests --max-num-seqs runs at once are all it takes
    app = create_app(llm.loop, model_name="default", max_waiting_requests=0)
    with BackgroundServer(app) as s:
        r = _post(s, "/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 2, "n": 9})
        assert r.status_code == 503 and "overloaded" in r.json()["error"]["message"]
        assert r.headers["Retry-After"] == "1"
        assert app.state.serve.client.num_pending == 0
        assert len(client(s).completions.create(model="default", prompt="x", max_tokens=2, n=2).choices) == 2


def test_missing_fields_take_the_generation_config_defaults(llm, api):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.repetition_penalty) == (0.0, 1.2)   # the default model's file
    r = api.completions.create(model="default", prompt=PROMPTS[1], max_tokens=12)
    assert r.choices[0].text == llm.generate(PROMPTS[1], offline_params(llm, max_tokens=12), use_tqdm=False)[0].text
    plain = api.completions.create(model="default", prompt=PROMPTS[1], max_tokens=12,
                                   extra_body={"repetition_penalty": 1.0})
    unpenalised = llm.generate(PROMPTS[1], offline_params(llm, max_tokens=12, repetition_penalty=1.0), use_tqdm=False)
    assert plain.choices[0].text == unpenalised[0].text != r.choices[0].text


def test_metrics_count_prefix_cache_queries_and_hits():
    """With prefix caching on, /metrics carries vLLM's prefix-cache token counters, equal to the
    engine's own stats: a repeated 40-token prompt hits its 32 full-block tokens."""
    llm = LLM(dtype="float32", max_num_seqs=2, enable_prefix_caching=True)
    try:
        prompt = list(range(5, 45))
        with running_server(llm) as s:
            for _ in range(2):
                r = _post(s, "/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 2,
                                                 "temperature": 0})
                assert r.status_code == 200
            stats = llm.loop.run_on_loop(lambda e: e.prefix_cache_stats)
            assert stats["hit_tokens"] == 32
            assert _metric(s, 'vllm:prefix_cache_hits_total{model_name="default"}') == stats["hit_tokens"]
            assert _metric(s, 'vllm:prefix_cache_queries_total{model_name="default"}') == stats["query_tokens"]
            assert _metric(s, 'hybrid_engine:prefix_cache_checkpoints{model_name="default"}') == stats["checkpoints_held"]
    finally:
        llm.shutdown()


def test_an_assistant_message_with_tool_calls_may_leave_out_content(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [{"role": "user", "content": "add 1 and 2"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "3", "tool_call_id": "call_1"}]
    r = _post(server, "/v1/chat/completions", {"model": "default", "messages": messages, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
