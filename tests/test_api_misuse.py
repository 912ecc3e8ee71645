"""Misuse of the Python API and damaged checkpoints: one ValueError / CheckpointError naming the
problem, never another exception type, and the engine keeps serving (issue 17 items 8-14)."""

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.models.config import CheckpointError, ConfigError

from checkpoints import make_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("misuse") / "model"
    save_checkpoint(make_hf_model("qwen3_5", full_attention_interval=2), folder, tokenizer=True)
    return folder


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=str(ckpt), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)


def edited_copy(ckpt, dest, config_edits=None, tensor_edit=None):
    shutil.copytree(ckpt, dest, dirs_exist_ok=True)
    if config_edits is not None:
        cfg = json.loads((dest / "config.json").read_text())
        cfg.update(config_edits)
        (dest / "config.json").write_text(json.dumps(cfg))
    if tensor_edit is not None:
        tensors = load_file(str(dest / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def assert_serves(llm):
    out = llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3
    free = llm.loop.run_on_loop(lambda e: (e.cache.num_free_blocks, e.cache.num_free_slots))
    assert free == (llm.engine.cache.num_blocks, llm.engine.cache.num_slots)


# ---- config.json and weights -------------------------------------------------------------------

@pytest.mark.parametrize("key, value, match", [
    ("num_key_value_heads", 0, "num_key_value_heads must be an int >= 1, got 0"),
    ("linear_num_key_heads", 0, "linear_num_key_heads must be an int >= 1, got 0"),
    ("head_dim", 0, "head_dim must be an int >= 1, got 0"),
    ("hidden_size", -64, "hidden_size must be an int >= 1, got -64"),
    ("vocab_size", -1, "vocab_size must be an int >= 1"),
    ("num_attention_heads", -4, "num_attention_heads must be an int >= 1"),
    ("hidden_size", "abc", "hidden_size must be an int >= 1, got 'abc'"),
    ("max_position_embeddings", 1, "max_position_embeddings must be an int >= 2, got 1"),
    ("rms_norm_eps", "x", "rms_norm_eps must be a number > 0"),
])
def test_bad_config_values_name_the_key_file_and_what_is_allowed(ckpt, tmp_path, key, value, match):
    folder = edited_copy(ckpt, tmp_path / "m", {key: value})
    with pytest.raises(ConfigError, match=match) as e:
        LLM(model=str(folder), dtype="float32")
    assert str(folder / "config.json") in str(e.value)
    assert isinstance(e.value, CheckpointError)


def test_int_and_bool_weights_are_refused_by_name(ckpt, tmp_path):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)

    def to_bool(t):
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"] > 0

    for name, edit, dtype in (("norm", to_int, "I32"), ("embed", to_bool, "BOOL")):
        folder = edited_copy(ckpt, tmp_path / name, tensor_edit=edit)
        with pytest.raises(CheckpointError, match=f"stored as {dtype}; weights must be floating point"):
            LLM(model=str(folder), dtype="float32")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load(ckpt, tmp_path, bad):
    def poison(t):
        t["model.layers.1.mlp.down_proj.weight"][3, 5] = bad

    folder = edited_copy(ckpt, tmp_path / "m", tensor_edit=poison)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight holds 1 NaN or Inf"):
        LLM(model=str(folder), dtype="float32")


def test_finite_float32_that_overflows_float16_is_refused(ckpt, tmp_path):
    def huge(t):
        t["model.layers.0.mlp.up_proj.weight"][0, 0] = 1e6

    folder = edited_copy(ckpt, tmp_path / "m", tensor_edit=huge)
    assert_serves(LLM(model=str(folder), dtype="float32"))
    with pytest.raises(CheckpointError, match="once loaded as float16"):
        LLM(model=str(folder), dtype="float16")


def test_max_model_len_above_max_position_embeddings_is_refused(ckpt):
    with pytest.raises(ValueError, match=r"max_model_len \(5000\) is greater than the model's "
                                         r"max_position_embeddings \(4096\)"):
        LLM(model=str(ckpt), dtype="float32", max_model_len=5000)
    assert LLM(model=str(ckpt), dtype="float32", max_model_len=4096).engine.max_model_len <= 4096


def test_long_max_model_len_is_allowed_when_asked_for(ckpt, monkeypatch):
    monkeypatch.setenv("HYBRID_ENGINE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=5000, cache_memory_bytes=64 << 20)
    assert llm.engine.max_model_len > 4096
    llm.shutdown()


@pytest.mark.parametrize("kwargs, match", [
    ({"device": "tpu9"}, "not a torch device"),
    ({"device": "mps"}, "not supported"),
    ({"device": 3.5}, "device must be a str"),
    ({"model": 5}, "model must be a path"),
    ({"seed": "abc"}, "seed must be an int"),
    ({"seed": 2**64}, "seed must be an int"),
])
def test_bad_engine_arguments_are_value_errors(ckpt, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(**{"model": str(ckpt), **kwargs})


def test_cuda_without_cuda_is_a_value_error(ckpt, monkeypatch):
    # A machine without CUDA, on any machine (the check asks torch.cuda.is_available()).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        LLM(model=str(ckpt), device="cuda")


# ---- prompts and sampling params ---------------------------------------------------------------

@pytest.mark.parametrize("prompts, match", [
    ([1, 2.0], r"prompt 0: a token-id prompt must be a list of ints; item 1 is float 2\.0"),
    ([[1, 2], [3, True]], r"prompt 1: .*item 1 is bool True"),
    (["ok", 5], "mixes token ids with str / list prompts"),
    ("a\ud800b", r"prompt 0: prompt is not valid text: surrogates not allowed at character 1"),
    ({"prompt": "x"}, "prompts must be a str, a list of token ids"),
])
def test_bad_prompts_are_named(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert_serves(llm)


def test_numpy_token_ids_are_token_ids(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = np.array([4, 5, 6], dtype=np.int64)
    assert (llm.generate(list(ids), params, use_tqdm=False)[0].token_ids
            == llm.generate([4, 5, 6], params, use_tqdm=False)[0].token_ids)


def test_a_dict_is_not_sampling_params(llm):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams, a list of them, or None; got dict"):
        llm.generate("x", {"max_tokens": 2}, use_tqdm=False)


@pytest.mark.parametrize("messages", ["hello", [], [{"role": "user"}], [[{"role": "user", "content": 3}]], 5])
def test_chat_with_bad_messages_is_a_value_error(llm, messages):
    with pytest.raises(ValueError, match="messages must be|conversation 0, message 0"):
        llm.chat(messages, use_tqdm=False)
    assert_serves(llm)


def test_stop_set_after_construction_means_what_the_constructor_does(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    sp.stop = "\n"
    assert sp.stop == ["\n"]
    sp.stop_token_ids = (3,)
    assert sp.stop_token_ids == [3]
    llm.generate("x", sp, use_tqdm=False)
    sp.stop = [""]
    with pytest.raises(ValueError, match=r"stop must be None, a non-empty str or a list of non-empty str, got \[''\]"):
        llm.generate("x", sp, use_tqdm=False)


# ---- the property: random misuse raises only ValueError, and the engine serves on ----------------

FIELDS = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids",
          "ignore_eos", "logprobs"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True),
                   st.text(max_size=3), st.lists(st.integers(-2, 300), max_size=3),
                   st.lists(st.text(max_size=2), max_size=2), st.just({"a": 1}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(st.tuples(st.sampled_from(FIELDS), VALUES), min_size=1, max_size=3))
def test_random_sampling_params_mutations_raise_only_value_error(llm, mutations):
    sp = SamplingParams(max_tokens=3)
    for name, value in mutations:
        setattr(sp, name, value)
    try:
        outs = llm.generate([7, 8, 9], sp, use_tqdm=False)
        assert outs[0].finished
    except ValueError:
        pass
    assert_serves(llm)


CONFIG_KEYS = ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim", "intermediate_size", "max_position_embeddings",
               "rms_norm_eps", "tie_word_embeddings", "eos_token_id", "layer_types", "rope_parameters",
               "model_type", "mtp_num_hidden_layers", "torch_dtype"]
CONFIG_VALUES = st.one_of(st.none(), st.booleans(), st.sampled_from([0, -1, 1, 2, 3, 7, 10**9]),
                          st.floats(allow_nan=True), st.sampled_from(["abc", "", "float32"]),
                          st.lists(st.sampled_from([0, "linear_attention", "full_attention"]), max_size=4),
                          st.just({"rope_theta": -1}))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.dictionaries(st.sampled_from(CONFIG_KEYS), CONFIG_VALUES, min_size=1, max_size=2))
@example(edits={"max_position_embeddings": 2})
def test_random_config_edits_raise_only_checkpoint_or_value_errors(ckpt, tmp_path_factory, llm, edits):
    folder = edited_copy(ckpt, tmp_path_factory.mktemp("edit"), edits)
    try:
        edited = LLM(model=str(folder), dtype="float32", max_num_seqs=2, max_num_batched_tokens=32)
    except ValueError:   # CheckpointError and ConfigError are ValueErrors
        pass
    else:
        try:
            edited.generate([1, 2], SamplingParams(max_tokens=2), use_tqdm=False)
        except ValueError as e:     # an edit the prompt no longer fits (max_position_embeddings: 2)
            assert "prompt" in str(e) or "token id" in str(e), e
        finally:
            edited.shutdown()
    assert_serves(llm)


def test_each_request_is_checked_and_tokenized_once(ckpt, monkeypatch):
    """LLM.generate, EngineLoop.submit and LLMEngine.add_request each prepare a request once
    (LLMEngine.prepare) and hand the PreparedPrompt on: one prompt check per request, on any
    path, and the caller's SamplingParams is never the request's own object."""
    from hybrid_engine.engine import LLMEngine, PreparedPrompt
    calls = []
    encode = LLMEngine.encode_prompt
    monkeypatch.setattr(LLMEngine, "encode_prompt", lambda self, p: calls.append(p) or encode(self, p))
    llm = LLM(model=str(ckpt), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    outs = llm.generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [2, 2] and calls == [[1, 2, 3], [4, 5]]
    calls.clear()
    assert list(llm.loop.submit([7, 8], params))[-1].finished and calls == [[7, 8]]
    calls.clear()
    engine = llm.engine
    prepared = engine.prepare([9], params)
    assert isinstance(prepared, PreparedPrompt) and prepared.params is not params and calls == [[9]]
    with pytest.raises(ValueError, match="carries its own sampling params"):
        llm.loop.submit(prepared, params)
