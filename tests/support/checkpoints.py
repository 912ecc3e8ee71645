"""Tiny random-weight checkpoints of the three supported families, for tests.

    model = make_hf_model("qwen3_5_moe", tie_word_embeddings=True)      # transformers model, fp32, eval
    folder = save_checkpoint(model, tmp_path / "ckpt", vlm_wrapper=True, add_mtp=True, shards=2)

`make_hf_model` returns a real transformers model (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM /
Qwen3NextForCausalLM) whose weights are re-drawn so that random logits are not flat: larger
embedding / lm_head, 1/sqrt(fan_in) projections, decisive routers, and every (1+w) norm weight,
gated-norm weight, dt_bias and A_log moved away from its init value. `save_checkpoint` writes it
with transformers' own `save_pretrained` (so names and the per-expert MoE layout are exactly what
transformers writes) and then re-packs the tensors into the requested layout.

Helpers for tests: `internal_shapes(model, mtp=...)` (the loader's `expected` dict),
`internal_state_dict(model)` (HF tensors under internal names, Qwen3.5 layout families only),
`mtp_tensors(model)` (the seeded mtp.* tensors that `add_mtp=True` writes).
Nothing here is cached: build checkpoints inside pytest fixtures (tmp_path / tmp_path_factory).
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

TINY = dict(
    hidden_size=64,
    num_hidden_layers=4,
    full_attention_interval=4,
    vocab_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    intermediate_size=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)
TINY_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


# ---- model ---------------------------------------------------------------------------------------

def _classes(family: str):
    import transformers as tf

    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM
    if family == "qwen3_5_moe":
        return tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM
    if family == "qwen3_next":
        return tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def make_config(family: str, **overrides):
    """The transformers text config of a tiny model (overrides are config kwargs)."""
    config_cls, _ = _classes(family)
    kw = dict(TINY)
    if family in ("qwen3_5_moe", "qwen3_next"):
        kw.update(TINY_MOE)
    if family == "qwen3_5_moe":
        kw.pop("intermediate_size")
    rope = dict(ROPE)
    rope.update(overrides.pop("rope_parameters", None) or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in overrides:
            rope[key] = overrides.pop(key)
    kw.update(overrides)
    if "layer_types" in kw and "full_attention_interval" not in overrides:
        kw.pop("full_attention_interval")
    kw["rope_parameters"] = rope
    return config_cls(**kw)


@torch.no_grad()
def perturb_(model, seed: int = 0):
    """Re-draw every weight of a tiny HF model so that outputs are far from flat/ties and the
    (1+w) vs w norm conventions, dt_bias and A_log all matter. In place; returns the model."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        shape = p.shape
        if name.endswith("embed_tokens.weight"):
            new = normal(shape, 0.5)
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue  # the same tensor as embed_tokens
            new = normal(shape, 0.5)
        elif name.endswith("linear_attn.norm.weight"):  # gated norm: plain w, init ones
            new = normal(shape, 0.3, 1.0)
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):  # (1+w) norms, init 0
            new = normal(shape, 0.3)
        elif name.endswith("dt_bias"):  # init ones
            new = normal(shape, 1.0)
        elif name.endswith("A_log"):  # init log U(0.01, 16)
            new = torch.empty(shape).uniform_(math.log(0.05), math.log(8.0), generator=gen)
        elif name.endswith("conv1d.weight"):
            new = normal(shape, 1.0 / math.sqrt(shape[-1]))
        elif name.endswith("mlp.gate.weight"):  # router: decisive top-k
            new = normal(shape, 2.0 / math.sqrt(shape[-1]))
        elif p.dim() >= 2:  # projections, fused experts ([E, out, in])
            new = normal(shape, 1.0 / math.sqrt(shape[-1]))
        else:
            new = normal(shape, 0.1)
        p.copy_(new.to(p.dtype))
    return model


def make_hf_model(family: str, seed: int = 0, **overrides):
    """Tiny transformers model of `family` in float32, eval mode, seeded (global RNG untouched).

    Defaults: hidden 64, 4 layers (full_attention_interval 4), vocab 256, 4 q / 2 kv heads,
    head_dim 32, GDN Hk=2 Hv=4 dk=dv=16, conv 4, intermediate 128, MoE 4 experts top-2 with
    moe_intermediate 32 and shared 32, rope theta 1e7 partial 0.25, untied. Any config kwarg can be
    overridden (rope_theta / partial_rotary_factor go into rope_parameters)."""
    _, model_cls = _classes(family)
    config = make_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.float().eval()
    return perturb_(model, seed)


# ---- internal names ------------------------------------------------------------------------------

