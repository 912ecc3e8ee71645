"""Incremental detokenizing (a window of recent tokens per update: tokenizers' DecodeStream, and
the Python window) against full decodes, on the embedded model's byte-level BPE tokenizer: text
split into multi-byte characters across tokens, spaces joining words, arbitrary token ids,
several tokens in one update."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_engine.default_model import default_model_path
from hybrid_engine.tokenizer import IncrementalDetokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


WAYS = [True, False]      # IncrementalDetokenizer(stream=...)


def stream(tok, ids, way=True, step=1):
    detok, deltas = IncrementalDetokenizer(tok, stream=way), []
    assert detok.streams == way             # the embedded tokenizer's decode is its backend's
    for i in list(range(step, len(ids) + 1, step)) + [len(ids)]:
        deltas.append(detok.update(ids[:i]))
        full = tok.decode(ids[:i], skip_special_tokens=True)
        if not full.endswith("\ufffd"):          # nothing is held back: all text is out
            assert detok.text == full
    assert "".join(deltas) == detok.text
    return detok


@pytest.mark.parametrize("way", WAYS)
def test_multibyte_characters_and_spaces(tok, way):
    text = "def f(x):\n    return 'héllo wörld 世界 🎉' + x  # ok\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert stream(tok, ids, way).text == text
    assert stream(tok, ids, way, step=3).text == text           # a verify appends several at once
    detok = IncrementalDetokenizer(tok, stream=way)
    emoji = tok.encode("🎉", add_special_tokens=False)
    assert len(emoji) > 1                                       # one character, several tokens
    assert [detok.update(emoji[:i]) for i in range(1, len(emoji) + 1)][-1] == "🎉"


@pytest.mark.parametrize("way", WAYS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_matches_full_decode_for_any_ids(tok, way, data):
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=40))
    stream(tok, ids, way, step=data.draw(st.integers(1, 3)))


@pytest.mark.parametrize("way", WAYS)
@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=60))
def test_round_trips_any_text(tok, way, text):
    ids = tok.encode(text, add_special_tokens=False)
    if ids:
        assert stream(tok, ids, way).text == tok.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    """The embedded tokenizer.json under Qwen3.5's own tokenizer class (as the Qwen3.5 checkpoints
    name it), which builds its Rust model from Python copies of the vocabulary and merges."""
    import shutil
    folder = tmp_path_factory.mktemp("qwen_tokenizer")
    shutil.copy(default_model_path() / "tokenizer.json", folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen3_5Tokenizer", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    return folder


@pytest.fixture(scope="module")
def qwen_tok(qwen_folder):
    return load_tokenizer(qwen_folder)


@pytest.fixture(scope="module")
def transformers_tok(qwen_folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(qwen_folder), local_files_only=True)


def test_load_lets_go_of_the_python_vocabulary(qwen_tok, transformers_tok):
    # Qwen3_5Tokenizer keeps Python copies of the vocabulary and merges; load_tokenizer drops them
    # (the Rust model holds its own) and encodes, decodes and saves as before.
    assert type(qwen_tok).__name__ == "Qwen3_5Tokenizer"
    assert len(transformers_tok._vocab) == len(qwen_tok) and len(transformers_tok._merges) > 0
    assert qwen_tok._vocab is None and qwen_tok._merges is None
    assert qwen_tok.get_vocab() == transformers_tok.get_vocab()


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=60))
def test_encodes_as_transformers_does(qwen_tok, transformers_tok, text):
    ids = qwen_tok.encode(text, add_special_tokens=False)
    assert ids == transformers_tok.encode(text, add_special_tokens=False)
    assert qwen_tok.decode(ids) == transformers_tok.decode(ids)


def test_saved_after_the_drop_loads_the_same(qwen_tok, transformers_tok, tmp_path):
    from transformers import AutoTokenizer
    qwen_tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "def f(x):\n    return 'héllo 世界' + x\n"
    assert again.encode(text) == transformers_tok.encode(text) == qwen_tok.encode(text)
