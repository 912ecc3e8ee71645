"""Tensor parallelism (hybrid_engine/tensor_parallel.py, models/parallel.py): TP=2 and TP=4 give
TP=1's greedy tokens and logprobs in float32 (prefix hits, n samples, chunked prefill and
preemption included; Qwen3.5 dense, Qwen3.5-MoE and Qwen3-Next, the experts split whole over the
ranks; with MTP drafts too), online int8 / int4 quantization, GGUF files and folders stored
quantized (compressed-tensors, GPTQ, FP8) give TP=1's quantized tokens, head counts and splits that would cut quantization groups are refused before
any process starts, and no worker outlives its engine: shutdown, a dead worker, the
interpreter's exit."""

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hybrid_engine import LLM, EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from hybrid_engine.checkpoint_formats.gptq import Gptq
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod
from hybrid_engine.models import load_model
from hybrid_engine.models.parallel import Split, TensorParallel
from hybrid_engine.quantization import Quantization
from hybrid_engine.quantize_checkpoint import write_quantized

from checkpoints import make_hf_model, save_checkpoint, save_tokenizer
from gguf_files import write_gguf
from engine_checks import assert_no_leak, budget_for_blocks
from quantized_checkpoints import write_asymmetric_pair, write_fp8_pair, write_gptq_pair
from spec_models import make_spec_checkpoint
from subprocess_signals import default_sigint

MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp_dense")
    save_checkpoint(make_hf_model("qwen3_5", full_attention_interval=2), folder)
    return folder


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """A checkpoint whose MTP head drafts well enough that steps accept some drafts and reject
    others (tests/support/spec_models.py), with a tokenizer for a constrained request."""
    folder = make_spec_checkpoint(tmp_path_factory.mktemp("tp_mtp"), "qwen3_5", embed_scale=1.6,
                                  full_attention_interval=2)
    save_tokenizer(folder, vocab_size=256)
    return folder


@pytest.fixture(scope="module")
def four_way_ckpt(tmp_path_factory):
    """4 GDN key heads, so that 4 ranks split them; 2 KV heads, replicated over pairs of ranks;
    vocabulary 250, which 4 does not divide (lm_head's last part padded), tied to the embedding
    (which each rank keeps whole)."""
    folder = tmp_path_factory.mktemp("tp_four")
    save_checkpoint(make_hf_model("qwen3_5", full_attention_interval=2, linear_num_key_heads=4, vocab_size=250,
                                  tie_word_embeddings=True), folder)
    return folder


