"""Incremental detokenizing (a window of recent tokens per update) against full decodes, on the
embedded model's byte-level BPE tokenizer: text split into multi-byte characters across
tokens, spaces joining words, and arbitrary token ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_engine.default_model import default_model_path
from hybrid_engine.tokenizer import IncrementalDetokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_path())


def stream(tok, ids):
    detok, deltas = IncrementalDetokenizer(tok), []
    for i in range(1, len(ids) + 1):
        deltas.append(detok.update(ids[:i]))
        full = tok.decode(ids[:i], skip_special_tokens=True)
        if not full.endswith("\ufffd"):          # nothing is held back: all text is out
            assert detok.text == full
    assert "".join(deltas) == detok.text
    return detok


def test_multibyte_characters_and_spaces(tok):
    text = "def f(x):\n    return 'héllo wörld 世界 🎉' + x  # ok\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert stream(tok, ids).text == text
    detok = IncrementalDetokenizer(tok)
    emoji = tok.encode("🎉", add_special_tokens=False)
    assert len(emoji) > 1                                       # one character, several tokens
    assert [detok.update(emoji[:i]) for i in range(1, len(emoji) + 1)][-1] == "🎉"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_matches_full_decode_for_any_ids(tok, data):
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=40))
    stream(tok, ids)


@settings(max_examples=40, deadline=None)
@given(text=st.text(min_size=1, max_size=60))
def test_round_trips_any_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    if ids:
        assert stream(tok, ids).text == tok.decode(ids, skip_special_tokens=True)
