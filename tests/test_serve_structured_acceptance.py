"""Issue 41's acceptance through the server with the openai client, on the default model with MTP
k=2: for five schemas (examples/json_schemas.py), 200 seeded completions at temperature 1.0 of
`response_format={"type": "json_schema", ...}` each parse and validate, streamed and not, and
with n=3. Minutes on 2 cores: `-m slow` (CI runs it; the Python API's counterpart is
tests/test_structured_outputs_acceptance.py)."""

import asyncio
import json

import jsonschema
import pytest

from hybrid_engine import LLM
from json_schemas import SCHEMAS
from serve_support import client, running_server, wait_until_empty

pytestmark = pytest.mark.slow

COMPLETIONS = 200
MAX_TOKENS = 400
QUESTIONS = ["Describe a record.", "Fill in the fields.", "What is the configuration?", "Give an example."]


@pytest.fixture(scope="module")
def served():
    """(the LLM, its server), MTP k=2."""
    llm = LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with running_server(llm) as server:
        yield llm, server
    llm.shutdown()


async def one_request(api, name: str, schema: dict, i: int, n: int, stream: bool) -> list[tuple[str, str]]:
    """-> (text, finish_reason) of each of the request's n choices."""
    kwargs = dict(model="default", messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                  temperature=1.0, seed=1000 + i * n, n=n, max_tokens=MAX_TOKENS,
                  response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    if not stream:
        resp = await api.chat.completions.create(**kwargs)
        return [(c.message.content, c.finish_reason) for c in resp.choices]
    texts, finish = [""] * n, [None] * n
    async for chunk in await api.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    return list(zip(texts, finish))


@pytest.mark.parametrize("n, stream", [(1, False), (1, True), (3, False)])
def test_200_completions_per_schema_parse_and_validate(served, n, stream):
    llm, server = served
    requests = -(-COMPLETIONS // n)

    async def run(name, schema):
        # a client per asyncio.run: its connections belong to the loop that opened them
        async with client(server, asynchronous=True) as api:
            results = await asyncio.gather(*(one_request(api, name, schema, i, n, stream) for i in range(requests)))
        return [c for r in results for c in r][:COMPLETIONS]

    for name, schema in SCHEMAS.items():
        outs = asyncio.run(run(name, schema))
        assert len(outs) == COMPLETIONS
        for text, finish in outs:
            assert finish == "stop", (name, text)
            jsonschema.validate(json.loads(text), schema)
        assert len({text for text, _ in outs}) > COMPLETIONS // 4, name
    usage = wait_until_empty(llm.loop)
    assert usage["blocks_used"] == 0 and usage["slots_used"] == 0 and usage["num_engine_requests"] == 0