@pytest.fixture(autouse=True)
def _no_group_left_behind():
    """A test that fails before its shutdown() leaves neither its workers nor this process's
    group to the next test."""
    yield
    for child in multiprocessing.active_children():
        if child.name.startswith("hybrid-engine-tp"):
            child.kill()
            child.join()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _prompts(n=6, lo=1, hi=70, vocab=250, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _children() -> set[int]:
    """Pids of this process's live (not zombie) children."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            pids.add(int(entry))
    return pids


def _worker_pids(llm: LLM) -> list[int]:
    return [w.pid for w in llm.engine.tp_group.workers]


def _generate(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] + [((), (o.prompt_logprobs or [None])[1:])]
            for o in outs]


def _greedy_at(sizes, check=None, prompts=None, max_tokens: int = 6, **llm_args) -> list:
    """_generate's outputs (greedy, 2 logprobs) of LLM(dtype="float32", **llm_args) at each
    tensor_parallel_size of `sizes`; check(llm, size) looks at each engine first. prompts:
    three of the tiny vocabulary's by default."""
    prompts = _prompts(n=3, vocab=256) if prompts is None else prompts
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    runs = []
    for size in sizes:
        llm = LLM(dtype="float32", tensor_parallel_size=size, **llm_args)
        if check is not None:
            check(llm, size)
        runs.append(_generate(llm, prompts, params))
        llm.shutdown()
    return runs


def _assert_same(tp1, tp2, tolerance=1e-4):
    for a, b in zip(tp1, tp2, strict=True):
        for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(a, b, strict=True):
            assert tokens_a == tokens_b
            for pa, pb in zip(logprobs_a, logprobs_b, strict=True):
                assert pa.keys() == pb.keys()
                assert max(abs(pa[t] - pb[t]) for t in pa) < tolerance


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_tp2_gives_tp1_greedy_tokens_and_logprobs(dense_ckpt, backend):
    """Chunked prefill, n=2 (the fork's copies reach the workers), a seeded sampled request,
    prompt_logprobs, and a second round that hits the prefix cache (its checkpoint copies too)."""
    prompts = _prompts(vocab=256)
    params = [SamplingParams(temperature=0.8 if i == 3 else 0.0, seed=7 if i == 3 else None, max_tokens=6 + i,
                             ignore_eos=True, logprobs=2, n=1 + (i == 2), prompt_logprobs=2 if i in (0, 4) else None)
              for i in range(len(prompts))]
    runs = []
    for size in (1, 2):
        llm = LLM(model=str(dense_ckpt), dtype="float32", kernel_backend=backend, max_num_seqs=8,
                  max_num_batched_tokens=32, tensor_parallel_size=size)
        first = _generate(llm, prompts, params)
        again = _generate(llm, prompts, params)
        assert llm.engine.prefix_cache_stats["hits"] > 0
        assert_no_leak(llm.engine)
        llm.shutdown()
        runs.append((first, again))
    _assert_same(runs[0][0], runs[1][0])
    _assert_same(runs[0][1], runs[1][1])
    _assert_same(runs[1][0], runs[1][1])


def test_tp2_with_mtp_gives_tp1_tokens_logprobs_and_drafts(mtp_ckpt):
    """k=2 drafts from the MTP head split over the ranks (its KV pool too), each draft pass's
    drafts broadcast from rank 0: greedy, seeded sampled, grammar-constrained (masked drafts)
    and n=2 requests, chunked prefill, prompt_logprobs, and a second round of prefix hits (the
    MTP layer's entry from the checkpoint's hidden state). The same drafts are accepted."""
    prompts = _prompts(vocab=256)
    constrained = StructuredOutputsParams(regex=r"[a-f]{3}-[0-9]{2,4}")
    params = [SamplingParams(temperature=0.8 if i == 3 else 0.0, seed=7 if i == 3 else None, max_tokens=10 + i,
                             ignore_eos=i != 1, logprobs=2, n=1 + (i == 2), prompt_logprobs=2 if i == 0 else None,
                             structured_outputs=constrained if i == 1 else None)
              for i in range(len(prompts))]
    runs, stats = [], []
    for size in (1, 2):
        llm = LLM(model=str(mtp_ckpt), dtype="float32", kernel_backend="auto", max_num_seqs=8,
                  max_num_batched_tokens=40, speculative_config=MTP, tensor_parallel_size=size)
        llm.engine.grammar_compiler.submit(constrained).result()    # compiled before: the same schedules
        runs.append((_generate(llm, prompts, params), _generate(llm, prompts, params)))
        assert llm.engine.prefix_cache_stats["hits"] > 0
        assert_no_leak(llm.engine)
        stats.append(llm.engine.spec_stats.as_dict())
        llm.shutdown()
    _assert_same(runs[0][0], runs[1][0])
    _assert_same(runs[0][1], runs[1][1])
    assert stats[0] == stats[1] and 0 < stats[1]["num_accepted"] < stats[1]["num_drafted"]


def test_each_rank_holds_half_the_sharded_weights_and_cache(dense_ckpt):
    def sizes(size):
        engine = LLMEngine(EngineConfig(model=str(dense_ckpt), dtype="float32", kernel_backend="torch",
                                        max_num_seqs=4, tensor_parallel_size=size))
        weights = sum(p.numel() for name, p in engine.model.named_parameters() if "norm" not in name)
        spec = engine.cache.spec
        engine.shutdown()
        return weights, spec.bytes_per_block, spec.bytes_per_slot

    whole, half = sizes(1), sizes(2)
    assert half[0] * 2 == whole[0]          # the embedding, every projection, conv tap, A_log and dt_bias in two
    assert (half[1] * 2, half[2] * 2) == whole[1:]


@pytest.mark.parametrize("spec", [None, MTP], ids=["plain", "mtp"])
def test_tp2_with_preemption(dense_ckpt, mtp_ckpt, spec):
    """With MTP, a preempted request's drafts and MTP KV start again from its recomputed prompt."""
    folder = str(dense_ckpt if spec is None else mtp_ckpt)
    prompts = _prompts(n=8, lo=20, hi=90, vocab=256, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = LLM(model=folder, dtype="float32", kernel_backend="torch", enable_prefix_caching=False)
    want = [o.token_ids for o in alone.generate(prompts, params, use_tqdm=False)]
    alone.shutdown()
    probe = LLMEngine(EngineConfig(model=folder, dtype="float32", kernel_backend="torch", max_num_seqs=8,
                                   speculative_config=spec, tensor_parallel_size=2))
    budget = budget_for_blocks(probe, 16)           # per rank: 8 requests need up to 8 x 8 blocks
    probe.shutdown()
    tight = LLM(model=folder, dtype="float32", kernel_backend="torch", max_num_seqs=8,
                cache_memory_bytes=budget, speculative_config=spec, tensor_parallel_size=2)
    assert tight.engine.cache.num_blocks == 16
    assert [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == want
    assert tight.engine.num_preemptions > 0
    tight.shutdown()


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_tp4_with_replicated_kv_heads_and_padded_tied_vocabulary(four_way_ckpt, backend):
    def check(llm, size):
        if size == 4:
            spec = llm.engine.cache.spec
            assert (spec.num_kv_heads, spec.num_v_heads) == (1, 1)        # 2 KV heads over 4 ranks

    _assert_same(*_greedy_at((1, 4), check, _prompts(n=3), model=str(four_way_ckpt), kernel_backend=backend))


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("family, spec", [("qwen3_next", None), ("qwen3_5_moe", MTP)],
                         ids=["qwen3_next", "qwen3_5_moe-mtp"])
def test_moe_families_at_tp2_give_tp1_tokens(tmp_path, family, spec, backend):
    """The experts split whole over the ranks (expert parallelism: each rank runs its own on the
    tokens routed to them), the shared expert by its intermediate rows, the router whole;
    Qwen3-Next's grouped in_proj_qkvz / in_proj_ba split after the loader regroups them.
    Qwen3.5-MoE drafts with its MTP head, whose MoE block splits like the target's."""
    if spec is None:
        save_checkpoint(make_hf_model(family, full_attention_interval=2), tmp_path)
    else:
        make_spec_checkpoint(tmp_path, family, embed_scale=1.6, full_attention_interval=2)
    _assert_same(*_greedy_at((1, 2), model=str(tmp_path), kernel_backend=backend, speculative_config=spec))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_moe_families_at_tp4_give_tp1_tokens(tmp_path, family):
    """4 GDN key heads over 4 ranks, KV heads replicated over pairs, one whole expert per rank."""
    save_checkpoint(make_hf_model(family, full_attention_interval=2, linear_num_key_heads=4), tmp_path)
    _assert_same(*_greedy_at((1, 4), max_tokens=5, model=str(tmp_path), kernel_backend="torch"))


def _weight_bytes(model, part: str = "") -> int:
    """Bytes of the weights a model holds (its methods' own tensors too: a quantized layer's
    packed values and scales) in modules whose name holds `part`, less the norms (whole on every
    rank)."""
    total = 0
    for name, module in model.named_modules():
        if part not in name or "norm" in name:
            continue
        tensors = [t for t in vars(module).values() if isinstance(t, torch.Tensor)]
        tensors += list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        total += sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)
    return total


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_each_moe_rank_holds_half_the_experts(tmp_path, quantization):
    """Rank 0 of 2 holds experts 0 and 1 of 4, whole; with the heads and the shared expert
    halved too, only the router and shared_expert_gate (whole) keep it above half."""
    save_checkpoint(make_hf_model("qwen3_5_moe", full_attention_interval=2, shared_expert_intermediate_size=64), tmp_path)
    models = []
    for size in (1, 2):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", kernel_backend="auto",
                                        quantization=quantization, tensor_parallel_size=size))
        models.append(engine.model)
        engine.shutdown()
    whole, half = models
    experts = half.layers[0].mlp.experts
    assert (experts.first, experts.num_local, experts.num_experts) == (0, 2, 4)
    if quantization:
        assert sorted(name for name, _ in experts.named_children()) == ["0", "1"]
    assert _weight_bytes(half, ".experts") * 2 == _weight_bytes(whole, ".experts")
    assert 0.5 < _weight_bytes(half) / _weight_bytes(whole) < 0.52


