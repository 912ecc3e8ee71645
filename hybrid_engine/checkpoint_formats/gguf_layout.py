"""Where llama.cpp's converter (convert_hf_to_gguf.py, conversion/qwen.py: Qwen3NextModel,
_LinearAttentionVReorderBase, Qwen3_5TextModel, Qwen3_5MoeTextModel, _QwenMtpMixin) puts each of
our tensors in a GGUF file, and how it changes them on the way; `to_engine` undoes each change,
`to_gguf` makes it (the tests write GGUF files with it).

Architectures: "qwen35" (Qwen3.5 dense), "qwen35moe" (Qwen3.5 MoE), "qwen3next" (Qwen3-Next).

Names (ours -> GGUF; layer i is `blk.{i}`, the MTP layer `blk.{num_hidden_layers}`):
    embed_tokens / norm / lm_head     token_embd / output_norm / output (absent: tied)
    input_layernorm                   attn_norm
    post_attention_layernorm          post_attention_norm
    self_attn.{q,k,v}_proj / o_proj   attn_{q,k,v} / attn_output (q with its gate rows, as HF)
    self_attn.{q,k}_norm              attn_{q,k}_norm
    linear_attn.in_proj_qkv / _z      attn_qkv / attn_gate
    linear_attn.in_proj_b / _a        ssm_beta / ssm_alpha (qwen3next: both in ssm_ba)
    linear_attn.out_proj / norm       ssm_out / ssm_norm
    linear_attn.conv1d / A_log / dt_bias   ssm_conv1d / ssm_a / ssm_dt.bias
    mlp.{gate,up,down}_proj           ffn_{gate,up,down}
    mlp.gate / shared_expert_gate     ffn_gate_inp / ffn_gate_inp_shexp
    mlp.shared_expert.{gate,up,down}_proj   ffn_{gate,up,down}_shexp
    mlp.experts.gate_up_proj          ffn_gate_exps + ffn_up_exps (or fused ffn_gate_up_exps)
    mlp.experts.down_proj             ffn_down_exps
    mtp.fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm
                                      nextn.eh_proj / nextn.enorm / nextn.hnorm / nextn.shared_head_norm
    mtp.layers.0.*                    the layer names above under blk.{num_hidden_layers}

Changes the converter makes (each undone here, in this order's reverse):
    1. every `*norm.weight` but GDN's gated norm (linear_attn.norm) is stored + 1 (Qwen3.5's
       RMSNorm multiplies by 1 + w): the MTP head's too (mtp.pre_fc_norm_embedding / _hidden,
       renamed enorm / hnorm before the converter's test of the name, and mtp.norm);
    2. A_log is stored as -exp(A_log);
    3. conv1d [C, 1, K] is stored squeezed to [C, K];
    4. qwen35 / qwen35moe with fewer key heads than value heads: the value heads are reordered
       from grouped by key head (v0 of k0, v1 of k0, ...) to tiled (v0 of k0, v0 of k1, ...): the V
       rows of in_proj_qkv, the rows of in_proj_z, in_proj_b, in_proj_a, A_log, dt_bias, the V
       channels of conv1d, and the columns of out_proj;
    5. qwen3next: in_proj_qkvz becomes attn_qkv ([all q | all k | all v], which is our
       in_proj_qkv) and attn_gate (our in_proj_z); in_proj_ba stays grouped per key head
       ([b of k0's heads | a of k0's heads | ...]) as ssm_ba;
    6. fused MoE experts [E, 2I, H] are split into gate and up; per-expert ones are stacked.
Shapes: the reader hands tensors in torch's row order (GGUF lists dimensions reversed).
"""

from __future__ import annotations

import re

import torch

ARCHITECTURES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}

GLOBAL_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.experts.gate_up_proj": "ffn_gate_up_exps.weight",
}
EXPERT_GATE, EXPERT_UP = "ffn_gate_exps.weight", "ffn_up_exps.weight"
QWEN3NEXT_BA = "ssm_ba.weight"
MTP_NAMES = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
             "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}

_LAYER = re.compile(r"^(?:layers\.(?P<layer>\d+)|mtp\.layers\.0)\.(?P<rest>.+)$")


