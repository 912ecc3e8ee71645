"""Tokenizer glue: the folder's HF tokenizer through transformers, and incremental detokenizing."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(folder: str | Path):
    """The folder's tokenizer, or None when it has none (token-id prompts still work)."""
    folder = Path(folder)
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # a broken tokenizer should not hide behind a deep traceback
        raise ValueError(f"cannot load the tokenizer in {folder}: {e}") from e


# Qwen3.5's tokenizer format: special tokens, end of text, the pre-tokenizer regex that
# transformers' Qwen3_5Tokenizer uses, and a ChatML template.
QWEN35_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN35_EOS_TOKEN = "<|endoftext|>"
QWEN35_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_qwen35_bpe(texts: Iterable[str], vocab_size: int, byte_alphabet: bool = True):
    """A byte-level BPE in Qwen3.5's format trained on `texts` (the embedded model's tokenizer
    and the tests' tiny ones): the same normalizer, pre-tokenizer and decoder as transformers'
    Qwen3_5Tokenizer, so loading the saved folder either way encodes identically.

    byte_alphabet: start from all 256 bytes (lossless for any text); without it the alphabet is
    what the texts contain. Returns a transformers PreTrainedTokenizerFast (eos and pad
    <|endoftext|>, ChatML chat template) with at most vocab_size entries.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(QWEN35_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_alphabet else [], show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=QWEN35_EOS_TOKEN, pad_token=QWEN35_EOS_TOKEN,
                                   chat_template=CHATML_TEMPLATE)


class IncrementalDetokenizer:
    """Decodes a growing token list in O(1) per token; holds back text that ends in an
    incomplete UTF-8 sequence.

    Decoding the whole output every token is O(L) per token (O(L^2) per request). Instead
    only a window is decoded: the tokens from `prefix_offset` on, whose text up to
    `read_offset` was already emitted. Decoding the window with a few tokens of left context
    lets byte-level BPE and sentencepiece join the new tokens to the old ones as a full
    decode would (a leading space, a multi-byte character split over tokens).
    """

    # Left context kept when the window starts; TGI and vLLM use 5.
    CONTEXT = 5

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""
        self.prefix_offset = 0      # window start
        self.read_offset = 0        # tokens before this are in self.text

    def update(self, token_ids: list[int]) -> str:
        """token_ids: all output tokens so far (the list only grows). -> the text added since
        the last call."""
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
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