def test_a_rank_keeps_only_its_experts_memory(tmp_path):
    """A rank's experts are cut from the stacked tensor along its first dim, a view where the
    loader cast the tensor (bfloat16 file, float32 model): the rank copies its part, or the
    view would keep every expert alive. Experts of 1 MiB and more are left where the loader
    put them (models/qwen3_5.py _unpin_shared_storages), so these are that large."""
    save_checkpoint(make_hf_model("qwen3_5_moe", hidden_size=256, moe_intermediate_size=512).to(torch.bfloat16),
                    tmp_path)
    model, _ = load_model(tmp_path, "float32", tp=TensorParallel(0, 2))
    for experts in (layer.mlp.experts for layer in model.layers):
        for stacked in (experts.gate_up_proj, experts.down_proj):
            assert stacked.shape[0] == 2 and stacked.untyped_storage().nbytes() == stacked.nbytes >= 1 << 20


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """Qwen3.5-MoE with an MTP head, whose shared expert's down_proj input (64) halves into whole
    groups of 32."""
    folder = tmp_path_factory.mktemp("tp_moe")
    return make_spec_checkpoint(folder, "qwen3_5_moe", embed_scale=1.6, full_attention_interval=2,
                                shared_expert_intermediate_size=64)


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("model, quantization", [("dense", "int8"), ("dense", "int4"), ("moe", "int8")])
def test_quantized_tp2_gives_tp1_tokens(dense_ckpt, moe_ckpt, model, quantization, backend):
    """Each rank quantizes its own part of each float weight: a row-split projection's groups
    are the whole model's, so the ranks hold TP=1's quantized values (the experts each whole;
    the MoE model drafts with its quantized MTP head too).
    The native kernel (auto) rounds activations to int8, a step function: the all-reduce's other
    order of sums (a float32 ulp) moves some roundings by a step, and the logprobs of this
    random tiny model by up to a few hundredths (so does a 1e-7 relative change to o_proj's
    output at TP=1); the torch backend's float activations keep them within 1e-4."""
    folder = {"dense": dense_ckpt, "moe": moe_ckpt}[model]
    runs = _greedy_at((1, 2), model=str(folder), kernel_backend=backend, quantization=quantization,
                      speculative_config=MTP if model == "moe" else None)
    _assert_same(*runs, tolerance=1e-4 if backend == "torch" else 0.1)


