"""Issue 41's acceptance on the default model, through the Python API: for five schemas
(examples/json_schemas.py), 200 seeded completions at temperature 1.0 each parse and validate,
with MTP k=2 and without, one sample a request and n=3. Minutes on 2 cores: `-m slow` (CI runs
it; the server's counterpart is tests/test_serve_structured_acceptance.py)."""

import json

import jsonschema
import pytest

from hybrid_engine import LLM, SamplingParams, StructuredOutputsParams
from json_schemas import SCHEMAS

pytestmark = pytest.mark.slow

COMPLETIONS = 200
PROMPTS = ["def read_config(path):", "import json\n", "# settings\n", "class Record:\n"]
# Well past the longest completion seen (227 tokens): a cut structure would not parse.
MAX_TOKENS = 400


def completions(llm, schema, n: int, seed: int) -> list:
    requests = -(-COMPLETIONS // n)
    params = [SamplingParams(temperature=1.0, seed=seed + i * n, n=n, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=schema)) for i in range(requests)]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(requests)], params, use_tqdm=False)
    return [c for o in outs for c in o.outputs][:COMPLETIONS]


@pytest.mark.parametrize("k, n", [(2, 1), (0, 3)])
def test_200_completions_per_schema_parse_and_validate(k, n):
    llm = LLM(speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None)
    for name, schema in SCHEMAS.items():
        outs = completions(llm, schema, n, seed=1000)
        assert len(outs) == COMPLETIONS
        for c in outs:
            assert c.finish_reason == "stop", (name, c.text)
            jsonschema.validate(json.loads(c.text), schema)
        assert len({c.text for c in outs}) > COMPLETIONS // 4, name     # sampled, not one answer
    llm.shutdown()
