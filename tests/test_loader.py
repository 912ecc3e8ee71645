"""models/loader.py against tiny transformers checkpoints (tests/checkpoints.py)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open

from checkpoints import (
    FAMILIES,
    internal_shapes,
    internal_state_dict,
    make_hf_model,
    mtp_tensors,
    save_checkpoint,
    write_tensors,
)
from hybrid_engine.models.config import ConfigError, load_config
from hybrid_engine.models.loader import CheckpointError, load_weights, resolve_dtype


# ---- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    """One tiny HF model per family (untied), built once for this module."""
    return {f: make_hf_model(f) for f in FAMILIES}


@pytest.fixture(scope="module")
def plain_ckpts(models, tmp_path_factory):
    """Each family saved as transformers' save_pretrained writes it (one file, text model)."""
    root = tmp_path_factory.mktemp("plain")
    return {f: save_checkpoint(m, root / f) for f, m in models.items()}


def load(folder, model, dtype=torch.float32, mtp=False):
    return dict(load_weights(folder, load_config(folder), internal_shapes(model, mtp=mtp), dtype))


def read_raw(folder) -> dict[str, torch.Tensor]:
    out = {}
    for p in sorted(folder.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def assert_matches_hf(weights, model, family):
    """Every loaded tensor equals the HF tensor (Qwen3-Next GDN projections: see the HF-math test)."""
    ref = internal_state_dict(model)
    gdn_grouped = ("in_proj_qkvz", "in_proj_ba")
    for name, t in ref.items():
        if family == "qwen3_next" and any(g in name for g in gdn_grouped):
            continue
        assert name in weights, name
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], t), name
    assert set(weights) == set(internal_shapes(model))


@pytest.fixture
def broken(plain_ckpts, tmp_path):
    """A fresh copy of the qwen3_5 checkpoint plus its raw tensors, for corrupting."""
    dst = tmp_path / "ckpt"
    shutil.copytree(plain_ckpts["qwen3_5"], dst)
    return dst, read_raw(dst)


# ---- loading -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_every_tensor(family, models, plain_ckpts):
    model, folder = models[family], plain_ckpts[family]
    cfg = load_config(folder)
    assert cfg.family == family and not cfg.is_vlm_wrapper
    weights = load(folder, model)
    assert_matches_hf(weights, model, family)
    for name, shape in internal_shapes(model).items():
        assert weights[name].shape == shape, name


def test_save_pretrained_writes_per_expert_moe(plain_ckpts):
    """transformers 5.24 save_pretrained writes experts.{e}.{gate,up,down}_proj.weight, not fused."""
    for family in ("qwen3_5_moe", "qwen3_next"):
        keys = set(read_raw(plain_ckpts[family]))
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in keys
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in keys
        assert not any(k.endswith("experts.gate_up_proj") for k in keys)


def test_qwen3_next_deinterleave_matches_hf_math(models, plain_ckpts):
    model = models["qwen3_next"]
    weights = load(plain_ckpts["qwen3_next"], model)
    h = model.config.hidden_size
    x = torch.cat([torch.eye(h), torch.randn(7, h, generator=torch.Generator().manual_seed(3))])[None]
    checked = 0
    for i, layer in enumerate(model.model.layers):
        if model.config.layer_types[i] != "linear_attention":
            continue
        attn = layer.linear_attn
        with torch.no_grad():
            q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
            mixed_qkv = torch.cat([t.reshape(1, x.shape[1], -1) for t in (q, k, v)], dim=-1)  # HF forward
            p = f"layers.{i}.linear_attn."
            ours = {n: x @ weights[p + f"in_proj_{n}.weight"].T for n in ("qkv", "z", "b", "a")}
        torch.testing.assert_close(ours["qkv"], mixed_qkv, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours["z"], z.reshape(1, x.shape[1], -1), rtol=0, atol=1e-6)
        torch.testing.assert_close(ours["b"], b, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours["a"], a, rtol=0, atol=1e-6)
        # the identity rows give the weights themselves: exact
        assert torch.equal(ours["qkv"][0, :h].T, weights[p + "in_proj_qkv.weight"])
        assert torch.equal(mixed_qkv[0, :h].T, weights[p + "in_proj_qkv.weight"])
        checked += 1
    assert checked == len([t for t in model.config.layer_types if t == "linear_attention"]) > 0


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_sharded_with_index(family, models, tmp_path):
    model = models[family]
    folder = save_checkpoint(model, tmp_path / "ckpt", shards=3, add_mtp=True)
    assert len(list(folder.glob("*.safetensors"))) == 3
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    weights = load(folder, model, mtp=True)
    assert_matches_hf({k: v for k, v in weights.items() if not k.startswith("mtp.")}, model, family)
    for name, t in mtp_tensors(model).items():
        assert torch.equal(weights[name], t), name