def test_a_split_that_cuts_quantization_groups_is_refused(tmp_path):
    """The default tiny MoE's shared expert (32 rows) would leave each of 2 ranks half a group of
    its down_proj's input columns."""
    save_checkpoint(make_hf_model("qwen3_5_moe"), tmp_path)
    before = _children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not split shared_expert_intermediate_size "
                                         r"\(32\) into whole quantization groups of 32 per rank; "
                                         r"sizes that work for this model: 1$"):
        LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", quantization="int8", tensor_parallel_size=2))
    assert _children() == before


def _stored_quantized(src, dst, fmt: str):
    """A copy of `src` stored quantized in `fmt`, as the checkpoint format tests write them."""
    if fmt == "compressed-int4":
        write_quantized(src, dst, Quantization("int4", 32))
    elif fmt == "compressed-int4-zero-points":
        write_asymmetric_pair(src, dst, dst.with_name("float"), 4, 32)
    elif fmt.startswith("gptq"):
        write_gptq_pair(src, dst, dst.with_name("float"), 4, 32, desc_act=fmt == "gptq-act-order", sym=False)
    else:
        write_fp8_pair(src, dst, dst.with_name("float"), int(fmt.removeprefix("fp8-")), torch.bfloat16)
    return dst


@pytest.mark.parametrize("family, fmt", [("qwen3_5", "compressed-int4"), ("qwen3_5", "compressed-int4-zero-points"),
                                         ("qwen3_5", "gptq"), ("qwen3_5", "fp8-16"), ("qwen3_5_moe", "gptq")])
