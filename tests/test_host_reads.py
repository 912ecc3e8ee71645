"""Decode and verify forwards on the torch and cpu backends read nothing back from the device: every
fact a layer needs about the step (lengths, slots, key positions) comes in the ForwardBatch,
computed once by the step-input builder from its host lists.

Counted with a TorchDispatchMode (every aten op that copies a tensor value to the host or
sizes its output by one) plus the Python-level conversions that dispatch no aten op on CPU
(`Tensor.tolist`, `Tensor.numpy`). Prefill forwards may read (their GDN path does); the MTP
drafter's passes, which run only the MTP layer's attention, may not.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.kernels.backends import native_cpu_available
from hybrid_engine.kernels.gdn import recurrent

from spec_models import make_spec_checkpoint

PROMPTS = [[5, 17, 3, 99, 250, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 7]]
# aten ops that copy a tensor value to the host, or size their output by one
HOST_READ_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "unique", "_unique2",
                 "unique_consecutive", "unique_dim", "masked_select", "bincount"}
# indexing ops that size their output by a boolean mask (a nonzero inside, below the mode)
MASK_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostReads(TorchDispatchMode):
    """Records host reads while active: aten ops above and Tensor.tolist / Tensor.numpy calls."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if (name in HOST_READ_OPS or (name in MASK_INDEX_OPS and _has_bool_index(args))
                or (name == "repeat_interleave" and func._overloadname != "self_int")):   # tensor repeats
            self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._patched = {}
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def counted(t, *a, _name=name, _original=original, **kw):
                self.ops.append(_name)
                return _original(t, *a, **kw)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def test_the_counter_sees_every_kind_of_read():
    x = torch.arange(4)
    with HostReads() as reads:
        x.tolist(), int(x[0]), bool(x[1] > 0), x[x > 1], x.max().item()
    assert reads.ops == ["tolist", "_local_scalar_dense", "_local_scalar_dense", "index", "_local_scalar_dense"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_spec_checkpoint(tmp_path_factory.mktemp("reads"), "qwen3_5", embed_scale=1.6))


def _counted_engine(ckpt, k, kernel_backend):
    """An engine whose decode/verify forwards and MTP passes record their host reads."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", block_size=4, max_num_seqs=4,
                                    max_num_batched_tokens=64, speculative_config=spec,
                                    kernel_backend=kernel_backend))
    kinds = set(engine.model.cfg.layer_types)
    assert kinds == {"full_attention", "linear_attention"}, kinds
    seen = {"decode": [], "verify": [], "mtp": []}
    forward = engine.runner.forward

    def counted_forward(inputs):
        b = inputs.batch
        if b.num_prefills:
            return forward(inputs)
        with HostReads() as reads:
            out = forward(inputs)
        seen["decode" if b.decode_len == 1 else "verify"].append(reads.ops)
        return out

    engine.runner.forward = counted_forward
    if k:
        mtp_forward = engine.model.mtp_forward

        def counted_mtp(*args):
            with HostReads() as reads:
                out = mtp_forward(*args)
            seen["mtp"].append(reads.ops)
            return out

        engine.model.mtp_forward = counted_mtp
    return engine, seen


def _run(engine):
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


# native: the cpu backend (its kernels where they build); gathered / in_place: the torch
# backend's two forms of the recurrence
@pytest.mark.parametrize("form", ["native", "gathered", "in_place"])
@pytest.mark.parametrize("k", [0, 2], ids=["decode", "verify"])
def test_decode_and_verify_forwards_read_nothing_back(ckpt, k, form, monkeypatch):
    if form == "in_place":
        monkeypatch.setattr(recurrent, "IN_PLACE_MIN_BYTES", 0)
    engine, seen = _counted_engine(ckpt, k, "cpu" if form == "native" and native_cpu_available() else "torch")
    _run(engine)
    steps = seen["verify" if k else "decode"]
    assert len(steps) >= 5
    assert [ops for ops in steps if ops] == [], "host reads inside decode/verify forwards"
    if k:
        assert len(seen["mtp"]) > 0
        assert [ops for ops in seen["mtp"] if ops] == [], "host reads inside MTP passes"