def test_index_listing_missing_file_is_an_error(models, tmp_path):
    folder = save_checkpoint(models["qwen3_5"], tmp_path / "ckpt", shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        load(folder, models["qwen3_5"])


def test_stray_file_outside_index_is_ignored(models, plain_ckpts, tmp_path):
    folder = save_checkpoint(models["qwen3_5"], tmp_path / "ckpt", shards=2)
    shutil.copy(plain_ckpts["qwen3_5_moe"] / "model.safetensors", folder / "consolidated.safetensors")
    assert_matches_hf(load(folder, models["qwen3_5"]), models["qwen3_5"], "qwen3_5")


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_vlm_wrapper_with_mtp_and_visual(family, models, tmp_path):
    model = models[family]
    folder = save_checkpoint(model, tmp_path / "ckpt", vlm_wrapper=True, add_mtp=True)
    raw = read_raw(folder)
    assert any(k.startswith("model.visual.") for k in raw)
    assert any(k.startswith("model.language_model.layers.") for k in raw)
    assert any(k.startswith("mtp.layers.0.") for k in raw)
    cfg = load_config(folder)
    assert cfg.is_vlm_wrapper and cfg.family == family and cfg.mtp_num_hidden_layers == 1
    weights = load(folder, model, mtp=True)
    assert not any("visual" in k for k in weights)
    assert_matches_hf({k: v for k, v in weights.items() if not k.startswith("mtp.")}, model, family)
    for name, t in mtp_tensors(model).items():
        assert torch.equal(weights[name], t), name


def test_mtp_absent_from_checkpoint_is_omitted(models, plain_ckpts):
    weights = load(plain_ckpts["qwen3_5"], models["qwen3_5"], mtp=True)
    assert not any(k.startswith("mtp.") for k in weights)
    assert_matches_hf(weights, models["qwen3_5"], "qwen3_5")


def test_mtp_in_checkpoint_but_not_wanted_is_skipped(models, tmp_path):
    folder = save_checkpoint(models["qwen3_5_moe"], tmp_path / "ckpt", add_mtp=True)
    weights = load(folder, models["qwen3_5_moe"], mtp=False)
    assert not any(k.startswith("mtp.") for k in weights)


@pytest.mark.parametrize("vlm", [False, True])
@pytest.mark.parametrize("lm_head_in_file", [None, True])
def test_tied_with_and_without_lm_head(vlm, lm_head_in_file, tmp_path):
    model = make_hf_model("qwen3_5", tie_word_embeddings=True)
    folder = save_checkpoint(model, tmp_path / "ckpt", vlm_wrapper=vlm, lm_head_in_file=lm_head_in_file)
    keys = set(read_raw(folder))
    assert ("lm_head.weight" in keys) == bool(lm_head_in_file)
    cfg = load_config(folder)
    assert cfg.tie_word_embeddings
    weights = load(folder, model)
    assert "lm_head.weight" not in weights
    assert_matches_hf(weights, model, "qwen3_5")


def test_untied_without_lm_head_is_missing(models, tmp_path):
    folder = save_checkpoint(models["qwen3_5"], tmp_path / "ckpt", lm_head_in_file=False)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): lm_head\.weight"):
        load(folder, models["qwen3_5"])


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_fused_and_per_expert_load_the_same(family, models, plain_ckpts, tmp_path):
    model = models[family]
    fused = save_checkpoint(model, tmp_path / "fused", fused_experts=True, add_mtp=True)
    raw = read_raw(fused)
    assert "model.layers.0.mlp.experts.gate_up_proj" in raw and "mtp.layers.0.mlp.experts.down_proj" in raw
    assert not any(".experts.0." in k for k in raw)
    per_expert = save_checkpoint(model, tmp_path / "per", add_mtp=True)
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in read_raw(per_expert)
    a, b = load(fused, model, mtp=True), load(per_expert, model, mtp=True)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ref = model.model.layers[1].mlp.experts
    assert torch.equal(a["layers.1.mlp.experts.gate_up_proj"], ref.gate_up_proj)
    assert torch.equal(a["layers.1.mlp.experts.down_proj"], ref.down_proj)


