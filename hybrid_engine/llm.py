"""The user-facing API: LLM(...).generate / generate_stream / chat.

Every call runs through one EngineLoop (hybrid_engine/engine_loop.py), so threads may share
an LLM: their requests are batched together by the one engine, and each call receives only
its own requests' outputs. No call waits on an engine that cannot answer: a request that
fails in the engine raises RuntimeError from the engine's error, and once the engine loop
has died every waiting and later call raises EngineDeadError within moments.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from .config import EngineConfig
from .engine import LLMEngine, PreparedPrompt
from .engine_loop import EngineDeadError, EngineLoop
from .tensor_parallel import serve_if_worker_rank
from .generation_defaults import load_generation_defaults
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", block_size: int = 16,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int = 2048,
                 cache_memory_bytes: int | None = None, speculative_config: dict | None = None,
                 max_model_len: int | None = None, device: str = "cpu", seed: int = 0,
                 enforce_eager: bool = False, cuda_graph_batch_sizes: list[int] | None = None,
                 enable_torch_compile: bool = False, bf16_few_rows_copy: bool = True,
                 enable_prefix_caching: bool = True, prefix_checkpoints: int | None = None,
                 prefix_checkpoint_interval: int | None = None, generation_config: str = "auto",
                 kernel_backend: str = "auto", quantization: str | None = None,
                 quantization_group_size: int | None = None, tensor_parallel_size: int = 1):
        """generation_config: "auto" takes the default sampling parameters (used when a call
        gives none) from the model folder's generation_config.json; "vllm" ignores that file
        (vLLM's flag and values). quantization: "int8" or "int4" quantizes a float checkpoint's
        projections at load, in groups of quantization_group_size (default 32) input columns
        (hybrid_engine/quantization.py says which projections). tensor_parallel_size: N > 1
        runs the model over N processes on this machine, this one and N-1 it starts
        (hybrid_engine/tensor_parallel.py); shutdown() ends them."""
        if generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got {generation_config!r}")
        config = EngineConfig(
            model=model, dtype=dtype, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, cache_memory_bytes=cache_memory_bytes,
            speculative_config=speculative_config, max_model_len=max_model_len, device=device, seed=seed,
            enforce_eager=enforce_eager, cuda_graph_batch_sizes=cuda_graph_batch_sizes,
            enable_torch_compile=enable_torch_compile, bf16_few_rows_copy=bf16_few_rows_copy,
            enable_prefix_caching=enable_prefix_caching, prefix_checkpoints=prefix_checkpoints,
            prefix_checkpoint_interval=prefix_checkpoint_interval, kernel_backend=kernel_backend,
            quantization=quantization, quantization_group_size=quantization_group_size,
            tensor_parallel_size=tensor_parallel_size)
        config.validate()
        serve_if_worker_rank(config)        # under torchrun, a rank > 0 ends here (tensor_parallel.py)
        self.loop = EngineLoop(lambda: LLMEngine(config))   # built on the loop thread (engine_loop.py)
        self._generation_defaults = (load_generation_defaults(self.engine.config.model)
                                     if generation_config == "auto" else {})

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params uses: SamplingParams' defaults updated with the
        model's generation_config.json (vLLM's method of the same name)."""
        return SamplingParams(**self._generation_defaults)

    @property
    def engine(self) -> LLMEngine:
        return self.loop.engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer, None without one (vLLM's method of the same name)."""
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forgets the cached prefixes no running request holds (vLLM's method of the same name)."""
        self.loop.run_on_loop(lambda engine: engine.reset_prefix_cache())

    def shutdown(self) -> None:
        """Aborts whatever is still running and stops the engine loop's thread (and with it the
        tensor-parallel workers, if any)."""
        self.loop.shutdown()

    def __del__(self) -> None:
        loop = self.__dict__.get("loop")   # absent when __init__ failed
        if loop is not None:
            loop.shutdown()

    def _normalise(self, prompts, sampling_params) -> list[PreparedPrompt]:
        """Checks every prompt and parameter before anything runs; ValueError names the index."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        else:
            raise ValueError("sampling_params must be a SamplingParams, a list of them, or None; "
                             f"got {type(sampling_params).__name__}")
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            p = self.get_default_sampling_params() if p is None else p
            try:
                checked.append(self.engine.prepare(prompt, p))      # the request's one check
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return checked

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yields a RequestOutput each time one of these requests advances (new_token_ids /
        new_text are the delta), only these requests'. With SamplingParams(n > 1), its
        `outputs` are the completions that advanced, each with its index and delta. Prompts are checked at once; they run
        from the first next(). Closing the generator, or dropping it, aborts what is left."""
        return self._stream(self._normalise(prompts, sampling_params))

    def _stream(self, checked) -> Iterator[RequestOutput]:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        unfinished: set[str] = set()
        try:
            for prepared in checked:
                unfinished.add(self.loop.submit(prepared, on_output=inbox.put).request_id)
            while unfinished:
                out = _received(self.loop.receive(inbox))
                if out.finished:
                    unfinished.discard(out.request_id)
                yield out
        finally:  # a consumer that stops early must not leave requests holding memory
            for request_id in unfinished:
                self.loop.abort(request_id)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """The finished outputs of these prompts, in input order, one per prompt: with
        SamplingParams(n=...), its `outputs` hold the n completions (other callers' requests
        run alongside in the same batches, and this call waits for none of them)."""
        checked = self._normalise(prompts, sampling_params)
        inbox: queue.SimpleQueue = queue.SimpleQueue()

        def keep_final(out) -> None:
            if isinstance(out, BaseException) or out.finished:
                inbox.put(out)

        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(checked), desc="generate", disable=not use_tqdm)
        try:
            for prepared in checked:
                ids.append(self.loop.submit(prepared, on_output=keep_final).request_id)
            while len(final) < len(ids):
                out = _received(self.loop.receive(inbox))
                final[out.request_id] = out
                bar.update(1)
        finally:
            bar.close()
            for request_id in ids:
                if request_id not in final:
                    self.loop.abort(request_id)
        return [final[request_id] for request_id in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True):
        """Applies the tokenizer's chat template (with the generation prompt), then generates.
        messages: one conversation (a list of {"role": str, "content": str}) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model folder has none")
        prompts = [self._render_chat(i, c) for i, c in enumerate(_as_conversations(messages))]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _render_chat(self, index: int, conversation: list[dict]) -> str:
        try:
            return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as e:   # jinja and tokenizer errors come in many types
            raise ValueError(f"conversation {index}: the chat template cannot render it: {e}") from None


def _as_prompt_list(prompts) -> list:
    """One prompt (a str, or a list of token ids) or a list of prompts -> a list of prompts.
    A list holding anything but str and lists is one token-id prompt, so that a bad id
    ([1, 2.0]) is reported as a bad id, not as a bad prompt."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a str, a list of token ids, or a non-empty list of those; "
                         f"got {_describe(prompts)}")
    if all(isinstance(p, (str, list, tuple)) for p in prompts):
        return list(prompts)
    if any(isinstance(p, (str, list, tuple)) for p in prompts):
        raise ValueError("prompts mixes token ids with str / list prompts: pass one list of token ids, "
                         "or a list of prompts")
    return [prompts]


def _as_conversations(messages) -> list[list[dict]]:
    if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, dict) for m in messages):
        conversations = [list(messages)]
    elif (isinstance(messages, (list, tuple)) and messages
          and all(isinstance(c, (list, tuple)) and c for c in messages)):
        conversations = [list(c) for c in messages]
    else:
        raise ValueError('messages must be a conversation (a non-empty list of {"role": ..., "content": ...} '
                         f"dicts) or a non-empty list of conversations; got {_describe(messages)}")
    for i, conversation in enumerate(conversations):
        for j, m in enumerate(conversation):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"conversation {i}, message {j}: expected a dict with str 'role' and "
                                 f"'content', got {_describe(m)}")
    return conversations


def _received(item) -> RequestOutput:
    """A consumer's delivery -> the output, or the error that ended its request, raised in a
    new exception of this call's own (one error may end several calls' requests)."""
    if isinstance(item, EngineDeadError):
        raise EngineDeadError(str(item)) from item
    if isinstance(item, BaseException):
        raise RuntimeError(f"a request failed in the engine: {item!r}") from item
    return item


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"

