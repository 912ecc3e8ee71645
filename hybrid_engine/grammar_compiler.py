"""Compiling structured-output constraints against the model's vocabulary, off the engine loop.

xgrammar compiles a grammar into token-mask tables for one vocabulary: from milliseconds for a
regex to a second or more for a large schema over a 250k vocabulary. The engine must not stop
for it, so compiling runs in one worker thread: a request holds a Future and waits in the
queue while others run (Scheduler skips it), and its first sampling finds the grammar ready.
Compiled grammars are kept by their constraint's text (`StructuredOutputsParams.key`), so a
schema that every request of an agent repeats is compiled once.

The vocabulary is the model's rows, not the tokenizer's: Qwen3.5 has 248,320 rows and 248,044
tokenizer tokens, and rows past the tokenizer are never allowed (xgrammar treats them as
special tokens). The stop tokens are the engine's EOS ids: the grammar allows them exactly
where the structure may end.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from .structured_outputs import StructuredOutputsParams

# Compiled grammars kept for reuse. Each holds mask tables of a few bytes per vocabulary row
# per grammar state it caches, so the count is bounded, oldest use first out.
MAX_CACHED_GRAMMARS = 64


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.think_tokens = _think_tokens(tokenizer)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        # xgrammar's own threads work inside one compile; our one worker keeps compiles in order.
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max(1, min(4, os.cpu_count() or 1)),
                                             cache_enabled=False)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybrid-engine-grammar")
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A Future of the CompiledGrammar for `params`: the cached one when the same constraint
        was compiled (or is compiling) before, else a new compile in the worker thread."""
        key = params.key()
        with self._lock:
            future = self._compiled.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._compiled.move_to_end(key)
                return future
            future = self._worker.submit(self._compile, params)
            self._compiled[key] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return future

    def _compile(self, params: StructuredOutputsParams):
        return self._compiler.compile_grammar(params.grammar_object())

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def _think_tokens(tokenizer) -> tuple[int, int] | None:
    """(`<think>`, `</think>`) token ids where the vocabulary has both as single tokens. Built
    here, at the first constrained request: reading a 248k vocabulary takes about 0.2 s, which
    an engine's start-up should not pay for requests that may never come."""
    vocab = tokenizer.get_vocab()
    start, end = vocab.get("<think>"), vocab.get("</think>")
    return None if start is None or end is None else (start, end)
