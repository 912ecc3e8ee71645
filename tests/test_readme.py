"""The README's code as a reader would paste it."""

import re
import sys
import types
from pathlib import Path

README = (Path(__file__).parents[1] / "README.md").read_text()


def python_block_with(text: str) -> str:
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if text in b]
    assert len(blocks) == 1, blocks
    return blocks[0]


def test_the_chat_example_bounds_its_reply(monkeypatch, capsys):
    """Issue 37: the example set no max_tokens, and the server then generates to the end of the
    context (serve/sampling.py check_fits): minutes on the embedded model. Run as written against
    a stand-in for the openai package that records the request."""
    calls = []

    def create(**request):
        calls.append(request)
        message = types.SimpleNamespace(content="hello")
        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=message)])

    class OpenAI:
        def __init__(self, base_url, api_key):
            self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=create))

    monkeypatch.setitem(sys.modules, "openai", types.SimpleNamespace(OpenAI=OpenAI))
    exec(python_block_with("chat.completions.create"), {})
    assert len(calls) == 1 and calls[0]["messages"] == [{"role": "user", "content": "Hi"}]
    assert 1 <= calls[0].get("max_tokens", 0) <= 256
    assert capsys.readouterr().out == "hello\n"
