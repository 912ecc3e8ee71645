"""Many HTTP clients at once on the default model: 64 concurrent streams (half on an MTP
server) each equal their offline greedy output and are counted by /metrics, and 20 clients
that disconnect mid-stream are aborted at once; afterwards the caches are empty.
Loopback only; every wait is bounded."""

import asyncio

import httpx
import pytest

from hybrid_engine import LLM
from serve_support import cache_usage, client, offline_params, record_aborts, running_server, wait_until_empty

WORDS = ["def", "class", "import", "return", "for", "while", "if", "with", "try", "yield", "lambda", "print"]
PROMPTS = [f"{WORDS[i % 12]} {WORDS[(i * 5 + 1) % 12]}_{i}(" for i in range(64)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llms():
    plain = LLM(max_num_seqs=32)
    mtp = LLM(max_num_seqs=32, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    yield plain, mtp
    plain.shutdown()
    mtp.shutdown()


async def _stream_one(api, prompt: str) -> tuple[str, str]:
    text, finish = "", None
    stream = await api.completions.create(model="default", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          stream=True)
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


def test_64_concurrent_streams_equal_offline_greedy(llms):
    plain, mtp = llms
    expected = plain.generate(PROMPTS, offline_params(plain, temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    with running_server(plain) as s_plain, running_server(mtp) as s_mtp:
        apis = [client(s_plain, asynchronous=True), client(s_mtp, asynchronous=True)]

        async def run_all():
            jobs = [_stream_one(apis[i % 2], p) for i, p in enumerate(PROMPTS)]
            return await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)

        results = asyncio.run(run_all())
        assert [r[0] for r in results] == [o.text for o in expected]
        assert [r[1] for r in results] == [o.finish_reason for o in expected]
        for server, llm in ((s_plain, plain), (s_mtp, mtp)):
            metrics = httpx.get(server.url + "/metrics").text
            done = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith("vllm:request_success_total{"))
            assert done == 32
            generated = sum(len(o.token_ids) for o in expected[(server is s_mtp)::2])
            assert f'vllm:generation_tokens_total{{model_name="default"}} {float(generated)}' in metrics
            assert 'vllm:num_requests_running{model_name="default"} 0.0' in metrics
            usage = wait_until_empty(llm.loop)
            assert (usage["blocks_used"], usage["slots_used"], usage["num_engine_requests"]) == (0, 0, 0)
        mtp_metrics = httpx.get(s_mtp.url + "/metrics").text
        drafts = [line for line in mtp_metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].rsplit(" ", 1)[1]) > 0
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="default",position="1"}' in mtp_metrics


def test_20_clients_disconnecting_mid_stream_leak_nothing(llms, monkeypatch):
    plain, _ = llms
    aborted = record_aborts(plain.engine, monkeypatch)
    with running_server(plain) as server:
        async def disconnect_after_two_chunks(http: httpx.AsyncClient, i: int) -> int:
            body = {"model": "default", "prompt": PROMPTS[i], "max_tokens": 2000, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            chunks = 0
            async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 2:
                        break   # leaving the block closes the connection mid-stream
            return chunks

        async def run_all():
            async with httpx.AsyncClient(timeout=60) as http:
                jobs = [disconnect_after_two_chunks(http, i) for i in range(20)]
                return await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)

        assert asyncio.run(run_all()) == [2] * 20
        usage = wait_until_empty(plain.loop, timeout=10)
        assert len(aborted) == 20 and all(o.finish_reason == "abort" and len(o.token_ids) < 2000 for o in aborted)
        assert (usage["blocks_used"], usage["slots_used"], usage["num_engine_requests"]) == (0, 0, 0)
        assert server.app.state.serve.client.num_pending == 0
        assert cache_usage(plain.loop)["unfinished"] is False


def test_a_non_streaming_client_that_gives_up_is_aborted(llms, monkeypatch):
    plain, _ = llms
    aborted = record_aborts(plain.engine, monkeypatch)
    with running_server(plain) as server:
        body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": 3000, "ignore_eos": True, "n": 2}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
        usage = wait_until_empty(plain.loop, timeout=10)
        assert (usage["blocks_used"], usage["slots_used"], usage["num_engine_requests"]) == (0, 0, 0)
        assert len(aborted) == 2 and all(len(o.token_ids) < 3000 for o in aborted)