def test_stored_quantized_folder_at_tp2_gives_tp1_tokens(dense_ckpt, tmp_path, family, fmt):
    """Each rank takes its part of the stored tensors (values, scales, zero points, g_idx): rows
    for the column splits, input columns cut at the same group / block for o_proj, out_proj and
    down_proj; GPTQ's transposed tensors along their own dims. MoE: each rank reads only its
    experts, stored per expert, whole."""
    src = dense_ckpt
    if family != "qwen3_5":
        src = tmp_path / "src"
        save_checkpoint(make_hf_model(family, full_attention_interval=2, shared_expert_intermediate_size=64), src)
    path = _stored_quantized(src, tmp_path / "q", fmt)
    mlp = ("layers.0.mlp.down_proj",) if family == "qwen3_5" else ("layers.0.mlp.experts.1.down_proj",
                                                                   "layers.0.mlp.shared_expert.down_proj")

    def check(layers, size):
        if family != "qwen3_5":
            assert ("layers.0.mlp.experts.2.down_proj" in layers) == (size == 1)       # rank 0: experts 0, 1

    _assert_quantized_tp2_gives_tp1(path, ("layers.0.linear_attn.out_proj", "layers.1.self_attn.o_proj",
                                           "layers.1.self_attn.qkv_proj", *mlp), check)


def _assert_quantized_tp2_gives_tp1(path, quantized: tuple[str, ...], check=None) -> None:
    """TP=1 and TP=2 on `path` (torch backend, float32): the `quantized` layers load quantized
    at both sizes (check(layers, size) looks further), and the outputs are the same."""
    def check_layers(llm, size):
        layers = dict(llm.engine.model.named_modules())
        for name in quantized:
            assert isinstance(layers[name].method, QuantizedLinearMethod), name
        if check is not None:
            check(layers, size)

    _assert_same(*_greedy_at((1, 2), check_layers, model=str(path), kernel_backend="torch"))


@pytest.mark.parametrize("fmt, message", [
    ("fp8-32", r"tensor_parallel_size 2 does not split linear_num_key_heads x linear_key_head_dim \(32\) into "
               r"whole blocks of 32 rows per rank; sizes that work for this model: 1\b"),
    ("gptq-act-order", r"GPTQ with desc_act \(activation order\): tensor_parallel_size > 1 does not load it yet")])
def test_stored_quantized_splits_that_would_cut_blocks_are_refused(dense_ckpt, tmp_path, fmt, message):
    path = _stored_quantized(dense_ckpt, tmp_path / "q", fmt)
    before = _children()
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2))
    assert _children() == before


@pytest.mark.parametrize("family, qtype", [("qwen3_5", "Q8_0"), ("qwen3_next", "Q4_0")])
def test_gguf_file_at_tp2_gives_tp1_tokens(tmp_path, family, qtype):
    """Each rank takes whole blocks of a GGUF file's quantized projections: rows for the column
    splits, values and scales cut at the same block for the row splits (o_proj, out_proj,
    down_proj); experts whole. Value heads of 32: out_proj loads quantized (gguf.py)."""
    save_checkpoint(make_hf_model(family, linear_value_head_dim=32, shared_expert_intermediate_size=64), tmp_path)
    path = write_gguf(tmp_path, tmp_path / "m.gguf", qtype)
    _assert_quantized_tp2_gives_tp1(path, ("layers.0.linear_attn.out_proj", "layers.3.self_attn.o_proj",
                                           "layers.0.mlp.shared_expert.down_proj" if family == "qwen3_next"
                                           else "layers.0.mlp.down_proj"))