def gguf_name(name: str, num_hidden_layers: int) -> str | None:
    """The GGUF tensor our tensor `name` is stored in (for in_proj_b / in_proj_a of qwen3next
    and for experts.gate_up_proj: see `stored_in`); None for a name of no GGUF tensor."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    if name in MTP_NAMES:
        return f"blk.{num_hidden_layers}.{MTP_NAMES[name]}"
    m = _LAYER.match(name)
    if m is None or m["rest"] not in LAYER_NAMES:
        return None
    block = m["layer"] if m["layer"] is not None else num_hidden_layers
    return f"blk.{block}.{LAYER_NAMES[m['rest']]}"


def stored_in(name: str, arch: str, num_hidden_layers: int, present) -> list[str]:
    """The GGUF tensors that hold our tensor `name`, [] if the name has none; present: the
    file's tensor names (its experts are fused or not)."""
    gname = gguf_name(name, num_hidden_layers)
    if gname is None:
        return []
    block = gname.rpartition(".")[0].rpartition(".")[0]                   # "blk.3"
    if arch == "qwen3next" and name.endswith(("in_proj_b.weight", "in_proj_a.weight")):
        return [f"{block}.{QWEN3NEXT_BA}"]
    if name.endswith("experts.gate_up_proj") and gname not in present:
        return [f"{block}.{EXPERT_GATE}", f"{block}.{EXPERT_UP}"]
    return [gname]


def _is_shifted_norm(name: str) -> bool:
    # the converter tests the GGUF-bound name: mtp.pre_fc_norm_* are nextn.enorm / hnorm by then
    return (name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight")) or name in (
        "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")


def _swap_heads(t: torch.Tensor, dim: int, outer: int, inner: int, head_dim: int) -> torch.Tensor:
    """Rows (or columns) in heads ordered [outer][inner] -> [inner][outer]."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], outer, inner, head_dim, *shape[dim + 1:]).transpose(dim, dim + 1)
    return t.reshape(shape).contiguous()


class VHeadOrder:
    """Step 4 of the module docstring: grouped <-> tiled value heads, for one GGUF tensor."""

    def __init__(self, hk: int, hv: int, dk: int, dv: int):
        self.hk, self.r, self.dk, self.dv = hk, hv // hk, dk, dv

    def reordered(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, head_dim) of the part of `name` the converter reorders; None: no part."""
        if self.r == 1 or ".linear_attn." not in name:
            return None
        if name.endswith("in_proj_qkv.weight"):
            return 0, 2 * self.hk * self.dk, self.dv
        if name.endswith("conv1d.weight"):
            return 0, 2 * self.hk * self.dk, self.dv
        if name.endswith("in_proj_z.weight"):
            return 0, 0, self.dv
        if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            return 0, 0, 1
        if name.endswith("out_proj.weight"):
            return 1, 0, self.dv
        return None

    def apply(self, name: str, t: torch.Tensor, to_tiled: bool) -> torch.Tensor:
        where = self.reordered(name)
        if where is None:
            return t
        dim, start, head_dim = where
        head, tail = t.narrow(dim, 0, start), t.narrow(dim, start, t.shape[dim] - start)
        outer, inner = (self.hk, self.r) if to_tiled else (self.r, self.hk)
        return torch.cat([head, _swap_heads(tail, dim, outer, inner, head_dim)], dim=dim)


def to_engine(name: str, t: torch.Tensor, heads: VHeadOrder | None, shape: tuple[int, ...]) -> torch.Tensor:
    """A float GGUF tensor (float32) -> our tensor `name` of `shape` (the changes undone)."""
    if _is_shifted_norm(name):
        t = t - 1
    elif name.endswith("A_log"):
        t = torch.log(-t)
    if heads is not None:
        t = heads.apply(name, t, to_tiled=False)
    return t.reshape(shape)


def to_gguf(name: str, t: torch.Tensor, heads: VHeadOrder | None) -> torch.Tensor:
    """Our float tensor `name` -> what the converter stores (tests write GGUF files with it)."""
    t = t.float()
    if name.endswith("conv1d.weight"):
        t = t.reshape(t.shape[0], -1)
    if heads is not None:
        t = heads.apply(name, t, to_tiled=True)
    if _is_shifted_norm(name):
        t = t + 1
    elif name.endswith("A_log"):
        t = -torch.exp(t)
    return t
