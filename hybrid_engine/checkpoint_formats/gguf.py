"""GGUF files (llama.cpp's format) of Qwen3.5 dense / MoE and Qwen3-Next, read with the gguf
package's GGUFReader: `LLM(model="file.gguf")`. The config comes from the metadata
(gguf_config.py), the tokenizer too (gguf_tokenizer.py), and each tensor from the file under our
name and layout (gguf_layout.py undoes the converter's changes).

Tensor types:
    F32, F16, BF16     float, cast to the engine's dtype
    Q8_0, Q4_0         a projection loads them as they are: int8 / int4 values in groups of 32
                       with one float16 scale per group (kernels/linear/quantized.py's layout);
                       Q8_0 = d fp16 + 32 int8, Q4_0 = d fp16 + 16 bytes, element j in the low
                       nibble of byte j and element 16 + j in its high one, value nibble - 8
    Q4_K, Q6_K         dequantized by gguf.quants.dequantize and requantized by our `quantize` to
                       int4 / int8 in groups of 32 (their 256-wide superblocks with 6-bit
                       sub-scales and mins have no exact int4 / int8 group-32 form)
    anything else      CheckpointError naming the tensor and its type
Which projections run quantized follows the file: a projection stored in one of the four
quantized types runs quantized (int8 if any of a merged layer's parts is 8-bit: an int4 value is
an int8 one at the same scale). Tensors the engine keeps float (norms, conv1d, A_log, dt_bias,
GDN's in_proj_b / in_proj_a, the embedding, the router and shared_expert_gate, MoE experts,
mtp.fc) are dequantized to float where the file holds them quantized; with no output.weight
the lm_head is tied to the (float) embedding. One exception: where the converter reordered
out_proj's columns by value head (gguf_layout.py step 4) and a head's width is not a multiple
of 32, the blocks do not follow the heads, and out_proj loads dequantized, float.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from collections import Counter
from typing import Iterator, Mapping

import numpy as np
import torch

from hybrid_engine.kernels.linear.quantized import QuantizedWeight, quantize
from hybrid_engine.models.config import CheckpointError, ModelConfig
from hybrid_engine.models.loader import WeightStream, split_ba

from .gguf_config import model_config
from .gguf_layout import VHeadOrder, stored_in, to_engine
from .gguf_tokenizer import gguf_tokenizer
from .rank_parts import Along, StoredParts

log = logging.getLogger("hybrid_engine")

MAGIC = b"GGUF"
GROUP = 32
SUFFIXES = ("weight_values", "weight_scales")       # a quantized projection's tensors, as loaded


def _types():
    from gguf import GGMLQuantizationType as T
    return (T.F32, T.F16, T.BF16), {T.Q8_0: 8, T.Q4_0: 4}, {T.Q4_K: 4, T.Q6_K: 8}


def is_gguf(path) -> bool:
    """Whether `path` is a GGUF file (by its magic)."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


@dataclass(frozen=True)
class GgufBlocks(StoredParts):
    """The QuantizedCheckpoint (kernels/linear/quantized.py) of a projection layer loaded from a
    GGUF file: the reader hands each projection's values and scales already unpacked."""
    bits: int
    group_size: int = GROUP

    def tensor_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        return {"weight_values": (rows, in_features), "weight_scales": (rows, in_features // GROUP)}

    def read(self, name: str, tensors: dict[str, torch.Tensor], rows: int, in_features: int) -> QuantizedWeight:
        return QuantizedWeight(tensors["weight_values"], tensors["weight_scales"], self.bits, GROUP)

    def _along(self, suffix: str) -> tuple[Along, Along]:
        return Along(0, 1), Along(1, 1 if suffix == "weight_values" else GROUP)


def _shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))          # GGUF lists dimensions innermost first


