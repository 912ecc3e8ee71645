"""Tokenizer glue: the folder's HF tokenizer through transformers, and incremental detokenizing."""

from __future__ import annotations

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


class IncrementalDetokenizer:
    """Decodes a growing token list; holds back text that ends in an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""

    def update(self, token_ids: list[int]) -> str:
        """-> the text added since the last call."""
        full = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):       # a multi-byte character is split across tokens
            return ""
        delta = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return delta