def _mtp_layer_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Internal names/shapes of the MTP layer: a full-attention decoder layer with the family's MLP."""
    h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    p = "mtp.layers.0."
    s = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (2 * nh * hd, h),
        p + "self_attn.k_proj.weight": (nkv * hd, h),
        p + "self_attn.v_proj.weight": (nkv * hd, h),
        p + "self_attn.o_proj.weight": (h, nh * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
    }
    if getattr(cfg, "num_experts", 0):
        e, i, si = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        s.update({
            p + "mlp.gate.weight": (e, h),
            p + "mlp.experts.gate_up_proj": (e, 2 * i, h),
            p + "mlp.experts.down_proj": (e, h, i),
            p + "mlp.shared_expert.gate_proj.weight": (si, h),
            p + "mlp.shared_expert.up_proj.weight": (si, h),
            p + "mlp.shared_expert.down_proj.weight": (h, si),
            p + "mlp.shared_expert_gate.weight": (1, h),
        })
    else:
        i = cfg.intermediate_size
        s.update({
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    s.update({
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    })
    return s


def internal_shapes(model, mtp: bool = False) -> dict[str, torch.Size]:
    """The loader's `expected` for an HF text model: its state_dict under internal names (no
    leading "model.", lm_head only when untied, Qwen3-Next GDN projections in the Qwen3.5 layout),
    plus the MTP tensors when `mtp`."""
    cfg = model.config
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    out: dict[str, torch.Size] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
        else:
            name = name.removeprefix("model.")
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            p = name.removesuffix("in_proj_qkvz.weight")
            out[p + "in_proj_qkv.weight"] = torch.Size((2 * hk * dk + hv * dv, t.shape[1]))
            out[p + "in_proj_z.weight"] = torch.Size((hv * dv, t.shape[1]))
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            p = name.removesuffix("in_proj_ba.weight")
            out[p + "in_proj_b.weight"] = torch.Size((hv, t.shape[1]))
            out[p + "in_proj_a.weight"] = torch.Size((hv, t.shape[1]))
        else:
            out[name] = t.shape
    if mtp:
        out.update({k: torch.Size(v) for k, v in _mtp_layer_shapes(cfg).items()})
    return out


def internal_state_dict(model) -> dict[str, torch.Tensor]:
    """HF tensors under internal names (Qwen3.5-layout families; for Qwen3-Next the grouped GDN
    projections are kept under their own names, since their conversion is what tests check)."""
    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out[name] = t
        else:
            out[name.removeprefix("model.")] = t
    return out


def mtp_tensors(model, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Seeded random mtp.* tensors (internal names, fused experts), as `add_mtp=True` writes them."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(_mtp_layer_shapes(model.config).items()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            out[name] = torch.randn(shape, generator=gen) * 0.3
        elif name.endswith("mlp.gate.weight"):
            out[name] = torch.randn(shape, generator=gen) * (2.0 / math.sqrt(shape[-1]))
        else:
            out[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return out


def _unfuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """experts.gate_up_proj / experts.down_proj -> experts.{e}.{gate,up,down}_proj.weight."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, i = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :i].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, i:].clone()
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def _fuse_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """experts.{e}.{gate,up,down}_proj.weight -> experts.gate_up_proj [E,2I,H] / experts.down_proj."""
    import re

    pat = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = pat.match(name)
        if m:
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = t
        else:
            out[name] = t
    for base, projs in groups.items():
        n = len(projs["down_proj"])
        out[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]], 0) for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out


# ---- saving --------------------------------------------------------------------------------------

def _vlm_model(model):
    """Wrap a tiny text model into the real Qwen3_5(Moe)ForConditionalGeneration, same text weights."""
    import transformers as tf

    family = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}.get(model.config.model_type)
    if family is None:
        raise ValueError(f"vlm_wrapper needs a qwen3_5 / qwen3_5_moe model, not {model.config.model_type}")
    config_cls, model_cls = ((tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration) if family == "qwen3_5"
                             else (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration))
    tie = bool(model.config.tie_word_embeddings)
    text = model.config.to_dict()
    text.pop("architectures", None)
    vision = dict(TINY_VISION, out_hidden_size=model.config.hidden_size)
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=tie)
    config.text_config.tie_word_embeddings = tie  # real checkpoints agree at both levels
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vlm = model_cls(config).float().eval()
    vlm.model.language_model.load_state_dict(model.model.state_dict())
    if not tie:
        vlm.lm_head.load_state_dict(model.lm_head.state_dict())
    return vlm


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def write_tensors(folder: str | Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Write `tensors` as model.safetensors, or as `shards` files plus model.safetensors.index.json."""
    folder = Path(folder)
    for p in list(folder.glob("*.safetensors")) + list(folder.glob("*.safetensors.index.json")):
        p.unlink()
    names = list(tensors)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if shards <= 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    shards = min(shards, len(names))
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {k: tensors[k] for k in names[s * per:(s + 1) * per]}
        save_file(chunk, str(folder / fname), metadata={"format": "pt"})
        for k, t in chunk.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _edit_config(folder: Path, vlm: bool, **values) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    target = cfg["text_config"] if vlm else cfg
    target.update(values)
    path.write_text(json.dumps(cfg, indent=2))


def save_checkpoint(
    model,
    folder: str | Path,
    *,
    vlm_wrapper: bool = False,
    add_mtp: bool = False,
    shards: int = 1,
    tokenizer: bool = False,
    fused_experts: bool = False,
    lm_head_in_file: bool | None = None,
    mtp_seed: int = 1234,
) -> Path:
    """Write `model` (from make_hf_model) as an HF-style checkpoint folder and return the folder.

    vlm_wrapper: save through the real Qwen3_5(Moe)ForConditionalGeneration (model_type qwen3_5 /
        qwen3_5_moe, text under text_config, names model.language_model.*, plus model.visual.*).
    add_mtp: add the seeded `mtp_tensors(model, mtp_seed)` as mtp.* and set mtp_num_hidden_layers 1.
    shards: number of safetensors files (>1 adds model.safetensors.index.json).
    tokenizer: also write a tiny trained byte-level BPE tokenizer (see save_tokenizer); its eos id
        becomes eos_token_id in config.json and generation_config.json.
    fused_experts: store MoE experts fused (experts.gate_up_proj / experts.down_proj) instead of
        the per-expert experts.{e}.*_proj.weight that transformers' save_pretrained writes.
    lm_head_in_file: None = as save_pretrained does (tied models have no lm_head.weight);
        True = add lm_head.weight (a copy of the embedding when tied); False = drop it.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    to_save = _vlm_model(model) if vlm_wrapper else model
    to_save.save_pretrained(str(folder))
    tensors = _read_all(folder)
    prefix = "model.language_model." if vlm_wrapper else "model."
    if lm_head_in_file is True and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors[prefix + "embed_tokens.weight"].clone()
    elif lm_head_in_file is False:
        tensors.pop("lm_head.weight", None)
    if add_mtp:
        extra = mtp_tensors(model, mtp_seed)
        if not fused_experts:
            extra = _unfuse_experts(extra)
        tensors.update(extra)
    if fused_experts:
        tensors = _fuse_experts(tensors)
    write_tensors(folder, tensors, shards)
    if add_mtp:
        _edit_config(folder, vlm_wrapper, mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    if tokenizer:
        eos_id = save_tokenizer(folder, vocab_size=cfg.vocab_size)
        _edit_config(folder, vlm_wrapper, eos_token_id=eos_id)
        gen_path = folder / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        gen["eos_token_id"] = eos_id
        gen_path.write_text(json.dumps(gen, indent=2))
    return folder


# ---- tokenizer -----------------------------------------------------------------------------------

_WORDS = (
    "the a of and to in is it that for on with as was at by this from be or an are not have "
    "model token state layer cache attention linear gated delta rule memory decode prefill batch "
    "hello world engine fast slow small large value key query head hidden weight norm expert "
    "router draft verify accept reject sample greedy random seed test check load save file"
).split()


def _corpus() -> str:
    """A few KB of deterministic text that touches every printable ASCII character."""
    gen = torch.Generator().manual_seed(7)
    lines = []
    for _ in range(120):
        n = int(torch.randint(4, 12, (1,), generator=gen))
        idx = torch.randint(0, len(_WORDS), (n,), generator=gen).tolist()
        words = [_WORDS[i] for i in idx]
        words[0] = words[0].capitalize()
        lines.append(" ".join(words) + ".")
    lines.append("Digits 0123456789, symbols " + string.punctuation + " and\ttabs.")
    return "\n".join(lines) + "\n" + string.printable


def save_tokenizer(folder: str | Path, vocab_size: int = 256) -> int:
    """Train a tiny byte-level BPE (vocab <= vocab_size, specials <|endoftext|> <|im_start|>
    <|im_end|>, eos <|endoftext|>, a ChatML chat template) and save tokenizer.json +
    tokenizer_config.json so AutoTokenizer.from_pretrained(folder) works offline. Returns the eos id.

    With vocab_size >= 512 the alphabet is all 256 bytes (lossless for any text); below that it
    covers the printable ASCII characters only (other characters are dropped when encoding)."""
    from qwen35_bpe import QWEN35_EOS_TOKEN, train_qwen35_bpe

    # The same normalizer / pre-tokenizer / decoder as transformers' Qwen3_5Tokenizer, which
    # AutoTokenizer picks for qwen3_5 folders: both ways of loading then encode identically.
    fast = train_qwen35_bpe(_corpus().splitlines(keepends=True), vocab_size, byte_alphabet=vocab_size >= 512)
    assert fast.backend_tokenizer.get_vocab_size() <= vocab_size
    fast.save_pretrained(str(folder))
    return fast.convert_tokens_to_ids(QWEN35_EOS_TOKEN)