def test_gguf_blocks_a_split_would_cut_are_refused(tmp_path):
    save_checkpoint(make_hf_model("qwen3_5_moe"), tmp_path)
    path = write_gguf(tmp_path, tmp_path / "m.gguf", "Q8_0")
    with pytest.raises(ValueError, match=r"does not split shared_expert_intermediate_size \(32\) into whole "
                                         r"quantization groups of 32 per rank"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2))


def test_indivisible_heads_are_refused_before_any_process_starts(dense_ckpt, tmp_path):
    before = _children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not split num_attention_heads \(4\), "
                                         r".*linear_num_key_heads \(2\).*sizes that work for this model: 1, 2$"):
        LLMEngine(EngineConfig(model=str(dense_ckpt), dtype="float32", tensor_parallel_size=3))
    assert _children() == before
    moe = tmp_path / "moe"
    save_checkpoint(make_hf_model("qwen3_5_moe", num_experts=6, linear_num_key_heads=4), moe)
    with pytest.raises(ValueError, match=r"does not split num_experts \(6\) evenly; "
                                         r"sizes that work for this model: 1, 2$"):
        LLMEngine(EngineConfig(model=str(moe), dtype="float32", tensor_parallel_size=4))
    for bad in (0, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
            EngineConfig(model=str(dense_ckpt), tensor_parallel_size=bad).validate()
    with pytest.raises(ValueError, match=r"does not support enable_torch_compile yet"):
        EngineConfig(model=str(dense_ckpt), tensor_parallel_size=2, enable_torch_compile=True).validate()


def test_shutdown_ends_the_workers(dense_ckpt):
    llm = LLM(model=str(dense_ckpt), dtype="float32", kernel_backend="torch", tensor_parallel_size=2)
    pids = _worker_pids(llm)
    assert set(pids) <= _children()
    llm.shutdown()
    assert not set(pids) & _children()


def test_one_tensor_parallel_engine_per_process(dense_ckpt):
    engine = LLMEngine(EngineConfig(model=str(dense_ckpt), dtype="float32", kernel_backend="torch",
                                    tensor_parallel_size=2))
    pids = [w.pid for w in engine.tp_group.workers]
    with pytest.raises(RuntimeError, match="one tensor-parallel engine per process"):
        LLMEngine(EngineConfig(model=str(dense_ckpt), dtype="float32", kernel_backend="torch",
                               tensor_parallel_size=2))
    del engine                                       # dropped without shutdown: its workers end too
    assert not set(pids) & _children()


def test_a_dead_worker_fails_the_next_step_at_once(dense_ckpt):
    llm = LLM(model=str(dense_ckpt), dtype="float32", kernel_backend="torch", tensor_parallel_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].token_ids) == 4
    (pid,) = _worker_pids(llm)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel worker rank 1 \(killed by SIGKILL\) has died"):
        llm.generate([[4, 5, 6]], params, use_tqdm=False)
    assert time.monotonic() - start < 10
    llm.shutdown()
    assert not {pid} & _children()


def test_a_worker_killed_mid_generation_ends_the_engine_within_seconds(four_way_ckpt):
    """TP=4: rank 2 dies while two requests decode and one waits: every caller gets the error
    naming it within seconds, the other workers end, /health turns unhealthy, and the engine
    refuses new requests at once."""
    import httpx
    from hybrid_engine import EngineDeadError
    from serve_support import running_server

    llm = LLM(model=str(four_way_ckpt), dtype="float32", kernel_backend="torch", max_num_seqs=2,
              tensor_parallel_size=4)
    pids = _worker_pids(llm)
    params = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)
    with running_server(llm) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        streams = [iter(llm.loop.submit(prompt, params)) for prompt in _prompts(3)]
        next(streams[0])                         # decoding has begun
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        for stream in streams:
            with pytest.raises(EngineDeadError, match=r"rank 2 \(killed by SIGKILL\)"):
                for _ in stream:
                    pass
        assert time.monotonic() - start < 10
        assert httpx.get(server.url + "/health").status_code == 503
    deadline = time.monotonic() + 5
    while set(pids) & _children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(pids) & _children()
    with pytest.raises(EngineDeadError):
        llm.generate([[1, 2]], params, use_tqdm=False)
    llm.shutdown()
    assert not torch.distributed.is_initialized()


