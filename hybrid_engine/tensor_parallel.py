"""Tensor parallelism over processes on one machine, on torch.distributed (gloo).

The engine's process is rank 0, the driver: it alone schedules, builds each step's inputs,
samples and updates requests. At start-up it spawns N-1 worker processes (torch.multiprocessing,
spawn), and every rank joins one gloo group over 127.0.0.1. Each rank loads its part of the
model (models/parallel.py: heads, MLP rows, vocabulary rows) and holds a cache of the same
geometry (blocks, slots, checkpoint entries) for its own heads only, so the driver's block
tables and slot numbers mean the same on every rank and admission is decided once, by the driver.

Before each computation over the model the driver sends every worker one message (`StepChannel`:
one broadcast of a fixed buffer, a second only for a message that overflows it): its kind, the
cache copies made since the last message (a fork's, a prefix hit's, a checkpoint's:
`CachePools.copies`), which the workers repeat on their own pools first, and the computation's
inputs. Then all ranks run it, joining in its all-reduces (o_proj, out_proj, down_proj or the
MoE block) and in the gather of the logits on rank 0, where sampling happens. The kinds are
the driver's execution strategy's calls (`TensorParallelSteps`): "forward" (a step: its input
ids, its ForwardBatch and the prompt rows that prompt_logprobs scores after it), and with MTP
"draft" (the catch-up pass and the draft passes, whose drafts rank 0 takes from the gathered
logits and broadcasts to every rank for the next pass: spec_decode/draft_passes.py) and
"catch_up" (the catch-up pass alone). The MTP passes read the target's hidden rows, which the
driver sends too: every rank then drafts from the same rows, whatever the rounding of their sums,
and a prefix hit's row comes from the checkpoint's hidden state, which rank 0 alone keeps.
Every other cache change of MTP's is a forward's write or one of the logged copies (the copy of
a prefix hit's last block, which the MTP layer writes again); a verify's rewind is the slot
ids that rank 0 swaps and sends in later batches.

Or the group is torchrun's (`TorchrunLaunch`: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in
the environment; env:// init), so that it spans machines: every rank runs the user's script or
command, rank 0's engine is the driver, and on every other rank the engine's constructor serves
the driver's steps until the driver ends, then ends the process.

A worker that dies closes its sockets: the driver's collective fails, and the step raises an
error naming the dead workers (a worker that hangs instead fails it after COLLECTIVE_TIMEOUT).
A failed step leaves the ranks out of step with each other, so the group is then broken: its
workers are ended at once and the engine cannot go on (EngineDeadError: every request in flight
fails, /health turns unhealthy). A driver that goes away ends its workers the same way, and
`shutdown()` (LLM.shutdown, or the interpreter's exit: the workers are daemonic) ends them at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import signal
import socket
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybrid_engine.models.parallel import TensorParallel
from hybrid_engine.request_grammar import DraftMasks
from hybrid_engine.spec_decode.draft_passes import DraftPasses

from .default_model import resolve_model
from .draft_inputs import DraftInputs
from .model_runner import EagerSteps
from .prompt_logprobs import row_pieces
from .step_inputs import StepInputs

# How long a collective waits for the other ranks before it fails the step (a hung worker). A
# worker waits for the driver's next step as long as the driver lives (its sockets close when it ends).
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
WORKER_IDLE_TIMEOUT = timedelta(days=365)
# A step's message is one broadcast of this many bytes, a second one only for a longer message.
# Measured on the tests' tiny model: a step of 16 decodes is 4 KB on the cpu backend (60 KB on the
# torch backend, whose attention gather indices cross too); a prefill of 16 prompts of up to 200
# tokens 450 KB (its attention masks), so two broadcasts. A drafting call's message carries the
# target's hidden rows besides: after 16 verifies at k=2, 48 rows of H (12 KB at the tiny model's
# H=64 in float32; 96 KB, two broadcasts, at H=1024 in bfloat16).
STEP_MESSAGE_BYTES = 64 << 10
_LENGTH_BYTES = 8
SHUTDOWN_JOIN_S = 5.0
DEATH_GRACE_S = 0.5


def parallel_for(rank: int, size: int) -> TensorParallel:
    """This rank's place and the group's collectives, for the model (models/parallel.py)."""

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def gather_logits(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        if rank != 0:
            dist.gather(t, dst=0)
            return t
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.gather(t, parts, dst=0)
        return torch.cat(parts, dim=-1)

    return TensorParallel(rank, size, all_reduce, gather_logits)


class StepChannel:
    """Objects from rank 0 to every rank, pickled with tensors as their bare bytes (a view of a
    step's persistent buffer would otherwise carry its whole storage)."""

    def __init__(self):
        self.buffer = torch.zeros(STEP_MESSAGE_BYTES, dtype=torch.uint8)

    def send(self, obj) -> None:
        data = _dumps(obj)
        fit = min(len(data), STEP_MESSAGE_BYTES - _LENGTH_BYTES)
        head = self.buffer.numpy()
        head[:_LENGTH_BYTES] = memoryview(len(data).to_bytes(_LENGTH_BYTES, "little"))
        head[_LENGTH_BYTES:_LENGTH_BYTES + fit] = memoryview(data)[:fit]
        dist.broadcast(self.buffer, 0)
        if fit < len(data):
            dist.broadcast(torch.frombuffer(bytearray(data[fit:]), dtype=torch.uint8), 0)

    def receive(self):
        dist.broadcast(self.buffer, 0)
        head = self.buffer.numpy()
        n = int.from_bytes(head[:_LENGTH_BYTES].tobytes(), "little")
        fit = min(n, STEP_MESSAGE_BYTES - _LENGTH_BYTES)
        data = head[_LENGTH_BYTES:_LENGTH_BYTES + fit].tobytes()
        if fit < n:
            rest = torch.empty(n - fit, dtype=torch.uint8)
            dist.broadcast(rest, 0)
            data += rest.numpy().tobytes()
        return pickle.loads(data)


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            flat = obj.detach().cpu().reshape(-1).clone(memory_format=torch.contiguous_format)
            return _tensor, (obj.dtype, tuple(obj.shape), flat.view(torch.uint8).numpy().tobytes())
        return NotImplemented


def _dumps(obj) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class TorchrunLaunch:
    """This process's place in a group that torchrun (or any launcher that sets the same
    variables) started: every rank runs the same script, and joins by env:// init."""

    rank: int
    world_size: int

    @staticmethod
    def from_environment(tensor_parallel_size: int) -> TorchrunLaunch | None:
        """None unless the environment names a group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT);
        ValueError where it is not one of `tensor_parallel_size` ranks."""
        names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        if tensor_parallel_size == 1 or not all(name in os.environ for name in names):
            return None
        try:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except ValueError:
            raise ValueError(f"RANK ({os.environ['RANK']!r}) and WORLD_SIZE ({os.environ['WORLD_SIZE']!r}) "
                             "in the environment must be ints") from None
        if world_size != tensor_parallel_size:
            raise ValueError(f"the launcher's group has WORLD_SIZE {world_size} processes but "
                             f"tensor_parallel_size is {tensor_parallel_size}: start one process per rank "
                             f"(torchrun: --nnodes x --nproc-per-node = {tensor_parallel_size})")
        return TorchrunLaunch(rank, world_size)


def serve_if_worker_rank(config) -> None:
    """On a rank > 0 of a torchrun group, the engine's constructor is this rank's part of the
    model: it serves the driver's steps until the driver ends, then ends the process (exit code
    0, or the error that ended it). Elsewhere it returns at once."""
    launch = TorchrunLaunch.from_environment(config.tensor_parallel_size)
    if launch is None or launch.rank == 0:
        return
    from .engine import check_splits        # (engine.py imports this module)
    resolve_model(config)
    check_splits(config)                    # every rank refuses a size that does not split, as rank 0 does
    _serve_as_worker(launch.rank, launch.world_size, "env://", config)
    raise SystemExit(0)


class TensorParallelGroup:
    """The driver's side: the workers it started (none under torchrun) and the channel to
    them. config: the engine's (its model resolved to a path), which each worker loads its part
    of the model from."""

    def __init__(self, config, size: int):
        if dist.is_initialized():
            raise RuntimeError("this process already holds a torch.distributed group (another tensor-parallel "
                               "engine not shut down?): one tensor-parallel engine per process")
        self._closed = True                    # until the group is up: nothing for shutdown to end
        self.size = size
        self.broken: BaseException | None = None
        self.workers = []
        self.launch = TorchrunLaunch.from_environment(size)
        if self.launch is not None:
            dist.init_process_group("gloo", init_method="env://", rank=0, world_size=size,
                                    timeout=COLLECTIVE_TIMEOUT)
        else:
            self._spawn_workers(config)
        self.channel = StepChannel()
        self.parallel = parallel_for(0, size)
        self._closed = False

    def _spawn_workers(self, config) -> None:
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.workers = [ctx.Process(target=_worker_main, args=(rank, self.size, port, config), daemon=True,
                                    name=f"hybrid-engine-tp{rank}") for rank in range(1, self.size)]
        # The process's cores shared out: each rank, the driver too, runs torch.get_num_threads()
        # // N threads (OpenMP reads a worker's once, as torch starts in the child), so that
        # the ranks do not outnumber the cores.
        threads = max(1, torch.get_num_threads() // self.size)
        torch.set_num_threads(threads)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)
        try:
            for worker in self.workers:
                worker.start()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        try:
            self._join_group(port)
        except BaseException:
            self._stop_workers()
            raise

    def __del__(self) -> None:
        # An engine dropped without shutdown(): its workers go with it (not only at exit).
        if not self.__dict__.get("_closed", True):
            self.shutdown()
    def _join_group(self, port: int) -> None:
        """The driver's init_process_group, in a thread of its own while this one watches the
        workers: one that ends first (a script without the `__main__` guard, whose spawned
        copy starts an engine of its own) fails the start-up at once rather than after the
        rendezvous' timeout."""
        outcome: list[BaseException | None] = []

        def join() -> None:
            try:
                dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                        world_size=self.size, timeout=COLLECTIVE_TIMEOUT)
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        thread = threading.Thread(target=join, name="hybrid-engine-tp-init", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            ended = [f"rank {rank} ({_ending(w.exitcode)})" for rank, w in enumerate(self.workers, 1)
                     if w.exitcode is not None]
            if ended and thread.is_alive():
                raise RuntimeError(f"tensor-parallel worker {', '.join(ended)} ended while starting (its error is "
                                   "on stderr); a script that starts a tensor-parallel engine needs the "
                                   "`if __name__ == \"__main__\":` guard, as the workers are spawned")
        if outcome[0] is not None:
            raise outcome[0]

    def start_cache(self, pools) -> None:
        """Each worker allocates a cache of `pools`' geometry for its heads; from now on the
        driver's pools log their copies for the workers to repeat."""
        pools.copies = []
        with self.exchange():
            self.channel.send(pools.geometry())
            dist.barrier()                     # every worker has loaded its part and its cache

    @contextlib.contextmanager
    def exchange(self):
        """Around the driver's part of anything the workers join (a message and its
        computation): whatever fails in it leaves the ranks out of step (a worker waits in a
        collective the driver never reaches, or the other way round), so the group is broken
        from then on and its workers are ended at once. The error raised names the workers
        that died, where any did."""
        if self.broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken: {self.broken}")
        try:
            yield
        except BaseException as e:
            dead = self.dead_workers()
            if dead is None and self.launch is not None and isinstance(e, RuntimeError):
                dead = RuntimeError(f"a collective of the torchrun group failed (a rank ended?): {e}")
            self.broken = dead or e
            for worker in self.workers:
                worker.kill()
            if dead is None:
                raise
            raise dead from e

    def send(self, kind: str, args: tuple, pools) -> None:
        """The message of a computation of `kind` (a method of the workers' `_WorkerSteps`) on
        `args`, after the cache copies since the last message."""
        copies, pools.copies = pools.copies, []
        self.channel.send((kind, copies, args))

    def dead_workers(self) -> RuntimeError | None:
        """The error that names the workers that have died (None while all live): what a
        failed collective reports in place of gloo's own."""
        for worker in self.workers:            # a worker's sockets close a moment before it is gone
            worker.join(DEATH_GRACE_S)
        dead = [f"rank {rank} ({_ending(w.exitcode)})" for rank, w in enumerate(self.workers, 1) if not w.is_alive()]
        if not dead:
            return None
        # One killed worker makes the others' collectives fail, and they end too (exit code 1).
        return RuntimeError(f"tensor-parallel worker {dead[0]} has died" if len(dead) == 1 else
                            f"tensor-parallel workers have died: {', '.join(dead)}")

    def shutdown(self) -> None:
        """Ends the workers (a last message where they can take it, then their processes)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.broken is None and all(w.is_alive() for w in self.workers):
                self.channel.send(None)
        except Exception:
            pass                               # a broken group: the workers are ended below
        self._stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop_workers(self) -> None:
        for worker in self.workers:
            worker.join(SHUTDOWN_JOIN_S)
            if worker.is_alive():
                worker.kill()
                worker.join(SHUTDOWN_JOIN_S)


def _ending(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


def _worker_main(rank: int, size: int, port: int, config) -> None:
    """A spawned worker: its part of the model and of the cache, then every computation the
    driver sends, until it sends None."""
    # Ctrl-C at a terminal reaches the whole process group: the driver alone handles it, and
    # ends its workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve_as_worker(rank, size, f"tcp://127.0.0.1:{port}", config)


def _serve_as_worker(rank: int, size: int, init_method: str, config) -> None:
    """A worker rank's whole life in the group, however it was started (spawned here, or by torchrun)."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=WORKER_IDLE_TIMEOUT)
    try:
        _serve_steps(rank, size, config)
    except RuntimeError as e:
        if "gloo/transport" not in str(e):     # a fault of this worker's: its traceback
            raise
        # Another rank has gone (the driver saw it too and reports it): one line, not a traceback.
        print(f"hybrid-engine tensor-parallel worker rank {rank}: the group failed, ending ({e})", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def _serve_steps(rank: int, size: int, config) -> None:
    from hybrid_engine.kernels import make_backend
    from hybrid_engine.models import load_model
    from hybrid_engine.state_cache import CachePools

    from .checkpoint_formats.gguf import GgufFile, is_gguf
    from .quantization import quantized_layers

    kernels = make_backend(config.kernel_backend, config.device)
    method = kernels.linear_method(compiled=False, few_rows_copy=config.bf16_few_rows_copy)
    # the projections' methods chosen as the driver chooses them (online quantization: each rank
    # quantizes its own part of each weight); speculative_config: validated by the driver before
    # it started this worker (MTP, k >= 1)
    gguf_file = GgufFile(config.model) if is_gguf(config.model) else None
    model, _ = load_model(config.model, config.dtype, config.device, with_mtp=config.speculative_config is not None,
                          method=method, methods=quantized_layers(config, method, kernels, gguf_file),
                          source=gguf_file, tp=parallel_for(rank, size))
    channel = StepChannel()
    pools = CachePools(*channel.receive(), device=config.device)
    dist.barrier()
    steps = _WorkerSteps(model, pools, kernels)
    with torch.inference_mode():
        while (message := channel.receive()) is not None:
            kind, copies, args = message
            for name, copy_args in copies:
                getattr(pools, name)(*copy_args)
            getattr(steps, kind)(*args)


def _share_drafts(drafts: torch.Tensor) -> torch.Tensor:
    """A draft pass's drafts [D], rank 0's on every rank. Rank 0 alone has the pass's whole
    logits (and the grammar masks, which it alone walks), so it alone takes the argmax and
    broadcasts D token ids: simpler and smaller than an all-gather of the [D, V] logits for
    every rank to take the same argmax."""
    dist.broadcast(drafts, 0)
    return drafts


class _WorkerSteps(EagerSteps):
    """A worker's side of each message kind: the driver's `TensorParallelSteps` call of that name,
    on this rank's part of the model and cache (its own kernel backend put back in each batch)."""

    def __init__(self, model, caches, kernels):
        super().__init__(model, caches)
        self.kernels = kernels

    def forward(self, input_ids: torch.Tensor, batch, prompt_rows: list[tuple[int, int]]) -> None:
        hidden, _ = self.model.forward_step(input_ids, dataclasses.replace(batch, kernels=self.kernels), self.caches)
        for index in row_pieces(prompt_rows, self.model.cfg.vocab_size, hidden.device):
            self.model.compute_logits(hidden[index])     # prompt_logprobs' rows: their logits gather too

    def draft(self, d: DraftInputs, passes: DraftPasses) -> None:
        super().draft(self._local(d), dataclasses.replace(passes, share=_share_drafts))

    def catch_up(self, d: DraftInputs) -> None:
        super().catch_up(self._local(d))

    def _local(self, d: DraftInputs) -> DraftInputs:
        return dataclasses.replace(d, batch=dataclasses.replace(d.batch, kernels=self.kernels))


class TensorParallelSteps(EagerSteps):
    """The driver's execution strategy (hybrid_engine/model_runner.py): each computation's message
    to the workers, then its own part of it, eagerly."""

    def __init__(self, model, caches, group: TensorParallelGroup):
        super().__init__(model, caches)
        self.group = group

    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        # The workers use their own kernel backend; the rows that prompt_logprobs scores after
        # the forward gather their logits too (hybrid_engine/prompt_logprobs.py).
        prompt_rows = [(span.first_row, span.num_rows) for span in inputs.prompt_rows]
        with self.group.exchange():
            self.group.send("forward", (inputs.input_ids, _portable(inputs.batch), prompt_rows), self.caches)
            return super().forward(inputs)

    def draft(self, d: DraftInputs, passes: DraftPasses, masks: DraftMasks | None = None) -> torch.Tensor:
        with self.group.exchange():
            self.group.send("draft", (_portable_draft(d), passes), self.caches)
            return super().draft(d, dataclasses.replace(passes, share=_share_drafts), masks)

    def catch_up(self, d: DraftInputs) -> None:
        with self.group.exchange():
            self.group.send("catch_up", (_portable_draft(d),), self.caches)
            super().catch_up(d)


def _portable(batch):
    """A ForwardBatch as a message carries it: without the driver's kernel backend."""
    return dataclasses.replace(batch, kernels=None)


def _portable_draft(d: DraftInputs) -> DraftInputs:
    return dataclasses.replace(d, batch=_portable(d.batch))
