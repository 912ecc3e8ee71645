"""Train a byte-level BPE tokenizer in Qwen3.5's format: how the embedded default model's
tokenizer was made (examples/train_default_model.py), and the tests' tiny tokenizers
(tests/support/checkpoints.py; pytest puts this folder on its path). Not part of the runtime
package: serving only ever loads a tokenizer a model folder already has."""

from __future__ import annotations

from collections.abc import Iterable

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
