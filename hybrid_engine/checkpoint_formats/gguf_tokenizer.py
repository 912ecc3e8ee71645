"""The tokenizer a GGUF file carries in its metadata, rebuilt as a `tokenizers` byte-level BPE
(what transformers' GGUF integration does): tokenizer.ggml.tokens (id order), .merges ("a b"),
.token_type (3 = control: special tokens; 4 = user-defined: added tokens), .eos_token_id /
.padding_token_id, and the pre-tokenizer's regex chosen by tokenizer.ggml.pre. Only "gpt2"
(byte-level BPE) models with the Qwen pre-tokenizers are read: the ones these models ship with.
"""

from __future__ import annotations

from hybrid_engine.models.config import CheckpointError

# The regexes of llama.cpp's pre-tokenizer names, as transformers' Qwen2 / Qwen3.5 tokenizers
# split text (llama.cpp's src/llama-vocab.cpp holds the same per name).
PRETOKENIZE_REGEX = {
    "qwen35": (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""),
    "qwen2": (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""),
}
CONTROL, USER_DEFINED = 3, 4


def gguf_tokenizer(metadata: dict, where: str):
    """A transformers PreTrainedTokenizerFast from the metadata; None when the file has no
    tokenizer (token-id prompts still work); CheckpointError naming the key it cannot read."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind, pre = metadata.get("tokenizer.ggml.model"), metadata.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise CheckpointError(f"{where}: tokenizer.ggml.model {kind!r} is not supported (only 'gpt2', byte-level BPE)")
    if pre not in PRETOKENIZE_REGEX:
        raise CheckpointError(f"{where}: tokenizer.ggml.pre {pre!r} is not supported ({', '.join(PRETOKENIZE_REGEX)})")
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    types = list(metadata.get("tokenizer.ggml.token_type", []))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == USER_DEFINED])

    def token(key: str) -> str | None:
        i = metadata.get(key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=token("tokenizer.ggml.eos_token_id"),
                                   pad_token=token("tokenizer.ggml.padding_token_id"),
                                   chat_template=metadata.get("tokenizer.chat_template"),
                                   clean_up_tokenization_spaces=False)
