"""The engine: its parts wired once (kernels, model, cache, scheduler, runner), and the
requests' side of it (add, abort, the outputs per caller, a failed step's cleanup). The step
itself, schedule -> build -> forward -> sample / verify -> draft -> update, is engine_step.py.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import threading
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from hybrid_engine.kernels import make_backend
from hybrid_engine.models import load_config, load_model
from hybrid_engine.models.load import release_freed_memory
from hybrid_engine.models.parallel import SINGLE, check_tensor_parallel

from .cache_sizing import DEFAULT_KV_TOKENS_PER_SEQ, build_cache, cache_spec_for
from .config import EngineConfig
from .default_model import resolve_model
from .cuda_graph_steps import CudaGraphSteps, default_buckets, graphs_supported
from .draft_inputs import DraftInputBuilder
from .engine_step import EngineStep
from .model_runner import EagerSteps, ModelRunner
from .outputs import RequestOutput
from .prompt import PreparedPrompt, encode_prompt
from .checkpoint_formats.gguf import GgufFile, is_gguf
from .quantization import quantized_layers, tensor_parallel_blocks
from .prefix_caching import PrefixCaching
from .grammar_compiler import GrammarCompiler
from .request import Request
from .request_grammar import RequestGrammar
from .request_group import AutomaticRequestIds, RequestGroup, check_caller_request_id, sample_request_id
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .step_inputs import StepInputBuilder
from .step_update import StepUpdater, request_output, take_text_delta
from .tensor_parallel import TensorParallelGroup, TensorParallelSteps, serve_if_worker_rank
from .tokenizer import IncrementalDetokenizer, load_tokenizer
from hybrid_engine.spec_decode.mtp_drafter import MTPDrafter
from hybrid_engine.spec_decode.stats import SpecStats

logger = logging.getLogger(__name__)


def parse_speculative_config(spec: dict | None) -> int:
    """-> the number of speculative tokens k (0 = off); ValueError naming what is wrong."""
    if spec is None:
        return 0
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
    unknown = set(spec) - {"method", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"speculative_config has unknown keys: {sorted(unknown)}")
    if spec.get("method", "mtp") != "mtp":
        raise ValueError(f"speculative_config method {spec.get('method')!r} is not supported (only 'mtp')")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8:
        raise ValueError(f"num_speculative_tokens must be an int in 1..8, got {k!r}")
    return k


class StepFailedError(RuntimeError):
    """LLMEngine.step() failed; the requests it was running (request_ids, the callers' ids) are
    aborted and every other request goes on. The original error is its __cause__."""

    def __init__(self, request_ids: list[str], error: BaseException):
        super().__init__(f"an engine step failed: {error!r}; its requests {request_ids} were aborted")
        self.request_ids = request_ids


def check_splits(config: EngineConfig, gguf_file: GgufFile | None = None) -> None:
    """ValueError where tensor_parallel_size does not split the model (its heads, experts,
    quantization groups), before any process starts or joins the group. gguf_file: the model's,
    where it is one and open already."""
    if gguf_file is None and is_gguf(config.model):
        gguf_file = GgufFile(config.model)
    check_tensor_parallel(gguf_file.config if gguf_file is not None else load_config(config.model),
                          config.tensor_parallel_size, *tensor_parallel_blocks(config, gguf_file))


class EngineDeadError(RuntimeError):
    """The engine cannot go on (vLLM's name): every pending and later call raises it at once."""


class LLMEngine:
    # Set when cleaning up after a failed step failed too: the engine then refuses to go on.
    _failure: BaseException | None = None

    def __init__(self, config: EngineConfig):
        config.validate()
        resolve_model(config)
        serve_if_worker_rank(config)        # under torchrun, a rank > 0 ends here (tensor_parallel.py)
        self.config = config
        # Without speculation the MTP head is checked but not kept: no weights, no KV pool.
        self.num_speculative_tokens = k = parse_speculative_config(config.speculative_config)
        gguf_file = GgufFile(config.model) if is_gguf(config.model) else None
        # Tensor parallelism: the workers start first and load their parts beside the driver's.
        self.tp_group = None
        if config.tensor_parallel_size > 1:
            check_splits(config, gguf_file)
            self.tp_group = TensorParallelGroup(config, config.tensor_parallel_size)
        try:
            self._wire(config, k, gguf_file)
        except BaseException:
            self.shutdown()
            raise
        # what building freed (the tokenizer file's parse, loading's transients) but glibc kept
        release_freed_memory()

    def _wire(self, config: EngineConfig, k: int, gguf_file: GgufFile | None) -> None:
        tp = self.tp_group.parallel if self.tp_group is not None else SINGLE
        # The kernel backend (kernels/backends.py), chosen once: every step's ForwardBatch carries
        # it, and its linear method gives the projections their weight layouts as they load.
        self.kernels = make_backend(config.kernel_backend, config.device)
        method = self.kernels.linear_method(compiled=config.enable_torch_compile,
                                            few_rows_copy=config.bf16_few_rows_copy)
        # Online quantization: a method per projection layer instead (None: float weights).
        quantized = quantized_layers(config, method, self.kernels, gguf_file)
        self.model, self.model_config = load_model(
            config.model, config.dtype, config.device, with_mtp=k > 0, method=method, methods=quantized,
            progress=quantized.progress_bar if quantized else None, source=gguf_file, tp=tp)
        if quantized:
            quantized.report()
        self.tokenizer = gguf_file.tokenizer() if gguf_file is not None else load_tokenizer(config.model)
        if k and self.model.mtp is None:
            raise ValueError(f"speculative_config asks for MTP drafts but {config.model} has no mtp.* weights")
        prefix_on = config.enable_prefix_caching
        spec = cache_spec_for(self.model_config, self.model, config.block_size, checkpoint_hidden=prefix_on and k > 0,
                              tp=tp)
        max_len = config.max_model_len or self.model_config.max_position_embeddings
        # Refused as vLLM does, unless told otherwise (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN).
        if (max_len > self.model_config.max_position_embeddings
                and os.environ.get("HYBRID_ENGINE_ALLOW_LONG_MAX_MODEL_LEN") != "1"):
            raise ValueError(f"max_model_len ({max_len}) is greater than the model's max_position_embeddings "
                             f"({self.model_config.max_position_embeddings}) in {config.model}/config.json; "
                             "positions past it were never trained (set "
                             "HYBRID_ENGINE_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway)")
        self.tokens_per_seq = min(max_len, DEFAULT_KV_TOKENS_PER_SEQ)
        self.max_num_seqs_derived = config.max_num_seqs is None
        self.cache = build_cache(config, spec, k, self.tokens_per_seq)
        if self.tp_group is not None:
            self.tp_group.start_cache(self.cache.pools)
        self.prefix = (PrefixCaching(self.cache, config.block_size, config.prefix_checkpoint_interval)
                       if prefix_on else None)
        # A request can never hold more tokens than the whole KV pool, including the 2k
        # positions a verify step and the drafting after it may touch past its length.
        self.max_model_len = min(max_len, self.cache.num_blocks * config.block_size - 2 * k)
        if self.max_model_len < 2:
            raise ValueError("cache_memory_bytes leaves room for fewer than 2 tokens per request")
        logger.info("%s", self.capacity_summary())
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens, k, self.prefix)
        max_blocks_per_seq = math.ceil((self.max_model_len + 2 * k) / config.block_size) + 1
        self.builder = StepInputBuilder(config.max_num_batched_tokens, config.max_num_seqs,
                                        max_blocks_per_seq, config.block_size, k, config.device,
                                        self._keyless_query_lens(), self._recurrent_prefill(), self.kernels)
        drafts = (DraftInputBuilder(config.max_num_batched_tokens, config.max_num_seqs, max_blocks_per_seq,
                                    config.block_size, k, config.device, self.builder.keyless_query_lens,
                                    self.kernels) if k else None)
        self.runner = ModelRunner(self._execution(), drafts)
        self.drafter = MTPDrafter(self.runner, self.cache) if k else None
        self.spec_stats = SpecStats(k) if k else None
        self.updater = StepUpdater(self.scheduler, self.cache, self.max_model_len, self.spec_stats, self.prefix)
        self.step_pipeline = EngineStep(self.cache, self.builder, self.runner, self.drafter, self.updater,
                                        self.max_model_len, prefix_caching=prefix_on)
        # The engine's seed reaches every unseeded request as a seed of its own, drawn in
        # arrival order: the same calls give the same samples run to run (vLLM's LLM(seed=...)),
        # whatever else shares their batches.
        self._seed_source = random.Random(config.seed)
        self.requests: dict[str, Request] = {}         # every sequence, by its own id
        self.groups: dict[str, RequestGroup] = {}      # requests with n > 1, by the caller's id
        self.request_ids = AutomaticRequestIds()       # for requests added without an id
        self.eos_token_ids = list(self.model_config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            if self.tokenizer.eos_token_id not in self.eos_token_ids:
                self.eos_token_ids.append(self.tokenizer.eos_token_id)
        # Structured outputs: the compiler is made at the first constrained request (it builds
        # the vocabulary's tables), on whichever thread prepares it.
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()

    def capacity_summary(self) -> str:
        """What the cache holds, in requests and tokens (as vLLM's "maximum concurrency for N
        tokens per request"); logged once at start-up (logging.INFO, logger hybrid_engine.engine)."""
        cache, cfg = self.cache, self.config
        kv_tokens = cache.num_blocks * cfg.block_size
        derived = " (derived from cache_memory_bytes)" if self.max_num_seqs_derived and cfg.cache_memory_bytes else ""
        lengths = sorted({min(self.tokens_per_seq, self.max_model_len), self.max_model_len})
        concurrency = [f"{min(cfg.max_num_seqs, kv_tokens / n):.2f} for {n} tokens per request" for n in lengths]
        return (f"KV cache: {cache.num_blocks} blocks of {cfg.block_size} tokens ({kv_tokens} tokens); "
                f"max_num_seqs {cfg.max_num_seqs}{derived}; maximum concurrency {', '.join(concurrency)}; "
                f"{cache.prefix_store.checkpoints.size} prefix checkpoints")

    def _keyless_query_lens(self) -> frozenset[int]:
        """The query lengths whose attention reads no PagedKeys in any layer, so that steps of
        them are built without: decode and verify (1, 1 + k), and the MTP drafter's passes
        (1..k+1 tokens per request). Compiled steps too: their graphs call
        the same native kernel, which reads the block tables; no op of theirs read the keys,
        which cost the steady state two scatters a step."""
        heads = self.model_config.num_attention_heads
        return frozenset(q for q in range(1, self.num_speculative_tokens + 2)
                         if not any(self.kernels.attention_reads_keys(kv, heads, q) for kv in self.cache.pools.kv_caches))

    def _recurrent_prefill(self) -> bool:
        """Whether prefill segments' GDN layers run by the decode kernel (the backend says where:
        KernelBackend.gdn_decode_serves_prefill, for every GDN layer, whose activations are in
        the conv pools' dtype)."""
        pools = self.cache.pools
        return bool(pools.conv_states) and all(
            self.kernels.gdn_decode_serves_prefill(conv, state, self.model_config.linear_conv_kernel_dim, conv.dtype)
            for conv, state in zip(pools.conv_states, pools.recurrent_states))

    def _execution(self) -> EagerSteps:
        """How the runner runs steps (hybrid_engine/model_runner.py): CUDA graphs for decode and
        verify steps unless enforce_eager or not capturable (graphs need CUDA tensors, the triton
        backend (the torch ops read lengths back to the host) and a dense model (MoE routing
        reads expert counts back)); else torch.compile where asked; else eagerly."""
        cfg, k = self.config, self.num_speculative_tokens
        if self.tp_group is not None:
            return TensorParallelSteps(self.model, self.cache.pools, self.tp_group)
        if (not cfg.enforce_eager and torch.device(cfg.device).type == "cuda" and graphs_supported(self.model)
                and self.kernels.name == "triton"):
            graphs = CudaGraphSteps(self.model, self.cache.pools, self.builder, [1, 1 + k] if k else [1],
                                    cfg.cuda_graph_batch_sizes or default_buckets(cfg.max_num_seqs), capture=True)
            with torch.inference_mode():
                graphs.capture()
            return graphs
        if cfg.enable_torch_compile:
            # imported here: torch.compile's machinery (dynamo, inductor) holds about 110 MiB of
            # memory once imported, which an eager engine never needs (benchmarks/RESULTS.md, issue 39)
            from .compiled_steps import CompiledSteps
            return CompiledSteps(self.model, self.cache.pools)
        return EagerSteps(self.model, self.cache.pools)

    # ---- requests ----------------------------------------------------------------------
    def encode_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """Validates one prompt (str or list of token ids) -> (text, token ids); ValueError if bad."""
        return encode_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)

    def prepare(self, prompt, params: SamplingParams | None = None) -> PreparedPrompt:
        """The one check of a request before it runs: params validated (and copied: the caller
        may change or reuse its object while the request runs), the prompt tokenized and checked.
        ValueError naming the problem. Callers that queue a request elsewhere (EngineLoop, LLM)
        prepare it once and pass the PreparedPrompt on: given one, this returns it as it is (it
        carries its params, so `params` must be None)."""
        if isinstance(prompt, PreparedPrompt):
            if params is not None:
                raise ValueError("a PreparedPrompt carries its own sampling params; pass params=None")
            return prompt
        params = copy.deepcopy(self.validate_params(params))
        text, ids = self.encode_prompt(prompt)
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError(f"structured_outputs needs the model's tokenizer to map the grammar onto tokens; "
                                 f"{self.config.model} has none")
            self.grammar_compiler.submit(params.structured_outputs)    # starts compiling now
        return PreparedPrompt(text, ids, params)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                         self.eos_token_ids)
            return self._grammar_compiler

    def validate_params(self, params) -> SamplingParams:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.model_config.vocab_size)
        return params

    def shutdown(self) -> None:
        """Ends the tensor-parallel workers, if any; the engine takes no step after it (the
        engine loop calls it as its thread ends)."""
        if self.tp_group is not None:
            self.tp_group.shutdown()

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Validate and queue one request; a bad one raises ValueError and changes nothing.
        prompt: a str, token ids, or a PreparedPrompt (`prepare`d already, in the caller's thread:
        EngineLoop; it carries its params, so `params` must be None)."""
        self._check_alive()
        prepared = self.prepare(prompt, params)
        text, ids, params = prepared.text, prepared.token_ids, prepared.params
        if request_id is None:
            request_id = self.request_ids.new(self._id_in_use)
        request_id = str(request_id)
        check_caller_request_id(request_id)
        if self._id_in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            req = self._new_request(request_id, text, ids, params, 0)
            self.requests[request_id] = req
            self.scheduler.add(req)
            return request_id
        # No caller's id has the samples' form (check_caller_request_id), so theirs are free.
        samples = [self._new_request(sample_request_id(request_id, i), text, ids, params, i)
                   for i in range(params.n)]
        self.groups[request_id] = RequestGroup(request_id, samples)
        self.requests.update((s.request_id, s) for s in samples)
        # Sample 0 prefills the shared prefix (hybrid_engine/request_group.py), with or without
        # prefix caching: a cache hit could not share the prompt's last, partial block, so a
        # prompt shorter than a block would be computed n times.
        if len(ids) > 1:
            samples[0].forks = samples[1:]
            self.scheduler.add(samples[0])
        else:
            for sample in samples:
                self.scheduler.add(sample)
        return request_id

    def _id_in_use(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in self.groups

    def _new_request(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
                     index: int) -> Request:
        req = Request(request_id, text, ids, params, self.eos_token_ids,
                      sampling_seed=self.sampling_seed(params, index), index=index)
        if params.prompt_logprobs is not None and index == 0:    # sample 0 scores the prompt n samples share
            req.prompt_logprobs = [None]                          # nothing predicts the first token
        if self.num_speculative_tokens:
            req.spec_stats = SpecStats(self.num_speculative_tokens)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer)
        if params.structured_outputs is not None:
            req.grammar = RequestGrammar(self.grammar_compiler.submit(params.structured_outputs),
                                         think_end=self._open_think_block_end(ids))
        return req

    def _open_think_block_end(self, prompt_ids: list[int]) -> int | None:
        """The `</think>` token id when the prompt leaves the model inside a think block (its
        last `<think>` after its last `</think>`: Qwen3.5's template with thinking on), so that
        a constraint starts after the reasoning; else None."""
        think_tokens = self.grammar_compiler.think_tokens
        if think_tokens is None:
            return None
        start, end = think_tokens
        last = {start: -1, end: -1}
        for i, t in enumerate(prompt_ids):
            if t in last:
                last[t] = i
        return end if last[start] > last[end] else None

    def sampling_seed(self, params: SamplingParams, index: int = 0) -> int:
        """The seed that keys the sampling of sample `index` of a request: its own
        (params.child_seed), or for an unseeded request a fresh one from the engine's seed
        source (the one place unseeded randomness comes from)."""
        seed = params.child_seed(index)
        return seed if seed is not None else self._seed_source.getrandbits(64)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all of its n samples) now and free its memory at once. Takes the
        caller's id: the id of one of n samples is not a request of its own."""
        request_id = str(request_id)
        group = self.groups.pop(request_id, None)
        if group is not None:
            # All of them may have finished in a step that failed before it could say so.
            aborted = [self._abort(s) for s in group.samples if not s.is_finished]
            return group.merge(aborted) if aborted else None
        req = self.requests.get(request_id)
        if req is None or req.group is not None:
            return None
        return self._abort(req)

    def _abort(self, req: Request) -> RequestOutput:
        del self.requests[req.request_id]
        self.scheduler.finish(req)
        req.finish_reason = "abort"
        return request_output(req, [], take_text_delta(req))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_stats(self) -> dict | None:
        """Prefix cache counters since start-up and what it holds now; None when it is off."""
        if self.prefix is None:
            return None
        u = self.cache.usage()
        return {**self.prefix.stats.as_dict(), "blocks_cached": u["blocks_cached"],
                "checkpoints_held": u["checkpoints_published"], "checkpoints_pending": u["checkpoints_pending"],
                "checkpoint_lengths": sorted(c.num_tokens for c in self.cache.prefix_store.checkpoints.published())}

    def reset_prefix_cache(self) -> None:
        """Forgets the cached prefixes no running request holds: later requests compute their
        prompts again (benchmarks that repeat prompts; vLLM's method of the same name)."""
        self.cache.prefix_store.reset()

    # ---- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward for the whole mixed batch; returns outputs of requests that advanced.

        A step that raises leaves nothing half-done: the requests it ran (whose cache and
        tokens it may have left half-updated) are aborted first, and it raises StepFailedError
        naming them (from the original error; a KeyboardInterrupt is re-raised as it is); every
        other request goes on. A step that ran no request (none fits the cache, or scheduling
        itself failed) aborts every request, or the next step would fail the same way. If that
        cleanup fails too, the engine's state is unknown: EngineDeadError, now and at every
        later step() or add_request()."""
        self._check_alive()
        batch = None
        try:
            failed = self._fail_uncompiled_grammars()
            batch = self.scheduler.schedule()
            return failed + self._run_step(batch)
        except BaseException as error:
            request_ids = self._abort_failed_step(batch, error)
            if not isinstance(error, Exception):
                raise       # KeyboardInterrupt and its kind, as they are
            self._check_alive()     # a broken tensor-parallel group ends the engine, not the step
            raise StepFailedError(request_ids, error) from error

    def _run_step(self, sched: ScheduledBatch) -> list[RequestOutput]:
        if sched.is_empty:
            compiling = self.scheduler.waiting_for_grammars()
            if compiling:
                # Nothing else can run: wait a little for a grammar rather than spin.
                wait([r.grammar.compiled for r in compiling], timeout=0.05, return_when=FIRST_COMPLETED)
                return []
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress: no request fits the cache")
            return []
        return self._caller_outputs(self.step_pipeline.run(sched))

    def _fail_uncompiled_grammars(self) -> list[RequestOutput]:
        """Aborts the waiting requests whose grammar failed to compile (their constraint was
        parsed when they were prepared, so this is xgrammar failing on a valid one)."""
        outputs = []
        if self._grammar_compiler is None:      # no constrained request yet: nothing to look at
            return outputs
        for req in list(self.scheduler.waiting):
            if req.grammar is not None and req.grammar.failed:
                logger.error("request %s: its structured_outputs grammar failed to compile: %r",
                             req.caller_request_id, req.grammar.compiled.exception())
                out = self.abort_request(req.caller_request_id)
                if out is not None:
                    outputs.append(out)
        return outputs

    def _abort_failed_step(self, batch: ScheduledBatch | None, error: BaseException) -> list[str]:
        """Aborts the failed step's requests (all n samples of each) -> their caller ids."""
        ran = [req for req, _ in batch.prefills] + batch.decodes if batch is not None else []
        victims = ran or list(self.requests.values())
        request_ids = list(dict.fromkeys(req.caller_request_id for req in victims))
        try:
            if batch is not None:
                self.scheduler.void(batch)
            for request_id in request_ids:
                self.abort_request(request_id)
            stuck = [req.request_id for req in victims if not req.is_finished]
            if stuck:
                raise RuntimeError(f"requests {stuck} are still scheduled after their abort")
        except BaseException as cleanup_error:
            self._failure = cleanup_error
            raise EngineDeadError(f"an engine step failed ({error!r}) and aborting its requests failed too "
                                  f"({cleanup_error!r}): the engine's state is unknown") from cleanup_error
        return request_ids

    def _check_alive(self) -> None:
        if self.tp_group is not None and self.tp_group.broken is not None:
            raise EngineDeadError(f"the engine cannot go on: its tensor-parallel group failed "
                                  f"({self.tp_group.broken})") from self.tp_group.broken
        if self._failure is not None:
            raise EngineDeadError(f"the engine cannot go on: cleaning up after a failed step failed "
                                  f"({self._failure!r})") from self._failure

    def _caller_outputs(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Per-sequence outputs -> one per caller's request: the outputs of a request's n
        samples are merged into one (at the place of the first of them)."""
        if not self.groups:             # no request has n > 1: each output is its caller's
            for out in outputs:
                if out.finished:
                    del self.requests[out.request_id]
            return outputs
        result: list[RequestOutput | RequestGroup] = []
        of_group: dict[RequestGroup, list[RequestOutput]] = {}
        for out in outputs:
            req = self.requests[out.request_id]
            if out.finished:
                del self.requests[out.request_id]
            if req.group is None:
                result.append(out)
                continue
            if req.group not in of_group:
                of_group[req.group] = []
                result.append(req.group)
            of_group[req.group].append(out)
        for i, item in enumerate(result):
            if isinstance(item, RequestGroup):
                result[i] = item.merge(of_group[item])
                if result[i].finished:
                    del self.groups[item.request_id]
        return result