def _reader(path: Path):
    """gguf's GGUFReader, which first checks that each tensor's data lies inside the file (its
    own error for a truncated file is numpy's, naming no tensor)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type[0])]
                end = int(start_offs + offset[0]) + int(np.prod(dims)) * size // block
                if end > len(self.data):
                    raise CheckpointError(f"{path}: tensor {bytes(name).decode()} ends at byte {end}, past the "
                                          f"file's end ({len(self.data)}): the file is truncated")
            super()._build_tensors(start_offs, fields)

    return CheckedReader(str(path))


class GgufFile:
    """One GGUF file opened: its config, tokenizer and tensors under our names."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            reader = _reader(self.path)
        except CheckpointError:
            raise
        except Exception as e:            # the reader raises ValueError, IndexError, ... on a bad file
            raise CheckpointError(f"cannot read GGUF file {self.path}: {e}") from e
        self.tensors = {t.name: t for t in reader.tensors}
        self.metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        self.shapes = {name: _shape(t) for name, t in self.tensors.items()}
        embedding = self.tensors.get("token_embd.weight")
        self.config: ModelConfig = model_config(self.metadata, self.shapes, str(self.path),
                                                embedding.tensor_type.name if embedding is not None else None)
        self.arch = self.metadata["general.architecture"]
        c = self.config
        self.heads = (VHeadOrder(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                                 c.linear_value_head_dim) if self.arch != "qwen3next" else None)
        self.requantized: list[str] = []

    @property
    def holds_quantized(self) -> bool:
        floats, _, _ = _types()
        return any(t.tensor_type not in floats for t in self.tensors.values())

    def tokenizer(self):
        return gguf_tokenizer(self.metadata, str(self.path))

    def _sources(self, name: str) -> list[str]:
        return stored_in(name, self.arch, self.config.num_hidden_layers, self.tensors.keys())

    def stored_bits(self, projection: str) -> int | None:
        """8 or 4 where our projection `projection` (no `.weight`) loads quantized; None: float."""
        name = f"{projection}.weight"
        sources = self._sources(name)
        if len(sources) != 1 or sources[0] not in self.tensors:
            return None
        _, exact, requantized = _types()
        qtype = self.tensors[sources[0]].tensor_type
        bits = exact.get(qtype, requantized.get(qtype))
        where = self.heads.reordered(name) if self.heads is not None else None
        if bits is not None and where is not None and where[0] == 1 and self.heads.dv % GROUP:
            return None                    # columns reordered across blocks (the module docstring)
        return bits

    def stored_expert_bits(self, experts: str) -> int | None:
        """8 or 4 where every stacked tensor of the MoE layer's experts `experts` (ours, e.g.
        layers.3.mlp.experts) is stored quantized, 8 if any of them is 8-bit; None otherwise."""
        sources = [s for proj in ("gate_up_proj", "down_proj") for s in self._sources(f"{experts}.{proj}")]
        if not sources or any(s not in self.tensors for s in sources):
            return None
        _, exact, requantized = _types()
        bits = [exact.get(t, requantized.get(t)) for t in (self.tensors[s].tensor_type for s in sources)]
        return max(bits) if all(bits) else None

    # ---- reading ---------------------------------------------------------------------------

    def _check_type(self, gname: str) -> None:
        floats, exact, requantized = _types()
        qtype = self.tensors[gname].tensor_type
        if qtype not in floats and qtype not in exact and qtype not in requantized:
            raise CheckpointError(f"{self.path}: tensor {gname} is of type {qtype.name}; this engine reads F32, F16, "
                                  "BF16, Q8_0, Q4_0, Q4_K and Q6_K")

    def _float(self, gname: str) -> torch.Tensor:
        """A GGUF tensor as float32 in torch's order, dequantized if stored quantized."""
        from gguf import GGMLQuantizationType as T
        from gguf.quants import dequantize
        t = self.tensors[gname]
        data = t.data if t.tensor_type in (T.F32, T.F16) else dequantize(t.data, t.tensor_type)
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(self.shapes[gname])

    def _blocks(self, gname: str) -> QuantizedWeight:
        """A quantized 2-D GGUF tensor as int8 values [N, K] and float16 scales [N, K / 32]."""
        from gguf import GGMLQuantizationType as T
        t, (n, k) = self.tensors[gname], self.shapes[gname]
        _, exact, requantized = _types()
        if t.tensor_type in requantized:
            self.requantized.append(f"{gname} ({t.tensor_type.name})")
            return quantize(self._float(gname), requantized[t.tensor_type], GROUP)
        blocks = np.asarray(t.data).reshape(n, k // GROUP, -1)
        scales = torch.from_numpy(blocks[..., :2].copy().view(np.float16)[..., 0])
        if t.tensor_type == T.Q8_0:
            values = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(n, k)
            if (values == -128).any():
                # the kernels take int8 values in [-127, 127] (llama.cpp's quantizer writes no -128)
                raise CheckpointError(f"{self.path}: tensor {gname} (Q8_0) holds the value -128, outside "
                                      "[-127, 127]")
        else:
            nibbles = torch.from_numpy(blocks[..., 2:].copy())
            values = (torch.cat([nibbles & 15, nibbles >> 4], dim=-1).to(torch.int8) - 8).reshape(n, k)
        if not torch.isfinite(scales).all():
            raise CheckpointError(f"{self.path}: tensor {gname} holds block scales that are NaN or Inf")
        return QuantizedWeight(values, scales, exact[t.tensor_type], GROUP)

    def _quantized(self, name: str, gname: str) -> QuantizedWeight:
        """Our projection `name`'s quantized weight, value heads put back in grouped order."""
        qw = self._blocks(gname)
        where = self.heads.reordered(name) if self.heads is not None else None
        if where is None:
            return qw
        values = self.heads.apply(name, qw.values, to_tiled=False)
        if where[0] == 0:
            scales = self.heads.apply(name, qw.scales, to_tiled=False)
        else:                                    # columns: whole blocks move with their heads
            group_heads = VHeadOrder(self.heads.hk, self.heads.hk * self.heads.r, 0, self.heads.dv // GROUP)
            scales = group_heads.apply(name, qw.scales, to_tiled=False)
        return QuantizedWeight(values, scales, qw.bits, GROUP)

    def _float_tensor(self, name: str, sources: list[str], shape: tuple[int, ...]) -> torch.Tensor:
        if len(sources) == 2:                                   # experts' gate and up, unfused
            return torch.cat([self._float(s) for s in sources], dim=1)
        t = self._float(sources[0])
        if self.arch == "qwen3next" and name.endswith(("in_proj_b.weight", "in_proj_a.weight")):
            b, a = split_ba(t, self.config)
            t = b if name.endswith("in_proj_b.weight") else a
        return to_engine(name, t, self.heads, shape)

    def _check_shape(self, name: str, sources: list[str], shape: tuple[int, ...]) -> None:
        found = [self.shapes[s] for s in sources]
        if len(found) == 2:
            found = [(found[0][0], found[0][1] + found[1][1], *found[0][2:])] if found[0] == found[1] else found
        elif self.arch == "qwen3next" and name.endswith(("in_proj_b.weight", "in_proj_a.weight")):
            found = [(found[0][0] // 2, *found[0][1:])] if found[0][0] % 2 == 0 else found
        squeeze = lambda s: tuple(d for d in s if d != 1)       # conv1d is stored [C, K] for [C, 1, K]
        if len(found) != 1 or squeeze(found[0]) != squeeze(shape):
            raise CheckpointError(f"{self.path}: tensor {', '.join(sources)} has shape "
                                  f"{' + '.join(str(list(s)) for s in found)}; the metadata's sizes make {name} "
                                  f"{list(shape)}")

    def load_weights(self, config: ModelConfig, expected: Mapping[str, tuple[int, ...]],
                     dtype: torch.dtype) -> WeightStream:
        """Every tensor in `expected` (our names -> shapes; a quantized projection's as
        `SUFFIXES`), float ones cast to `dtype`, read as the stream is iterated. The MTP head's are
        left out when the file has none of them; any other missing tensor, or one the model does
        not take, is a CheckpointError (raised here, before any data is read)."""
        base = {name: (name.rpartition(".")[0] + ".weight" if name.endswith(SUFFIXES) else name) for name in expected}
        sources = {name: self._sources(base[name]) for name in expected}
        unknown = [name for name, s in sources.items() if not s]
        if unknown:
            raise CheckpointError(f"{self.path}: no GGUF tensor holds {', '.join(unknown[:5])}")
        missing = {name: [s for s in srcs if s not in self.tensors] for name, srcs in sources.items()}
        missing = {name: m for name, m in missing.items() if m}
        mtp = [name for name in expected if name.startswith("mtp.")]
        if mtp and all(name in missing for name in mtp):
            expected = {n: s for n, s in expected.items() if not n.startswith("mtp.")}
            missing = {n: m for n, m in missing.items() if not n.startswith("mtp.")}
        if missing:
            listed = ", ".join(f"{m[0]} ({name})" for name, m in list(missing.items())[:5])
            raise CheckpointError(f"{self.path} is missing {len(missing)} tensor(s): {listed}")
        used = {s for name in expected for s in sources[name]}
        unexpected = sorted(set(self.tensors) - used)
        if unexpected:
            raise CheckpointError(f"{self.path} has {len(unexpected)} tensor(s) the model does not take: "
                                  f"{', '.join(unexpected[:5])}")
        for name in expected:
            for s in sources[name]:
                self._check_type(s)
        for name, shape in expected.items():
            if name.endswith(SUFFIXES):
                w = base[name]
                self._check_shape(w, sources[name], expected[w.rpartition(".")[0] + ".weight_values"])
            else:
                self._check_shape(name, sources[name], shape)
        return WeightStream(list(expected), lambda: self._read(expected, sources, base, dtype))

    def _read(self, expected: Mapping[str, tuple[int, ...]], sources: dict[str, list[str]],
              base: dict[str, str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """load_weights' tensors one at a time; a quantized projection's values and scales come
        from one read of its blocks, kept only until both are handed out."""
        quantized, left = {}, Counter(base[name] for name in expected if name.endswith(SUFFIXES))
        for name, shape in expected.items():
            srcs = sources[name]
            if name.endswith(SUFFIXES):
                w = base[name]
                if w not in quantized:
                    quantized[w] = self._quantized(w, srcs[0])
                left[w] -= 1
                qw = quantized[w] if left[w] else quantized.pop(w)
                yield name, qw.values if name.endswith("weight_values") else qw.scales
                del qw
            else:
                yield name, self._float_tensor(name, srcs, shape).to(dtype).contiguous()

    def report(self) -> None:
        if self.requantized:
            log.info("%s: %d tensor(s) requantized to int4 / int8 in groups of %d from K-quants: %s%s", self.path,
                     len(self.requantized), GROUP, ", ".join(self.requantized[:3]),
                     " ..." if len(self.requantized) > 3 else "")