def test_hf_from_pretrained_reads_our_checkpoints(models, tmp_path):
    """The builder writes what transformers itself loads (sharded, MTP ignored, fused experts)."""
    import transformers as tf

    for family, cls, kw in [("qwen3_next", tf.Qwen3NextForCausalLM, dict(shards=2, add_mtp=True)),
                            ("qwen3_5_moe", tf.Qwen3_5MoeForCausalLM, dict(fused_experts=True))]:
        folder = save_checkpoint(models[family], tmp_path / family, **kw)
        hf = cls.from_pretrained(folder)
        ref = models[family].state_dict()
        for k, t in hf.state_dict().items():
            assert torch.equal(t, ref[k]), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtype_cast(dtype, models, plain_ckpts):
    model = models["qwen3_5_moe"]
    weights = load(plain_ckpts["qwen3_5_moe"], model, dtype=dtype)
    ref = internal_state_dict(model)
    for name, t in weights.items():
        assert t.dtype == dtype, name
        assert torch.equal(t, ref[name].to(dtype)), name


def test_bf16_checkpoint_to_float32(models, tmp_path):
    model = models["qwen3_5"]
    folder = save_checkpoint(model, tmp_path / "ckpt")
    write_tensors(folder, {k: v.to(torch.bfloat16) for k, v in read_raw(folder).items()})
    weights = load(folder, model, dtype=torch.float32)
    for name, t in internal_state_dict(model).items():
        assert weights[name].dtype == torch.float32
        assert torch.equal(weights[name], t.to(torch.bfloat16).float()), name


def test_resolve_dtype(plain_ckpts):
    cfg = load_config(plain_ckpts["qwen3_5"])
    assert cfg.torch_dtype == "float32"
    assert resolve_dtype("auto", cfg) == torch.float32
    cfg.torch_dtype = "bfloat16"
    assert resolve_dtype("auto", cfg) == torch.bfloat16
    cfg.torch_dtype = None
    assert resolve_dtype("auto", cfg) == torch.float32
    assert resolve_dtype("bfloat16", cfg) == torch.bfloat16
    assert resolve_dtype("float16", cfg) == torch.float16
    assert resolve_dtype("float32", cfg) == torch.float32
    for bad in ("int8", "float64", "", "bfloat17"):
        with pytest.raises(ValueError, match="unsupported dtype"):
            resolve_dtype(bad, cfg)
    cfg.torch_dtype = "float8_e4m3fn"
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        resolve_dtype("auto", cfg)


