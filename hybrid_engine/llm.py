"""The user-facing API: LLM(...).generate / generate_stream / chat."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", block_size: int = 16,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 cache_memory_bytes: int | None = None, speculative_config: dict | None = None,
                 max_model_len: int | None = None, device: str = "cpu", seed: int = 0,
                 enforce_eager: bool = False, cuda_graph_batch_sizes: list[int] | None = None,
                 enable_torch_compile: bool = False, bf16_few_rows_copy: bool = True):
        self.engine = LLMEngine(EngineConfig(
            model=model, dtype=dtype, block_size=block_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, cache_memory_bytes=cache_memory_bytes,
            speculative_config=speculative_config, max_model_len=max_model_len, device=device, seed=seed,
            enforce_eager=enforce_eager, cuda_graph_batch_sizes=cuda_graph_batch_sizes,
            enable_torch_compile=enable_torch_compile, bf16_few_rows_copy=bf16_few_rows_copy))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _normalise(self, prompts, sampling_params) -> list[tuple[object, SamplingParams]]:
        """Checks every prompt and parameter before anything runs; ValueError names the index."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a str, a list of token ids, or a non-empty list of those")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                p = self.engine.validate_params(p)
                self.engine.encode_prompt(prompt)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            checked.append((prompt, p))
        return checked

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yields a RequestOutput each time a request advances (new_token_ids / new_text are the delta)."""
        checked = self._normalise(prompts, sampling_params)
        ids = [self.engine.add_request(p, sp) for p, sp in checked]
        try:
            while self.engine.has_unfinished_requests():
                yield from self.engine.step()
        finally:  # a consumer that stops early must not leave requests holding memory
            for rid in ids:
                self.engine.abort_request(rid)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        checked = self._normalise(prompts, sampling_params)
        ids = [self.engine.add_request(p, sp) for p, sp in checked]
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in final:
                    self.engine.abort_request(rid)
        return [final[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True):
        """Applies the tokenizer's chat template (with the generation prompt), then generates."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model folder has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
