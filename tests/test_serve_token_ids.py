"""A checkpoint without a tokenizer behind the server: token-id prompts, the ids as text (each
followed by a space, streamed the same), and chat / tokenize refused with a 400."""

import httpx
import pytest

from checkpoints import make_hf_model, save_checkpoint
from hybrid_engine import LLM
from serve_support import client, offline_params, running_server


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = save_checkpoint(make_hf_model("qwen3_5"), tmp_path_factory.mktemp("ids") / "ckpt")
    llm = LLM(model=str(folder), max_num_seqs=4)
    with running_server(llm, model_name="ids") as s:
        yield llm, s
    llm.shutdown()


def test_token_id_prompts_without_a_tokenizer(setup):
    llm, server = setup
    prompt = [5, 17, 42, 99]
    expected = llm.generate(prompt, offline_params(llm, temperature=0.0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0]
    api = client(server)
    kw = dict(model="ids", prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    text = "".join(f"{t} " for t in expected.token_ids)
    r = api.completions.create(**kw)
    assert r.choices[0].text == text and r.usage.completion_tokens == 6
    assert "".join(c.choices[0].text for c in api.completions.create(**kw, stream=True) if c.choices) == text
    assert api.completions.create(**kw, echo=True).choices[0].text == "5 17 42 99 " + text
    chat = httpx.post(server.url + "/v1/chat/completions", json={"model": "ids", "messages": [
        {"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
    text_prompt = httpx.post(server.url + "/v1/completions", json={"model": "ids", "prompt": "hi"})
    assert text_prompt.status_code == 400 and "no tokenizer" in text_prompt.json()["error"]["message"]
