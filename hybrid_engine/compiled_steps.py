"""torch.compile'd decode and verify forwards and MTP passes (opt-in: EngineConfig.enable_torch_compile).

On CPU a decode step of a small model is hundreds of small torch ops (norms, gates, the GDN
state update, conv taps, rope), each costing a few microseconds of dispatch for very little
arithmetic. Inductor fuses them into a few C++ loops around the matmuls, which roughly halves
a step of the default model, and its C++ wrapper runs the graph's own glue code (buffers, size
checks, the extern calls) without the interpreter, so a step runs no Python per layer. What
it costs: compiling at the first steps of each kind (tens of seconds per graph on a 2-core
machine, the wrapper's C++ included; inductor caches them on disk across processes).

What is compiled: steps without prefill tokens (plain decode, decode_len 1, and verify,
decode_len k+1) and the MTP drafter's drafting after a decode-sized catch-up, all of its
passes in one graph (spec_decode/draft_passes.py; after a prompt's catch-up, which stays
eager, the draft passes alone), never padded. The kernels read nothing back to the host
there, eager or traced: what they need to know about the step comes in the ForwardBatch.
Prefill and mixed steps stay eager: their shapes change every step.

Shapes: the token, request and block-table-width dims are marked dynamic and traced with
size-oblivious reasoning (no specialisation on sizes 0 and 1 where it can be avoided), so a
few graphs serve every batch: one per decode_len and MTP catch-up length, plus a batch-1
variant where an op forces one.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config
import torch.compiler.config as compiler_config
import torch.fx.experimental._config as fx_config
from torch._inductor.compile_fx import compile_fx

from hybrid_engine.kernels import KernelBackend
from hybrid_engine.kernels.native.compile_marks import mark_native_checks
from hybrid_engine.kernels.native.isa import onednn_packs
from hybrid_engine.kernels.native.ops import graph_cache_tag
from hybrid_engine.kernels.slot_pool import DecodeRows
from hybrid_engine.models import HybridForCausalLM
from hybrid_engine.models.batch import ForwardBatch, LayerCaches
from hybrid_engine.request_grammar import DraftMasks
from hybrid_engine.state_cache import CachePools
from hybrid_engine.spec_decode.draft_passes import DraftPasses

from .draft_inputs import DraftInputs
from .graph_replay import GraphReplay
from .model_runner import EagerSteps
from .step_inputs import StepInputs

# Dynamo traces through the kernels' lru_cache'd constant builders (kernels/norm/reference.py `scalar`,
# the rope frequencies) and warns each time; what they return depends only on their arguments.
warnings.filterwarnings("ignore", message=r"Dynamo detected a call to a `functools.lru_cache`")


mark_native_checks()

# Drafting calls kept for replay: one per catch-up length of a verify (1..k+1 tokens per request).
MTP_REPLAYS = 8


class CompiledSteps(EagerSteps):
    def __init__(self, model: HybridForCausalLM, caches: CachePools):
        super().__init__(model, caches)
        # Where eager steps would use oneDNN-packed weights (CPU bf16/fp16: kernels/linear/cpu.py),
        # inductor's freezing packs them (weights become constants of the graph, packed once;
        # the model keeps its own copy, about one more weight-size of memory). In float32 it
        # would pack for a slower GEMV and double the weights, so it is off there.
        weights = model.norm.weight                 # the model's device and dtype (never freed)
        freeze = weights.device.type == "cpu" and onednn_packs(weights.dtype)
        options = {"guard_filter_fn": _engine_guards}
        backend = _inductor(freeze)
        # A steady-state decode step passes the last step's objects again: its graph call is
        # replayed without dynamo's guards and prologue (graph_replay.py), its ints handed over
        # as the tensors _inductor's C++ wrapper would make of them at every call.
        self._decode_replay = GraphReplay(ints_as_tensors=True)
        self._decode = _compile(self._decode_forward, self._decode_replay.backend(backend), options)
        # Drafting after a verify of the same length is replayed too: its inputs lie in the
        # drafting builder's buffers (hybrid_engine/draft_inputs.py).
        self._mtp_replay = GraphReplay(ints_as_tensors=True, keep=MTP_REPLAYS)
        has_mtp = model.mtp is not None
        self._mtp = _compile(self._mtp_drafting, self._mtp_replay.backend(backend), options) if has_mtp else None
        self._last_mtp: list[tuple[tuple, tuple]] = []     # the latest drafting inputs and their traceable form
        self._mtp_continued = _compile(self._mtp_draft_passes, backend, options) if has_mtp else None
        # forward(): the last batch it was given and its traceable form
        self._last_batch: ForwardBatch | None = None
        self._last_ids: torch.Tensor | None = None
        self._last_traceable: ForwardBatch | None = None

    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode or verify step compiled (prefill and mixed steps eager) -> (final-normed
        hidden [T, H], float32 logits of the batch's logits_indices rows)."""
        input_ids, batch = inputs.input_ids, inputs.batch
        if batch.num_prefill_tokens:
            return super().forward(inputs)
        if batch is not self._last_batch or input_ids is not self._last_ids:
            # A plain decode step of the builder's steady state is the last step's ForwardBatch
            # object again, its tensors (and their dynamic marks) the same: prepared once. A
            # step packed afresh into the same views of the builder's buffers (a verify step
            # after a verify step of the same requests and table width) is new objects over
            # the same memory: the last step's objects serve it, so that its graph call is
            # replayed too (graph_replay.py), without dynamo's guards and prologue.
            if not (self._last_batch is not None and same_views(input_ids, self._last_ids)
                    and same_views(batch, self._last_batch)):
                self._last_traceable = _traceable(batch)
                self._last_ids = input_ids
                _mark_dynamic(input_ids, self._last_traceable)
            self._last_batch = batch
            input_ids = self._last_ids
        return self._decode_replay.call(self._decode, input_ids, self._last_traceable, self.caches)

    def draft(self, d: DraftInputs, passes: DraftPasses, masks: DraftMasks | None = None) -> torch.Tensor:
        """A decode-sized catch-up and its k-1 draft passes as one graph; after a prompt's
        catch-up (its length changes every time), which stays eager, the draft passes alone.
        Masked drafts are eager."""
        if masks is not None:
            return super().draft(d, passes, masks)
        if not d.one_length:
            h, draft = passes.catch_up(self.model, d.tokens, d.hidden, d.batch, self.caches, d.rows)
            last, tables = d.batch.positions[d.rows], d.tables[d.seqs]
            for t in (draft, h, last, tables):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(tables, 1)
            return self._mtp_continued(draft, h, last, tables, d.batch.kernels, self.caches, passes)
        inputs = (d.tokens, d.hidden, d.batch, d.tables, d.rows, d.seqs)
        seen = next((i for i, (earlier, _) in enumerate(self._last_mtp) if same_views(inputs, earlier)), None)
        if seen is not None:
            traced = self._last_mtp.pop(seen)[1]
        else:
            tokens, hidden, batch, tables, rows, seqs = traced = (*inputs[:2], _traceable(d.batch), *inputs[3:])
            _mark_dynamic(tokens, batch)
            torch._dynamo.maybe_mark_dynamic(hidden, 0)
            for t in (tables, rows, seqs):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(tables, 1)
        self._last_mtp = [(inputs, traced), *self._last_mtp][:MTP_REPLAYS]
        (drafts,) = self._mtp_replay.call(self._mtp, *traced[:3], self.caches, *traced[3:], passes)
        return drafts

    def _decode_forward(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: LayerCaches
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_step(input_ids, batch, caches)

    def _mtp_drafting(self, tokens: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, caches: LayerCaches,
                      tables: torch.Tensor, rows: torch.Tensor, seqs: torch.Tensor, passes: DraftPasses
                      ) -> tuple[torch.Tensor]:
        # A tuple of the graph's outputs: what GraphReplay replays (graph_replay.py)
        return (passes(self.model, tokens, hidden, batch, caches, tables, rows, seqs),)

    def _mtp_draft_passes(self, draft: torch.Tensor, h: torch.Tensor, last: torch.Tensor, tables: torch.Tensor,
                          kernels: KernelBackend, caches: LayerCaches, passes: DraftPasses) -> torch.Tensor:
        return passes.continued(self.model, draft, h, last, tables, kernels, caches)


def _engine_guards(entries) -> list[bool]:
    """The guards dynamo keeps: it drops those on the model's modules and weights (one per
    parameter) and on module globals (the kernels' constants and functions, `torch`, `F`:
    about 180 guard accessors a call), which do not change while an engine runs. Kept: the
    guards on the step's own inputs (the ForwardBatch's host ints, tensor sizes and dtypes, the
    caches), which pick the graph for a step or compile a new one.
    That is safe because each CompiledSteps compiles its own copies of the functions
    (_own_code): graphs made for one engine's model are never offered to another's."""
    modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    globals_ = torch.compiler.skip_guard_on_globals_unsafe(entries)
    return [m and g for m, g in zip(modules, globals_)]


def _compile(method, backend, options):
    """torch.compile of the bound method (its own code object: _own_code), called with the
    dynamo settings its tracing needs patched in around each call, not set for the process:

    - backed_size_oblivious: no 0/1 specialisation of dynamic sizes (size-oblivious tracing),
      so that batch 1 shares the graphs of larger batches;
    - install_free_tensors: the weights and the kernels' module constants become attributes of
      the graphs ("free tensors", installed once at tracing) instead of inputs that dynamo's
      prologue fetches on every call by walking the module tree (a default-model decode graph
      takes about a third of the inputs, and its prologue runs a quarter of the bytecode).

    Both are read while dynamo traces or checks a call; a replayed call (graph_replay.py) runs
    neither, and pays nothing for them."""
    compiled = torch.compile(_own_code(method), backend=backend, options=options)
    patched = fx_config.patch(backed_size_oblivious=True)(dynamo_config.patch(install_free_tensors=True)(compiled))
    return functools.wraps(method)(patched)


def _own_code(method):
    """The bound method with a code object of its own. Dynamo keeps compiled graphs (and the
    recompile limit) per code object, so without this every engine in a process would share
    one cache: with the module guards dropped, a graph traced for one model could run with
    another's weights baked in (freezing), and several engines would exhaust the limit."""
    f = method.__func__
    own = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    return types.MethodType(own, method.__self__)


def _inductor(freeze: bool):
    """Inductor, with freezing on or off and its C++ wrapper, for the graphs it compiles (a
    config patch around the compile itself: nothing is set on the calls that replay a graph).

    The C++ wrapper: a graph's own code, which calls its fused loops and extern kernels (about
    40 products and graph ops per default-model step), allocates and reinterprets buffers and
    checks input sizes, is compiled C++ instead of Python (a few hundred fewer interpreted
    statements per step, a visible share of a small model's step: benchmarks/history/RESULTS_LOG.md).
    The native kernels are torch ops with C++ implementations (kernels/native/ops.py), which the
    C++ wrapper calls through the dispatcher without Python. The graphs' on-disk cache is keyed
    by those ops too (kernels/native/ops.py graph_cache_tag): a cached graph compiled against other
    ops is never served.

    Size asserts off: the wrapper would check every input's sizes and strides at every call
    (dozens a default-model step, a measurable share of its main thread: RESULTS_LOG.md),
    which dynamo's guards have checked for a call they let through, and `same_views` for a
    replayed one."""
    tag = graph_cache_tag()

    def backend(graph, example_inputs):
        with (inductor_config.patch(freezing=freeze, cpp_wrapper=True, size_asserts=False),
              compiler_config.patch(cache_key_tag=tag)):
            return compile_fx(graph, example_inputs)
    return backend


def same_views(a, b) -> bool:
    """Whether `a` and `b` are the same step inputs over the same memory: tensors of one dtype,
    shape and strides at one address, and equal host values, field by field through dataclasses
    and tuples; other objects must be the same object. The decode rows' slot ids are left out:
    traced steps never read them (_traceable)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
                and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device)
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (int, float, str)):
        return a == b
    if isinstance(a, tuple):
        return len(a) == len(b) and all(map(same_views, a, b))
    if isinstance(a, DecodeRows):
        return a.without_ids() == b.without_ids()
    if dataclasses.is_dataclass(a):
        return all(same_views(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return False


def _traceable(batch: ForwardBatch) -> ForwardBatch:
    """The batch without the decode rows' slot ids (host ints): dynamo would guard on each value
    and compile again for every new slot. Traced steps take the forms that do not need them."""
    rows = batch.decode_rows
    if rows is None or rows.read_ids is None:
        return batch
    return dataclasses.replace(batch, decode_rows=rows.without_ids())


def _mark_dynamic(tokens: torch.Tensor, batch: ForwardBatch) -> None:
    """Marks the per-token and per-request dims dynamic (the marks live on these tensor objects,
    new views at every step the builder packs afresh; a mark costs a few microseconds). Keys
    are None where the native attention kernel serves the step (LLMEngine._keyless_query_lens)."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (tokens, batch.positions, batch.slot_mapping, batch.cu_seqlens, batch.seq_lens, batch.state_slots,
              batch.has_initial_state, batch.state_write_slots, batch.logits_indices, batch.block_tables):
        mark(t, 0)
    mark(batch.block_tables, 1)
    keys = batch.attention.keys          # [N, L] gather indices and the [N, 1, Q, L] mask
    for t in (keys.blocks, keys.offsets, keys.visible) if keys is not None else ():
        mark(t, 0)
        mark(t, t.dim() - 1)