def test_tokenizer_is_saved(models, tmp_path):
    from transformers import AutoTokenizer

    folder = save_checkpoint(models["qwen3_5"], tmp_path / "ckpt", vlm_wrapper=True, tokenizer=True)
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) <= models["qwen3_5"].config.vocab_size
    ids = tok("Hello world, the model decodes 123 tokens.").input_ids
    assert max(ids) < 256 and tok.decode(ids) == "Hello world, the model decodes 123 tokens."
    assert tok.eos_token_id is not None and load_config(folder).eos_token_id == [tok.eos_token_id]


# ---- bad checkpoints -----------------------------------------------------------------------------

def test_missing_folder(models, tmp_path):
    with pytest.raises(ConfigError, match="model folder not found"):
        load_config(tmp_path / "nope")
    cfg = load_config(save_checkpoint(models["qwen3_5"], tmp_path / "ok"))
    with pytest.raises(CheckpointError, match="model folder not found"):
        load_weights(tmp_path / "nope", cfg, internal_shapes(models["qwen3_5"]), torch.float32)


def test_missing_config_json(broken):
    folder, _ = broken
    (folder / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(folder)


def test_unsupported_model_type(broken):
    folder, _ = broken
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported model_type 'llama'"):
        load_config(folder)


@pytest.mark.parametrize("edits, weight", [
    ({"hidden_size": 10**9, "num_attention_heads": 10**9}, "q_proj"),      # int64 overflow at construction
    ({"vocab_size": 10**9, "hidden_size": 10**6}, "the embedding"),
])
def test_sizes_no_weight_could_have_are_a_config_error(broken, edits, weight):
    folder, _ = broken
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(edits)
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"{weight} .* would be a .* weight, more than 1099511627776 elements"):
        load_config(folder)


def edit_config(folder, vlm: bool = False, drop: tuple[str, ...] = (), **values) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    text = cfg["text_config"] if vlm else cfg
    for key in drop:
        del text[key]
    text.update(values)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size"])
def test_a_missing_size_is_named_with_its_file(broken, key):
    """Issue 37: without hidden_size the config took transformers' 4096 and the loader then
    blamed the embedding's shape."""
    folder, _ = broken
    edit_config(folder, drop=(key,))
    with pytest.raises(ConfigError, match=f"^{re.escape(str(folder / 'config.json'))}: {key} is missing; "
                                          "the model's sizes have no default$"):
        load_config(folder)


def test_missing_sizes_of_a_vlm_and_a_moe_text_config(models, tmp_path):
    vlm = save_checkpoint(models["qwen3_5"], tmp_path / "vlm", vlm_wrapper=True)
    edit_config(vlm, vlm=True, drop=("num_hidden_layers", "intermediate_size"))
    with pytest.raises(ConfigError, match="config.json: num_hidden_layers, intermediate_size are missing"):
        load_config(vlm)
    moe = save_checkpoint(models["qwen3_5_moe"], tmp_path / "moe")
    edit_config(moe, drop=("num_experts",))
    with pytest.raises(ConfigError, match="config.json: num_experts is missing"):
        load_config(moe)


def test_mtp_num_hidden_layers_zero_means_no_mtp_head(models, tmp_path):
    """Issue 37: 0 was ignored and the checkpoint's mtp.* weights drafted anyway."""
    from hybrid_engine.models.load import load_model

    folder = save_checkpoint(models["qwen3_5"], tmp_path / "ckpt", add_mtp=True)
    assert load_model(folder, "float32", with_mtp=True)[0].mtp is not None
    edit_config(folder, mtp_num_hidden_layers=0)
    assert load_config(folder).mtp_num_hidden_layers == 0
    with pytest.raises(ConfigError, match="sets mtp_num_hidden_layers 0: the model has no MTP head"):
        load_model(folder, "float32", with_mtp=True)
    model, _ = load_model(folder, "float32")      # the mtp.* tensors are left unread, not unexpected
    assert model.mtp is None and not any(n.startswith("mtp.") for n in model.state_dict())