def test_two_nodes_under_torchrun_give_tp1_tokens(mtp_ckpt):
    """Two torchrun launches on 127.0.0.1 standing for two machines (--nnodes 2, one process
    each, env:// init), with MTP drafts: rank 0 drives and prints, rank 1 serves its half and
    ends with it."""
    def generate(*launch, tp=2):
        return [sys.executable, *launch, "-m", "hybrid_engine.cli", "generate", "--model", str(mtp_ckpt),
                "--dtype", "float32", "--json", "--max-tokens", "12", "--ignore-eos", "--speculative-tokens", "2",
                "--temperature", "0", "--tensor-parallel-size", str(tp), "3 14 15 92", "7 7 7"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = str(_free_port())
    nodes = [subprocess.Popen(generate("-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                                       "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for rank in (1, 0)]
    (out1, err1), (out0, err0) = (node.communicate(timeout=120) for node in nodes)
    assert [node.returncode for node in nodes] == [0, 0], err0 + err1
    assert out1 == ""                                # rank 1 only served
    single = subprocess.run(generate(tp=1), capture_output=True, text=True, timeout=120, env=env)
    assert single.returncode == 0, single.stderr
    tokens = [[json.loads(line)["token_ids"] for line in out.splitlines()] for out in (out0, single.stdout)]
    assert len(tokens[0]) == 2 and tokens[0] == tokens[1]


def test_a_launcher_group_of_another_size_is_refused(dense_ckpt, monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="WORLD_SIZE 3 processes but tensor_parallel_size is 2"):
        LLM(model=str(dense_ckpt), kernel_backend="torch", tensor_parallel_size=2)


def test_a_torchrun_worker_rank_refuses_a_size_that_does_not_split(dense_ckpt, monkeypatch):
    """Rank 1 checks the model itself before joining: it fails at once, as rank 0 does, rather
    than waiting in the rendezvous for a driver that has refused to start."""
    for name, value in (("RANK", "1"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not split"):
        LLM(model=str(dense_ckpt), kernel_backend="torch", tensor_parallel_size=3)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_workers_end_with_the_interpreter(dense_ckpt):
    """A script that never calls shutdown: its workers end with it."""
    script = textwrap.dedent(f"""
        from hybrid_engine import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM(model={str(dense_ckpt)!r}, dtype="float32", kernel_backend="torch", tensor_parallel_size=2)
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
            print(*[w.pid for w in llm.engine.tp_group.workers], flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    for pid in map(int, done.stdout.split()):
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{pid}")


def test_generate_command_at_tp2(dense_ckpt):
    def generate(*flags):
        done = subprocess.run([sys.executable, "-m", "hybrid_engine.cli", "generate", "--model", str(dense_ckpt),
                               "--dtype", "float32", "--kernel-backend", "torch", "--json", "--max-tokens", "5",
                               "--ignore-eos", "--temperature", "0", "3 14 15 92", *flags],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr
        return [json.loads(line)["token_ids"] for line in done.stdout.splitlines()]

    assert generate("--tensor-parallel-size", "2") == generate()


def test_server_streams_tp1_s_text_at_tp2():
    """The packaged default model (with its tokenizer) served at TP=2: a streamed completion and
    a chat reply are TP=1's."""
    from serve_support import client, running_server

    texts = []
    for size in (1, 2):
        llm = LLM(dtype="float32", tensor_parallel_size=size)
        with running_server(llm) as server:
            api = client(server)
            chunks = api.completions.create(model="default", prompt="def fib(n):", max_tokens=12, temperature=0,
                                            stream=True)
            chat = api.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=8, temperature=0)
            texts.append(("".join(c.choices[0].text for c in chunks), chat.choices[0].message.content))
        llm.shutdown()
    assert texts[0] == texts[1] and texts[0][0]


def test_bench_command_at_tp2_runs_each_k_in_turn(mtp_ckpt, tmp_path):
    """One tensor-parallel engine per process: bench builds, runs and ends one per k."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts(3, vocab=256)))
    done = subprocess.run([sys.executable, "-m", "hybrid_engine.cli", "bench", "--model", str(mtp_ckpt),
                           "--dtype", "float32", "--prompts", str(prompts), "--max-k", "2", "--repeats", "1",
                           "--max-tokens", "8", "--tensor-parallel-size", "2", "--json", "-"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["results"]
    assert [row["k"] for row in rows] == [0, 1, 2]
    assert all(row["greedy_identical"] is True and row["mean_accept_length"] >= 1 for row in rows[1:])


def test_inspect_shows_each_rank_and_its_share(dense_ckpt):
    def ranks(tp):
        done = subprocess.run([sys.executable, "-m", "hybrid_engine.cli", "inspect", "--model", str(dense_ckpt),
                               "--kernel-backend", "torch", "--tensor-parallel-size", str(tp), "--step", "2",
                               "--json", "-", "1 2 3"], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["steps"][-1]["ranks"]

    (whole,), (first, second) = ranks(1), ranks(2)
    assert [first["role"], second["role"]] == ["driver", "worker"] and first["pid"] != second["pid"]
    for key in ("attention_heads", "kv_heads", "gdn_value_heads"):
        assert first[key] == second[key] == whole[key] // 2
    # The byte budget is each rank's: its heads take half the bytes per block, so twice the blocks.
    assert first["cache_bytes"] == second["cache_bytes"] <= whole["cache_bytes"]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_workers_end_when_the_driver_is_killed_or_interrupted(dense_ckpt, how):
    script = textwrap.dedent(f"""
        import time
        from hybrid_engine import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM(model={str(dense_ckpt)!r}, dtype="float32", kernel_backend="torch", tensor_parallel_size=2)
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
            print(*[w.pid for w in llm.engine.tp_group.workers], flush=True)
            time.sleep(60)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=default_sigint)
    pids = [int(p) for p in driver.stdout.readline().split()]
    assert pids, driver.stderr.read()
    driver.send_signal(how)
    driver.wait(timeout=20)
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


def test_a_script_without_the_main_guard_fails_at_once(dense_ckpt, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(f"from hybrid_engine import LLM\n"
                      f"LLM(model={str(dense_ckpt)!r}, kernel_backend='torch', tensor_parallel_size=2)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0 and time.monotonic() - start < 30
    assert "needs the `if __name__ == \"__main__\":` guard" in done.stderr


def test_split_takes_each_segment_s_part_and_pads():
    full = torch.arange(10).view(10, 1)
    assert Split(0, (4, 2, 4), 2, 1).take(full).flatten().tolist() == [2, 3, 5, 8, 9]
    assert Split(0, (10,), 4, 3).take(full).flatten().tolist() == [9, 0, 0]
    assert Split(0, (4,), 2, 0).full_shape((2, 1)) == (4, 1)
    assert Split(1, (64, 128), 2, 1).per_entry(32) == Split(1, (2, 4), 2, 1)        # group scales


def test_stored_tensors_are_cut_along_their_own_dims_in_whole_words():
    """GPTQ's qweight [in * bits / 32, out] is cut by its rows for an input-column split and by
    its columns for an output-row one; a part that would split a packed word of zero points (a
    quantized lm_head split unevenly: what the start-up check does not see) is an error."""
    scheme = Gptq(4, 32, 0, symmetric=False)
    qweight = torch.arange(8 * 16, dtype=torch.int32).reshape(8, 16)          # in 64, out 16
    assert torch.equal(scheme.rank_part("x.qweight", qweight, Split(1, (64,), 2, 1)), qweight[4:])
    assert torch.equal(scheme.rank_part("x.qweight", qweight, Split(0, (16,), 2, 1)), qweight[:, 8:])
    g_idx = torch.arange(64, dtype=torch.int32) // 32
    assert scheme.rank_part("x.g_idx", g_idx, Split(1, (64,), 2, 1)).tolist() == [0] * 32
    with pytest.raises(ValueError, match="cannot be split into 2 parts of whole groups, blocks or packed words of 8"):
        scheme.rank_part("lm_head.qzeros", torch.zeros(2, 3, dtype=torch.int32), Split(0, (24,), 2, 0))
