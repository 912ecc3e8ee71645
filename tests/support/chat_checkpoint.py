"""A tiny chat checkpoint whose greedy output is a script: it thinks, then calls a tool.

    folder = make_chat_checkpoint(tmp_path / "chat")

Its chat template is Qwen3-style: tools are rendered into the system turn, tool calls and
tool results into their turns, and `enable_thinking=True` (a chat_template_kwargs entry)
opens a `<think>` block at the start of the assistant turn.

The weights make the next token a function of the current token only: every layer's output
projection is zero, so the last hidden state is the current token's embedding, and row s of
lm_head is the (normalised) embedding of the token whose successor is s. The script's pieces
are added tokens, each used once, so the chain is a plain successor map:

    thinking off: "\\n" -> CONTENT, <tool_call>, CALL..., </tool_call>, <|im_end|>
    thinking on:  <think> -> REASONING, </think>, CONTENT, ... (the same tail)

Every other token's successor is itself. See SCRIPT_* for the texts the server must return.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoints import _corpus, make_hf_model, save_checkpoint

REASONING = "The user wants the weather, so I call the tool."
CONTENT = "Let me check."
CALL_PIECES = ('\n{"name": "get_weather", "arguments": ', '{"city": "Paris", "unit": "celsius"}', "}\n")
TOOL_NAME = "get_weather"
TOOL_ARGUMENTS = '{"city": "Paris", "unit": "celsius"}'
TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}{% for c in m.tool_calls or [] %}
<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking %}<think>{% endif %}{% endif %}"""


def make_chat_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    from qwen35_bpe import train_qwen35_bpe

    folder = Path(folder)
    tok = train_qwen35_bpe(_corpus().splitlines(keepends=True), 256, byte_alphabet=False)
    pieces = (REASONING, CONTENT, *CALL_PIECES)
    tok.add_tokens(list(TAGS) + list(pieces))
    tok.chat_template = TEMPLATE
    vocab_size = len(tok)
    model = make_hf_model("qwen3_5", seed=seed, vocab_size=vocab_size)
    save_checkpoint(model, folder)
    tok.save_pretrained(str(folder))

    ids = {t: tok.convert_tokens_to_ids(t) for t in TAGS + pieces + ("<|im_end|>", "<|endoftext|>")}
    newline = tok.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    successor = {t: t for t in range(vocab_size)}
    chain = [newline[0], ids[CONTENT], ids["<tool_call>"], *(ids[p] for p in CALL_PIECES), ids["</tool_call>"],
             ids["<|im_end|>"]]
    thinking = [ids["<think>"], ids[REASONING], ids["</think>"], ids[CONTENT]]
    for path in (chain, thinking):
        for a, b in zip(path, path[1:]):
            successor[a] = b
    _write_successor_weights(folder, successor, seed)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token_id"] = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    return folder


@torch.no_grad()
def _write_successor_weights(folder: Path, successor: dict[int, int], seed: int) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name in tensors:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    tensors["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])   # (1 + w) = 1
    emb = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=torch.Generator().manual_seed(seed))
    unit = emb / emb.norm(dim=1, keepdim=True)
    head = torch.zeros_like(emb)
    for t, s in successor.items():
        head[s] += 2.0 * unit[t]
    # the script holds only if every token's top logit is its successor's
    assert torch.equal((unit @ head.T).argmax(dim=1), torch.tensor([successor[t] for t in range(len(emb))]))
    tensors["model.embed_tokens.weight"] = emb
    tensors["lm_head.weight"] = head
    save_file(tensors, str(path))