def test_mtp_num_hidden_layers_unsaid_takes_the_weights_and_above_one_is_refused(models, tmp_path):
    from hybrid_engine.models.load import load_model

    folder = save_checkpoint(models["qwen3_5"], tmp_path / "ckpt", add_mtp=True)
    edit_config(folder, drop=("mtp_num_hidden_layers",))
    assert load_config(folder).mtp_num_hidden_layers is None
    assert load_model(folder, "float32", with_mtp=True)[0].mtp is not None
    edit_config(folder, mtp_num_hidden_layers=2)
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers 2 is not supported: the engine runs an MTP "
                                          "head of one layer"):
        load_config(folder)


def test_missing_tensor(broken, models):
    folder, raw = broken
    raw.pop("model.layers.2.linear_attn.A_log")
    write_tensors(folder, raw)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): layers\.2\.linear_attn\.A_log$"):
        load(folder, models["qwen3_5"])


def test_unexpected_tensor(broken, models):
    folder, raw = broken
    raw["model.layers.0.mlp.bias"] = torch.zeros(3)
    write_tensors(folder, raw)
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\): model\.layers\.0\.mlp\.bias"):
        load(folder, models["qwen3_5"])


def test_wrong_shape(broken, models):
    folder, raw = broken
    raw["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    write_tensors(folder, raw)
    with pytest.raises(CheckpointError) as e:
        load(folder, models["qwen3_5"])
    msg = str(e.value)
    assert "model.layers.3.self_attn.k_proj.weight" in msg
    assert "expected [64, 64]" in msg and "found [32, 64]" in msg


def test_wrong_shape_in_grouped_next_projection(models, tmp_path):
    folder = save_checkpoint(models["qwen3_next"], tmp_path / "ckpt")
    raw = read_raw(folder)
    raw["model.layers.1.linear_attn.in_proj_qkvz.weight"] = raw["model.layers.1.linear_attn.in_proj_qkvz.weight"][:-16]
    write_tensors(folder, raw)
    with pytest.raises(CheckpointError, match=r"in_proj_qkvz.*expected \[192, 64\], found \[176, 64\]"):
        load(folder, models["qwen3_next"])


def test_missing_expert(models, tmp_path):
    folder = save_checkpoint(models["qwen3_5_moe"], tmp_path / "ckpt")
    raw = read_raw(folder)
    raw.pop("model.layers.2.mlp.experts.3.up_proj.weight")
    write_tensors(folder, raw)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        load(folder, models["qwen3_5_moe"])


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_unreadable_file(how, broken, models):
    folder, _ = broken
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\x00garbage" * 100)
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint file .*model\.safetensors"):
        load(folder, models["qwen3_5"])


def test_only_pytorch_bin(broken, models):
    folder, _ = broken
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle, never opened")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors.*pytorch_model\.bin.*not supported"):
        load(folder, models["qwen3_5"])


def test_no_weight_files(broken, models):
    folder, _ = broken
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files in"):
        load(folder, models["qwen3_5"])


def test_partial_mtp(models, tmp_path):
    folder = save_checkpoint(models["qwen3_5"], tmp_path / "ckpt", add_mtp=True)
    raw = read_raw(folder)
    raw.pop("mtp.layers.0.self_attn.q_norm.weight")
    write_tensors(folder, raw)
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): mtp\.layers\.0\.self_attn\.q_norm\.weight"):
        load(folder, models["qwen3_5"], mtp=True)


def test_vlm_top_level_tie_wins(tmp_path):
    """transformers ties a VLM by its top-level key; a tied Qwen3_5ForConditionalGeneration built
    from a bare config saves text_config.tie_word_embeddings=false and no lm_head.weight."""
    model = make_hf_model("qwen3_5", tie_word_embeddings=True)
    folder = save_checkpoint(model, tmp_path / "ckpt", vlm_wrapper=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_config(folder).tie_word_embeddings
    assert "lm_head.weight" not in load(folder, model)
