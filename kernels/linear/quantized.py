"""Weight-only quantized projections: int8 and int4 values in groups along k, one float16 scale per
output row and group, W[n, k] = q[n, k] * scale[n, k // group], or with a zero point per row and
group as well (asymmetric formats: compressed-tensors `symmetric: false`, GPTQ `sym: false`),
W[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group]. The torch reference and the
native kernel (quant_linear.cpp) of the product, and the linear method that holds a layer's
weights this way (`QuantizedLinearMethod`).

Quantizing (`quantize`): int8 follows llama.cpp's Q8_0 rule, scale = max|w| / 127 and
q = round(w / scale) in [-127, 127]. int4 searches each group's scale: among m / d for the
group's value m of largest magnitude and the 21 divisors d = -9.0, -8.9, ..., -7.0 (-8 is
llama.cpp's Q4_0 rule, which spends the code -8 on the extreme value alone), the one whose codes
round(w / scale), clamped to [-8, 7], reconstruct the group with the least squared error, as
llama.cpp's K-quants search theirs; on the default model it takes a tenth off int4's KL from
float (benchmarks/RESULTS.md, issue 39). Every scale is rounded to float16 first and q computed
from the rounded scale. The search runs natively where the kernels load (quantize_int4.cpp),
else in torch (`_int4_search_torch`, the same steps).

Packed layout (`pack`, what the kernel reads; N padded to a multiple of 16 with zero rows): one
stream of bytes per block of 16 output rows, uint8 [N/16, block_bytes], in units of two groups:
the unit's float16 scales [2, 16] (64 bytes), then each group's codes, four consecutive k of a
row in each 32-bit lane (what vpdpbusd reads):
    int8: [group/4, 16, 4] a group, each q + 128;
    int4: [group/8, 16, 4] a group, byte j of step s holding k = 8 s + j in its low nibble and
          8 s + 4 + j in its high one, each q + 8.
An odd last group is a unit of its own (the second half of its scales unused). The scales sit in
the codes' stream because decode reads it from memory once per token, and a separate stream of
scales per block cost more than its share of the bytes (quant_linear.cpp says why).
    zeros   int8 [N/16, K / group, 16] (asymmetric weights only; `pack_zeros`)

The native kernel rounds x to int8 in blocks of 32 (llama.cpp's Q8_0, as its quantized products
do) and sums integers (quant_linear.cpp says why); `quant_linear_reference` computes the same
from the dequantized values, with x rounded the same way (int8_activations) or kept float.
Natively, a SwiGLU of two such layers runs as one op (mlp_quant: both products and silu_mul), and
a layer with a blocked float tail as one (linear_quant_tail): the same bits as their calls apart.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .cpu import BlockedProjection
from .reference import LinearMethod, shard_names

BLOCK = 16
BITS = (8, 4)
_QMAX = {8: 127, 4: 7}
_QMIN = {8: -127, 4: -8}



class QuantizedWeight(NamedTuple):
    """A quantized [N, K] weight as formats hand it over: values int8 [N, K] (in [-128, 127] or
    [-8, 7]), scales float16 [N, K / group_size]. input_order: where the format's groups are not
    contiguous columns (GPTQ's act-order), the columns' order in `values` (x is gathered into it
    before each product); None: as stored. zeros: int8 [N, K / group_size], the zero points of
    asymmetric weights, W = (values - zeros) * scales; None: symmetric, W = values * scales.

    Asymmetric weights keep both in the formats' stored unsigned domain less its middle: codes
    q and z in [0, 2^bits - 1] are held as q - 2^(bits-1) and z - 2^(bits-1). q - z itself
    would not fit int8 (int8 codes differ by up to 255), this does exactly, and the byte the
    kernel stores (value + 128, or + 8) is then the code q itself. A zero point may be any int8
    (GPTQ v1's reach 2^bits: 16 at int4, held as 8)."""
    values: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int
    input_order: torch.Tensor | None = None
    zeros: torch.Tensor | None = None


def check_scheme(bits: int, group_size: int, in_features: int | None = None) -> None:
    if bits not in BITS:
        raise ValueError(f"quantized weights have 8 or 4 bits, not {bits}")
    if not isinstance(group_size, int) or group_size < 2 or (bits == 4 and group_size % 2):
        raise ValueError(f"group size {group_size!r} is not an {'even ' if bits == 4 else ''}int >= 2")
    if in_features is not None and in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the {in_features} input columns")


def quantize(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """weight [N, K] (any float dtype) -> its int8 / int4 groups (the module docstring's rule)."""
    n, k = weight.shape
    check_scheme(bits, group_size, k)
    if bits == 4:
        return QuantizedWeight(*_int4_search(weight.detach().float().contiguous(), group_size), bits, group_size)
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    scale = (w.abs().amax(dim=-1) / 127).half()
    q = torch.round(w * _inverse(scale)[..., None]).clamp_(_QMIN[bits], _QMAX[bits]).to(torch.int8)
    return QuantizedWeight(q.reshape(n, k), scale, bits, group_size)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in float32 (0 where the scale is 0: an all-zero group)."""
    return torch.where(scale != 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))


INT4_DIVISORS = [-8.0 + (i - 10) / 10 for i in range(21)]      # searched in this order (ties: the first)


def _int4_search(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [N, K] -> (codes int8 [N, K], scales float16 [N, K / group]) by the module
    docstring's search: natively where the kernels load, else in torch."""
    from ..native.ops import native_ops
    ops = native_ops()
    if ops is not None and group_size % 8 == 0 and w.device.type == "cpu":
        return ops.quantize_int4.default(w, group_size)
    return _int4_search_torch(w, group_size)


def _int4_search_torch(w: torch.Tensor, group_size: int, rows_at_once: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The search in torch ops (quantize_int4.cpp's steps; the error summed in float64, where
    w - code * scale is exact), a few thousand rows at a time to bound its temporaries."""
    n, k = w.shape
    codes, scales = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // group_size, dtype=torch.float16)
    divisors = torch.tensor(INT4_DIVISORS, dtype=torch.float32)
    for start in range(0, n, rows_at_once):
        g = w[start:start + rows_at_once].reshape(-1, k // group_size, group_size)
        extreme = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        best = best_error = None
        for divisor in divisors:
            scale = (extreme / divisor).half()
            s = scale.float()
            q = torch.round(g * _inverse(scale)[..., None]).clamp_(-8, 7)
            error = (g.double() - (q * s[..., None]).double()).square_().sum(-1)
            if best is None:
                best, best_error = scale, error
            else:
                better = error < best_error
                best, best_error = torch.where(better, scale, best), torch.where(better, error, best_error)
        q = torch.round(g * _inverse(best)[..., None]).clamp_(-8, 7)
        codes[start:start + rows_at_once] = q.reshape(-1, k).to(torch.int8)
        scales[start:start + rows_at_once] = best
    return codes, scales


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 [N, K] weight a QuantizedWeight stands for."""
    n, k = qw.values.shape
    groups = qw.values.float().reshape(n, k // qw.group_size, qw.group_size)
    if qw.zeros is not None:
        groups = groups - qw.zeros.float()[..., None]
    return (groups * qw.scales.float()[..., None]).reshape(n, k)


def _by_column_block(per_group: torch.Tensor) -> torch.Tensor:
    """[N, K / group] (scales, zero points) -> [N/16, K / group, 16], N padded with zeros."""
    per_group = F.pad(per_group, (0, 0, 0, -per_group.shape[0] % BLOCK))
    return per_group.reshape(-1, BLOCK, per_group.shape[1]).transpose(1, 2).contiguous()


def pack_zeros(qw: QuantizedWeight) -> torch.Tensor | None:
    """The zero points in the kernel's layout, int8 [N/16, K / group, 16] (None: symmetric)."""
    return None if qw.zeros is None else _by_column_block(qw.zeros.to(torch.int8))


SCALE_BYTES = 64            # a unit's scales: two groups x 16 rows of float16


def _code_bytes(bits: int, group_size: int) -> int:
    """Bytes of one group's codes in a block of 16 rows."""
    return group_size * BLOCK * bits // 8


def block_bytes(in_features: int, bits: int, group_size: int) -> int:
    """Bytes of one block of 16 rows in the packed layout."""
    groups = in_features // group_size
    return (groups + 1) // 2 * SCALE_BYTES + groups * _code_bytes(bits, group_size)


def _join(codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """codes uint8 [N/16, K * bits / 32, 16, 4] and scales float16 [N/16, K / group, 16] -> the
    packed layout. An odd last group is packed as if a zero group followed it, whose codes (the
    stream's last bytes) are then cut off."""
    blocks, groups = scales.shape[:2]
    code_bytes = _code_bytes(bits, group_size)
    codes = codes.reshape(blocks, groups, code_bytes)
    if groups % 2:
        codes, scales = F.pad(codes, (0, 0, 0, 1)), F.pad(scales, (0, 0, 0, 1))
    units = torch.cat([scales.reshape(blocks, -1, 2 * BLOCK).view(torch.uint8),
                       codes.reshape(blocks, -1, 2 * code_bytes)], dim=-1)
    packed = units.reshape(blocks, -1)
    return (packed[:, :-code_bytes] if groups % 2 else packed).contiguous()


def _split(packed: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed layout -> (codes uint8 [N/16, K * bits / 32, 16, 4], scales float16 [N/16, K / group, 16])."""
    blocks, nbytes = packed.shape
    code_bytes = _code_bytes(bits, group_size)
    unit = SCALE_BYTES + 2 * code_bytes
    full, rest = divmod(nbytes, unit)
    if rest not in (0, SCALE_BYTES + code_bytes):
        raise ValueError(f"{nbytes} bytes a block are no whole number of int{bits} groups of {group_size}")
    groups = 2 * full + (rest != 0)
    if rest:
        packed = F.pad(packed, (0, code_bytes))
    units = packed.reshape(blocks, -1, unit)
    scales = units[..., :SCALE_BYTES].contiguous().view(torch.float16).reshape(blocks, -1, BLOCK)[:, :groups]
    codes = units[..., SCALE_BYTES:].reshape(blocks, -1, code_bytes)[:, :groups]
    return codes.reshape(blocks, groups * code_bytes // (BLOCK * 4), BLOCK, 4), scales


def pack(qw: QuantizedWeight) -> torch.Tensor:
    """The kernel's layout (the module docstring), uint8 [N/16, block_bytes], N padded to 16;
    `pack_zeros` lays out the zero points of asymmetric weights."""
    values = qw.values
    pad = -values.shape[0] % BLOCK
    if pad:
        values = F.pad(values, (0, 0, 0, pad))
    n, k = values.shape
    if k % 8:
        raise ValueError(f"packed quantized weights need a multiple of 8 input columns, not {k}")
    shifted = values.to(torch.int16) + (128 if qw.bits == 8 else 8)
    if qw.bits == 8:                                   # [N/16, K/4, 16, 4]
        q = shifted.reshape(n // BLOCK, BLOCK, k // 4, 4).permute(0, 2, 1, 3)
    else:                                              # k = 8 s + 4 h + j -> [N/16, K/8, 16, h, j]
        nibbles = shifted.reshape(n // BLOCK, BLOCK, k // 8, 2, 4).permute(0, 2, 1, 3, 4)
        q = nibbles[..., 0, :] | (nibbles[..., 1, :] << 4)
    return _join(q.to(torch.uint8), _by_column_block(qw.scales), qw.bits, qw.group_size)


def _rows_of(blocked: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """[N/16, X, 16, ...] -> [N_padded, X, ...], or only its `rows`."""
    if rows is not None:
        return blocked[rows // BLOCK, :, rows % BLOCK]
    return blocked.transpose(1, 2).reshape(-1, *blocked.shape[1:2], *blocked.shape[3:])


# Outputs of each row that a layer with a table at rows_bits scores again from it
# (QuantizedLinearMethod._rescore): a greedy token is then int8's leader unless int4's error
# ranked it below eight others.
RESCORED_ROWS = 8

# Rows quantized and packed at a time where loading quantizes a float weight (a multiple of
# BLOCK): a few MB of float32 transients instead of several copies of the whole weight.
PACK_ROWS = 2048


def quantize_packed(weight: torch.Tensor, bits: int, group_size: int, rows_at_once: int = PACK_ROWS) -> torch.Tensor:
    """pack(quantize(weight)), the same bits, PACK_ROWS rows at a time written into the packed
    tensor: loading then holds the float weight, its packed form and one slice's transients.
    Whole, the float32 copies, int8 values and int16 nibbles of a 248k-row lm_head took about
    four times its bf16 size at once."""
    n, k = weight.shape
    check_scheme(bits, group_size, k)
    if rows_at_once % BLOCK:
        raise ValueError(f"rows_at_once {rows_at_once} is not a multiple of {BLOCK}")
    packed = torch.empty(-(-n // BLOCK), block_bytes(k, bits, group_size), dtype=torch.uint8)
    for start in range(0, n, rows_at_once):
        part = pack(quantize(weight[start:start + rows_at_once], bits, group_size))
        packed[start // BLOCK:start // BLOCK + part.shape[0]] = part
    return packed


def _integers(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [n, steps, 4] (rows apart) -> the values int16 [n, K]."""
    if bits == 8:
        return codes.reshape(codes.shape[0], -1).to(torch.int16) - 128
    return torch.stack([codes & 15, codes >> 4], dim=-2).reshape(codes.shape[0], -1).to(torch.int16) - 8


def unpack(packed: torch.Tensor, bits: int, group_size: int, rows: torch.Tensor | None = None,
           zeros: torch.Tensor | None = None, scaled: bool = True) -> torch.Tensor:
    """The float32 dequantized weight [N_padded, K] from the packed layout (zeros: the packed
    zero points of asymmetric weights), or only its `rows` (1-d int64 ids: a tied embedding
    reading lm_head's table: only their blocks are split). scaled=False: the integers alone
    (less any zero points), in float32."""
    if rows is None:
        codes, scales = _split(packed, bits, group_size)
        codes, scales = _rows_of(codes, None), _rows_of(scales, None)          # [n, steps, 4], [n, G]
    else:
        codes, scales = _split(packed[rows // BLOCK], bits, group_size)
        ids, column = torch.arange(rows.shape[0]), rows % BLOCK
        codes, scales = codes[ids, :, column], scales[ids, :, column]
    values = _integers(codes, bits)
    n, k = values.shape
    groups = values.float().reshape(n, k // group_size, group_size)
    if zeros is not None:
        groups = groups - _rows_of(zeros, rows).float()[..., None]
    if not scaled:
        return groups.reshape(n, k)
    return (groups * scales.float()[..., None]).reshape(n, k)


def rescore_top_reference(x: torch.Tensor, y: torch.Tensor, packed: torch.Tensor, bits: int, group_size: int,
                          count: int) -> torch.Tensor:
    """y with each row's `count` largest outputs replaced by x . W[id] from the packed table (the
    torch form of quant_rows.cpp's rescore_top: products exact in float64, summed there, then
    rounded; ties among equal outputs may pick other ids than the native pass)."""
    top = y.topk(min(count, y.shape[-1]), dim=-1).indices                           # [..., R]
    rows = unpack(packed, bits, group_size, rows=top.reshape(-1))
    rows = rows.reshape(*top.shape, rows.shape[-1])                                  # [..., R, K]
    rescored = (x.double().unsqueeze(-2) * rows.double()).sum(-1).float()
    return y.scatter(-1, top, rescored.to(y.dtype))


def packed_scales(packed: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """The scales of a packed weight, float16 [N_padded, K / group]."""
    return _rows_of(_split(packed, bits, group_size)[1], None)


ACTIVATION_BLOCK = 32       # k per scale of x where the product quantizes it (quant_linear.cpp)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded as the native kernel rounds it: per row, blocks of 32 values to int8 with
    scale max|x| / 127 (llama.cpp's Q8_0), values round(x * (127 / max|x|)) to nearest even.
    -> (values as float32 [M, K / 32, 32], scales float32 [M, K / 32])."""
    blocks = x.float().reshape(x.shape[0], x.shape[-1] // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # (a true division: `127.0 / amax` is reciprocal-then-multiply in torch, rounded twice)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(blocks * inverse[..., None]), amax / 127.0


def _int8_activation_product(x: torch.Tensor, packed: torch.Tensor, bits: int, group_size: int,
                             zeros: torch.Tensor | None, rows_at_once: int = 16) -> torch.Tensor:
    """The native kernel's steps in torch: per block of 32 k, the exact integer sum of x's int8
    values times W's (less its zero point: the kernel's sum less zero x the block's sum of x,
    the same integer), times (W's group scale x x's block scale), added in block order in
    float32, each product and sum rounded on its own: the kernel's bits."""
    x = x.reshape(-1, x.shape[-1])
    values = unpack(packed, bits, group_size, zeros=zeros, scaled=False).double()   # W's integers [N, K]
    n, k = values.shape
    blocks = k // ACTIVATION_BLOCK
    w_blocks = values.reshape(n, blocks, ACTIVATION_BLOCK)
    w_scales = packed_scales(packed, bits, group_size).float()                      # [N, K / group]
    per_block = w_scales.repeat_interleave(group_size // ACTIVATION_BLOCK, dim=1)  # [N, blocks]
    out = []
    for rows in x.split(rows_at_once):
        xq, sx = quantize_activations(rows)
        sums = torch.einsum("mbk,nbk->mnb", xq.double(), w_blocks).float()      # exact integers
        acc = torch.zeros(rows.shape[0], n)
        for b in range(blocks):
            acc = acc + sums[..., b] * (per_block[None, :, b] * sx[:, None, b])
        out.append(acc)
    return torch.cat(out)


def quant_linear_reference(x: torch.Tensor, packed: torch.Tensor, bits: int, group_size: int,
                           int8_activations: bool = False, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N_padded] in torch ops, x's dtype out: float32 x and float32
    accumulation, or (int8_activations) the native kernel's own steps, bit for bit. zeros: the
    packed zero points of asymmetric weights."""
    if int8_activations:
        y = _int8_activation_product(x, packed, bits, group_size, zeros)
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)
    return (x.float() @ unpack(packed, bits, group_size, zeros=zeros).t()).to(x.dtype)


def quant_linear(x: torch.Tensor, packed: torch.Tensor, bits: int, group_size: int,
                 zeros: torch.Tensor | None = None) -> torch.Tensor:
    """The same with the native kernel (x quantized to int8 in blocks of 32: the process's level
    must run the kernels; group_size a multiple of 32)."""
    return torch.ops.hybrid_engine_cpu.linear_quant.default(x, packed, zeros, bits, group_size)


def native_takes(group_size: int) -> bool:
    """Whether the native kernel takes weights in groups of group_size (its blocks of x nest in them)."""
    return group_size % ACTIVATION_BLOCK == 0


class QuantizedCheckpoint(Protocol):
    """How a quantized checkpoint format stores one projection's weight (hybrid_engine/checkpoints/
    holds the formats): the tensors it writes beside the projection's name, and how they read back
    as a QuantizedWeight."""
    bits: int
    group_size: int

    def tensor_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        """suffix ("weight_packed") -> shape, for a projection of `rows` x `in_features`."""

    def read(self, name: str, tensors: dict[str, torch.Tensor], rows: int, in_features: int) -> QuantizedWeight:
        """The projection `name`'s tensors (by suffix) -> its weight; ValueError naming what is wrong."""

    def rank_part(self, name: str, tensor: torch.Tensor, split) -> torch.Tensor:
        """Under tensor parallelism: this rank's part of the stored tensor `name`, `split` being
        the rank's part of the [out, in] weight (LinearMethod.rank_part); `read` then takes the
        parts as a projection of the rank's sizes."""

    def full_shape(self, name: str, shape: tuple[int, ...], split) -> tuple[int, ...]:
        """The stored shape of tensor `name`, of which this rank holds `shape`."""


class QuantizedLinearMethod(LinearMethod):
    """A layer whose float weight is quantized once after loading (online quantization), or
    that a quantized checkpoint fills (`load_quantized`), held packed; products by the native
    kernel (native=True, the cpu backend where it builds) or the torch reference.

    float_shards: shards of a merged layer kept in float (GDN's in_proj_b / in_proj_a, which
    every quantized format keeps float: they feed the decay and the gate's sigmoid); they must
    be the layer's last rows, and run as a plain product beside the quantized one."""

    def __init__(self, bits: int, group_size: int, native: bool = False, float_shards: tuple[str, ...] = (),
                 int8_activations: bool | None = None, checkpoint: QuantizedCheckpoint | None = None,
                 float_method: LinearMethod | None = None, rows_bits: int | None = None):
        check_scheme(bits, group_size)
        # rows_bits: where a layer that serves an embedding's lookups (`serves_rows`, a tied
        # lm_head) is quantized from float, the rows are read from a table of its own at these
        # bits (None: from the product's table). The lookup's error reaches every token's
        # input, the product's only its logits: lm_head's bytes, read at every step, can go
        # lower than the lookup's, read one row a token. The product's largest outputs are then
        # scored again from that table (`_rescore`).
        if rows_bits is not None:
            check_scheme(rows_bits, group_size)
        self.rows_bits = rows_bits
        # float_method: the float shards' method (the backend's own: the cpu one's blocked product
        # gives a row the same bits in any batch, as MTP's lossless verify needs; a plain product
        # goes through MKL, whose order of sums changes with the row count)
        self.float_method = float_method or LinearMethod()
        # checkpoint: the layer loads its quantized projections as that format stores them
        # (else it loads float weights and quantizes them after loading: online quantization)
        self.checkpoint = checkpoint
        if native and not native_takes(group_size):
            raise ValueError(f"the native quantized kernel takes groups of a multiple of {ACTIVATION_BLOCK}, "
                             f"not {group_size}")
        self.bits, self.group_size, self.native = bits, group_size, native
        # the native kernel always rounds x to int8; the reference does where asked (tests)
        self.int8_activations = native if int8_activations is None else int8_activations
        if native and not self.int8_activations:
            raise ValueError("the native quantized kernel rounds activations to int8")
        self.float_shards = tuple(float_shards)

    def _float_rows(self, layer: nn.Module) -> int:
        if not self.float_shards:
            return 0
        names = list(layer.shards or {})
        tail = names[len(names) - len(self.float_shards):]
        if sorted(tail) != sorted(self.float_shards):
            raise ValueError(f"float shards {self.float_shards} are not the last of {names}")
        return sum(layer.shards[name] for name in self.float_shards)

    def _is_float_shard(self, name: str) -> bool:
        return name.rpartition(".")[2] in self.float_shards

    def checkpoint_tensors(self, layer: nn.Module, prefix: str) -> dict[str, tuple[int, ...]]:
        if self.checkpoint is None:
            return super().checkpoint_tensors(layer, prefix)
        tensors = {}
        for name, rows in shard_names(layer, prefix):
            if self._is_float_shard(name):
                tensors[f"{name}.weight"] = (rows, layer.in_features)
            else:
                tensors.update({f"{name}.{suffix}": shape for suffix, shape
                                in self.checkpoint.tensor_shapes(rows, layer.in_features).items()})
        return tensors

    def rank_part(self, name: str, loaded: torch.Tensor, split) -> torch.Tensor:
        if self.checkpoint is None or self._is_float_shard(name.rpartition(".")[0]):
            return super().rank_part(name, loaded, split)
        return self.checkpoint.rank_part(name, loaded, split)

    def full_shape(self, name: str, shape: tuple[int, ...], split) -> tuple[int, ...]:
        if self.checkpoint is None or self._is_float_shard(name.rpartition(".")[0]):
            return super().full_shape(name, shape, split)
        return self.checkpoint.full_shape(name, shape, split)

    def load_tensor(self, layer: nn.Module, name: str, loaded: torch.Tensor) -> None:
        if self.checkpoint is None:
            return super().load_tensor(layer, name, loaded)
        base, _, suffix = name.rpartition(".")
        if not hasattr(layer, "checkpoint_parts"):
            layer.checkpoint_parts = {}
        layer.checkpoint_parts.setdefault(base, {})[suffix] = loaded

    def _from_checkpoint(self, layer: nn.Module) -> None:
        """The loaded tensors of each projection -> one QuantizedWeight of the quantized shards'
        rows (in order) and the float shards' rows as the tail."""
        parts = layer.__dict__.pop("checkpoint_parts", {})          # name -> {suffix: tensor}
        by_shard = {name.rpartition(".")[2]: (name, tensors) for name, tensors in parts.items()}
        projections = (list(layer.shards.items()) if layer.shards is not None
                       else [(next(iter(by_shard)), layer.out_features)])
        quantized, tail = [], []
        for shard, rows in projections:
            name, tensors = by_shard[shard]
            if shard in self.float_shards:
                tail.append(tensors["weight"])
            else:
                quantized.append(self.checkpoint.read(name, tensors, rows, layer.in_features))
        orders = [q.input_order for q in quantized]
        if any(o is None for o in orders) != all(o is None for o in orders) or any(
                o is not None and not torch.equal(o, orders[0]) for o in orders):
            raise ValueError(f"the merged projections {list(by_shard)} read their input in different orders "
                             "(act-order groups differ between them): not supported")
        zeros = None
        if any(q.zeros is not None for q in quantized):          # a merged layer is asymmetric if one part is
            zeros = torch.cat([torch.zeros_like(q.scales, dtype=torch.int8) if q.zeros is None else q.zeros
                               for q in quantized])
        qw = QuantizedWeight(torch.cat([q.values for q in quantized]), torch.cat([q.scales for q in quantized]),
                             self.bits, self.group_size, orders[0], zeros)
        self.load_quantized(layer, qw, torch.cat(tail) if tail else None, layer.weight.dtype)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if self.checkpoint is not None and weight.is_meta:
            return self._from_checkpoint(layer)
        if weight.is_meta:
            return
        float_rows = self._float_rows(layer)
        quantized_rows = weight.shape[0] - float_rows
        packed = quantize_packed(weight[:quantized_rows], self.bits, self.group_size)
        row_table = None
        if getattr(layer, "serves_rows", False) and self.rows_bits not in (None, self.bits) and not float_rows:
            row_table = quantize_packed(weight, self.rows_bits, self.group_size)
        self._hold(layer, packed, None, quantized_rows, None, weight[quantized_rows:] if float_rows else None,
                   weight.dtype)
        layer.row_table = row_table

    def load_quantized(self, layer: nn.Module, qw: QuantizedWeight, float_tail: torch.Tensor | None,
                       dtype: torch.dtype) -> None:
        """Holds `qw` packed (and the float tail rows, if any) as the layer's weights; the plain
        weight is freed. dtype: the activations' (the rows a tied embedding reads come in it)."""
        if (qw.bits, qw.group_size) != (self.bits, self.group_size):
            raise ValueError(f"int{qw.bits} weights in groups of {qw.group_size} handed to a method of "
                             f"int{self.bits} in groups of {self.group_size}")
        if qw.zeros is None and qw.bits == 8 and int(qw.values.min()) == -128:
            # the symmetric int8 forms without VNNI multiply |x| by the weight with x's sign,
            # and -(-128) does not fit a byte: the zero-point forms take -128 (zero points 0)
            qw = qw._replace(zeros=torch.zeros_like(qw.scales, dtype=torch.int8))
        self._hold(layer, pack(qw), pack_zeros(qw), qw.values.shape[0], qw.input_order, float_tail, dtype)

    def _hold(self, layer: nn.Module, packed: torch.Tensor, zeros: torch.Tensor | None, rows: int,
              input_order: torch.Tensor | None, float_tail: torch.Tensor | None, dtype: torch.dtype) -> None:
        layer.quantized_rows = rows
        layer.qweight, layer.qzeros = packed, zeros
        layer.row_table = None          # packed at rows_bits, where process_weights_after_loading keeps one
        layer.input_order = input_order
        layer.float_tail = None if float_tail is None else float_tail.detach().to(dtype).clone()
        layer.tail_product = None if float_tail is None else self._tail_product(layer.float_tail)
        layer.weight_dtype = dtype
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=dtype, device="meta"), requires_grad=False)

    def _quantized_product(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.input_order is not None:
            x = x.index_select(-1, layer.input_order)
        if self.native and x.device.type == "cpu":
            y = quant_linear(x, layer.qweight, self.bits, self.group_size, layer.qzeros)
        else:
            y = quant_linear_reference(x, layer.qweight, self.bits, self.group_size, self.int8_activations,
                                       layer.qzeros)
        return y if y.shape[-1] == layer.quantized_rows else y[..., :layer.quantized_rows]

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = self._quantized_product(layer, x)
        if layer.row_table is not None:
            return self._rescore(layer, x, y)
        if layer.float_tail is None:
            return y if y.is_contiguous() else y.contiguous()
        return torch.cat([y, layer.tail_product(x)], dim=-1)

    def _rescore(self, layer: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y = x W^T of a layer that also keeps its rows at rows_bits (a tied lm_head: int4 for
        the product, int8 for the lookups) with each x row's RESCORED_ROWS largest outputs
        scored again from those rows: x times the dequantized int8 row, each product exact in
        float64 and summed there, one output at a time (the same bits in any batch, as MTP's
        verify needs).
        The outputs that decide a greedy token, and most of a sampled one's mass, then carry
        int8's error instead of int4's, for the price of a few rows' reads a token (an int4
        product had nearly doubled int8's next-token KL: benchmarks/RESULTS.md, issue 39)."""
        if self.native and x.device.type == "cpu":
            # (quant_rows.cpp: one pass over y instead of a topk, rows read from their blocks;
            # y is this call's own output, written in place)
            torch.ops.hybrid_engine_cpu.rescore_top.default(x, y, layer.row_table, None, self.rows_bits,
                                                            self.group_size, RESCORED_ROWS)
            return y if y.is_contiguous() else y.contiguous()      # (cropped: a view of the padded rows)
        return rescore_top_reference(x, y, layer.row_table, self.rows_bits, self.group_size, RESCORED_ROWS)

    def _runs_plain(self, layer: nn.Module, tail: bool = False) -> bool:
        """Whether the layer's product is the native op's call alone: rows a multiple of 16, no
        input order, no rescoring, and no float tail (tail=True: or one the cpu method blocks,
        which linear_quant_tail runs in the same call)."""
        return (self.native and layer.input_order is None and layer.row_table is None
                and (layer.float_tail is None or tail and isinstance(layer.tail_product, BlockedProjection))
                and layer.qweight.device.type == "cpu" and layer.qweight.shape[0] * BLOCK == layer.quantized_rows)

    def product(self, layer: nn.Module):
        """The usual layer (`_runs_plain`) as the op's call itself: a 0.8B decode step makes
        about a hundred of them, a GDN in_proj with its float b and a rows one of them."""
        if not self._runs_plain(layer, tail=True):
            return super().product(layer)
        bits, group = self.bits, self.group_size
        # the weights read at each call: load_quantized may replace them after this
        if layer.float_tail is None:
            op = torch.ops.hybrid_engine_cpu.linear_quant.default
            return lambda x: op(x, layer.qweight, layer.qzeros, bits, group)
        op = torch.ops.hybrid_engine_cpu.linear_quant_tail.default

        def with_tail(x: torch.Tensor) -> torch.Tensor:
            tail = layer.tail_product
            return op(x, layer.qweight, layer.qzeros, bits, group, tail.blocked, tail.widens(x.numel() // x.shape[-1]),
                      tail.out_features)
        return with_tail

    def apply_swiglu(self, gate_up: nn.Module, down: nn.Module, x: torch.Tensor, silu_mul) -> torch.Tensor:
        """Both products and the activation in one native call (mlp_quant: linear_quant, silu_mul,
        linear_quant in C++, the same values) where both layers run plain at this method's
        bits and groups; else the three calls."""
        d = down.method
        if (d is self or (isinstance(d, QuantizedLinearMethod) and (d.bits, d.group_size, d.native)
                          == (self.bits, self.group_size, self.native))) \
                and self._runs_plain(gate_up) and self._runs_plain(down) and x.device.type == "cpu":
            return torch.ops.hybrid_engine_cpu.mlp_quant.default(x, gate_up.qweight, gate_up.qzeros, down.qweight,
                                                                 down.qzeros, self.bits, self.group_size)
        return super().apply_swiglu(gate_up, down, x, silu_mul)

    def _tail_product(self, tail: torch.Tensor):
        """x -> x tail^T by the float method's tail method, on a holder of the tail rows' own (the method keeps
        its layout there; `float_tail` stays the plain rows, a few KB, for reading them back)."""
        method = self.float_method.tail_method()
        holder = nn.Module()
        holder.shards, holder.in_features, holder.out_features = None, tail.shape[1], tail.shape[0]
        holder.output_sizes = [tail.shape[0]]
        with torch.device("meta"):
            method.create_weights(holder, holder.in_features, holder.out_features, tail.dtype)
        holder.weight = nn.Parameter(tail.clone(), requires_grad=False)
        method.process_weights_after_loading(holder)
        return method.product(holder)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if layer.float_tail is not None:
            raise NotImplementedError("rows of a layer with float shards")
        if layer.row_table is not None:
            return self._rows(layer, layer.row_table, None, self.rows_bits, ids).to(layer.weight_dtype)
        rows = self._rows(layer, layer.qweight, layer.qzeros, self.bits, ids)
        if layer.input_order is not None:
            rows = torch.empty_like(rows).index_copy_(-1, layer.input_order, rows)
        return rows.to(layer.weight_dtype)

    def _rows(self, layer: nn.Module, packed: torch.Tensor, zeros: torch.Tensor | None, bits: int,
              ids: torch.Tensor) -> torch.Tensor:
        """W[ids] float32 from one of the layer's packed tables (natively: only the ids' bytes are read)."""
        if self.native and packed.device.type == "cpu":
            return torch.ops.hybrid_engine_cpu.quant_rows.default(packed, zeros, ids, bits, self.group_size,
                                                                  layer.in_features)
        return unpack(packed, bits, self.group_size, rows=ids, zeros=zeros)

    def holds_weight_elsewhere(self, layer: nn.Module) -> bool:
        return True

    def __repr__(self) -> str:
        tail = f", float_shards={self.float_shards}" if self.float_shards else ""
        acts = ", int8_activations=True" if self.int8_activations and not self.native else ""
        return f"QuantizedLinearMethod(int{self.bits}, group_size={self.group_size}, native={self.native}{acts}{tail})"
