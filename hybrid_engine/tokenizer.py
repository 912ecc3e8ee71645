"""Tokenizer glue: the folder's HF tokenizer through transformers, and incremental detokenizing."""

from __future__ import annotations

import functools
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer, or None when it has none (token-id prompts still work)."""
    folder = Path(folder)
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # a broken tokenizer should not hide behind a deep traceback
        raise ValueError(f"cannot load the tokenizer in {folder}: {e}") from e
    drop_python_vocabulary(tokenizer)
    return tokenizer


# The Python copies of the vocabulary and merges that transformers' byte-level BPE tokenizer
# classes (Qwen3_5Tokenizer among them) build their Rust model from, and then keep.
PYTHON_VOCABULARY = ("_vocab", "_merges")


def drop_python_vocabulary(tokenizer) -> None:
    """Lets go of the tokenizer's Python copies of its vocabulary and merges once the Rust model
    (backend_tokenizer) holds its own: nothing reads them after construction (saving writes the
    backend's tokenizer.json), and at Qwen3.5's vocabulary they hold more than the Rust model
    itself (benchmarks/RESULTS.md, issue 39's memory)."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return
    for name in PYTHON_VOCABULARY:
        if isinstance(getattr(tokenizer, name, None), (dict, list)):
            setattr(tokenizer, name, None)


class IncrementalDetokenizer:
    """Decodes a growing token list in O(1) per token; holds back text that ends in an
    incomplete UTF-8 sequence.

    Decoding the whole output every token is O(L) per token (O(L^2) per request). Instead
    only a window is decoded: the tokens from `prefix_offset` on, whose text up to
    `read_offset` was already emitted. Decoding the window with a few tokens of left context
    lets byte-level BPE and sentencepiece join the new tokens to the old ones as a full
    decode would (a leading space, a multi-byte character split over tokens).

    Where the tokenizer's own decode is its backend's (`_backend_decode`), the window is
    tokenizers' DecodeStream (the same algorithm, in Rust, one call per token: several times
    faster a token, benchmarks/history/RESULTS_LOG.md). `stream=False` keeps the
    Python window everywhere (tests compare the two).
    """

    # Left context kept when the window starts; TGI and vLLM use 5.
    CONTEXT = 5

    def __init__(self, tokenizer, stream: bool = True):
        self.tokenizer = tokenizer
        backend = _backend_decode(tokenizer)
        self._decode_ids = backend or functools.partial(tokenizer.decode, skip_special_tokens=True)
        self._stream = None
        if stream and backend is not None:
            from tokenizers.decoders import DecodeStream
            self._stream = (tokenizer.backend_tokenizer, DecodeStream(skip_special_tokens=True))
        self.text = ""
        self.prefix_offset = 0      # window start
        self.read_offset = 0        # tokens before this are in self.text (stepped into the stream)

    @property
    def streams(self) -> bool:
        """Whether tokenizers' DecodeStream does the decoding."""
        return self._stream is not None

    def update(self, token_ids: list[int]) -> str:
        """token_ids: all output tokens so far (the list only grows). -> the text added since
        the last call."""
        if self._stream is not None:
            backend, stream = self._stream
            pieces = [piece for t in token_ids[self.read_offset:] if (piece := stream.step(backend, t)) is not None]
            self.read_offset = len(token_ids)
            delta = "".join(pieces)
            self.text += delta
            return delta
        window = token_ids[self.prefix_offset:]
        prefix = self._decode(token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(window)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""               # a multi-byte character is still split across tokens
        delta = full[len(prefix):]
        self.text += delta
        # The next window keeps a little left context before the first unread token.
        self.read_offset = len(token_ids)
        self.prefix_offset = max(self.read_offset - self.CONTEXT, 0)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""


def _backend_decode(tokenizer):
    """`tokenizer.decode(ids, skip_special_tokens=True)` as its backend's decode, or None where
    that is not the same function. For a fast tokenizer without the clean-up pass it is exactly
    the backend's decode, which transformers calls after converting and checking the input in
    Python: that wrapper costs about twice the decode itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return functools.partial(backend.decode, skip_special_tokens=True)     # no Python frame per call
    return None
