"""Online weight quantization (`LLM(quantization="int8" | "int4")`): which projections of a float
checkpoint are quantized at load, and with which linear method.

Quantized: every projection layer (models/linear.py `Linear`): GDN's in_proj_qkv / in_proj_z and
out_proj, attention's q/k/v/o, the MLPs, the MTP layer's attention and MLP, and the lm_head. A
tied embedding then reads its rows from the quantized table, at int8 at least: under int4 the
lm_head's method keeps the table twice, int4 for the product (read whole at every step) and
int8 for the lookups (one row a token). The lookup's error reaches every token's input: on the
default model an int4 lookup cost about a quarter of int4's perplexity loss, the int4 product
less than a tenth (benchmarks/RESULTS.md, issue 39); llama.cpp's Q4_0 and Q4_K_M files keep their tied
table at Q6_K for both. The int4 product's largest logits of each token are then scored again
from the int8 rows (QuantizedLinearMethod._rescore): the logits that pick a greedy token, and
MTP's drafts, carry int8's error for a few rows' reads. Kept float, as every quantized
format and peer keeps them: GDN's in_proj_b / in_proj_a (they feed the decay and the beta
sigmoid; a float tail of the merged in_proj), mtp.fc, the MoE router and shared_expert_gate
(plain nn.Linear), the conv taps, A_log, dt_bias and the norms. MoE experts are quantized each
on its own (models/mlp.py Experts: one SwiGLU of projection layers per expert after loading).
A projection whose input width the group size does not divide stays float too, and the
engine's log says which. Under tensor parallelism each rank quantizes its own part of each
weight, or takes its whole blocks of a GGUF file's or a folder stored quantized
(`tensor_parallel_blocks`).

Checkpoints stored quantized choose per projection instead, as the checkpoint stores it:
`CheckpointLayers` (compressed-tensors, GPTQ and FP8 folders; MoE experts too, per expert) and
`GgufLayers` (GGUF files; their quantized experts are read dequantized, then quantized per
expert at the file's bits, which gives the file's blocks again).

The quantized layers run QuantizedLinearMethod (kernels/linear/quantized.py): the native kernel
where the cpu backend's kernels build (activations rounded to int8 in blocks of 32, as
llama.cpp's quantized products round them; group sizes a multiple of 32), else its torch
reference on the dequantized weights with float activations; the float layers keep the
backend's own method.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .kernels.linear import LinearMethod
from .kernels.linear.reference import shard_names
from .kernels.linear.quantized import QuantizedLinearMethod, check_scheme, native_takes
from .models.config import CheckpointError

METHODS = {"int8": 8, "int4": 4}
DEFAULT_GROUP_SIZE = 32                    # llama.cpp's Q8_0 / Q4_0 block
GDN_FLOAT_SHARDS = ("in_proj_b", "in_proj_a")
FLOAT_LAYERS = ("mtp.fc",)
LOOKUP_MIN_BITS = 8                         # a tied lm_head's rows for the embedding's lookups

log = logging.getLogger("hybrid_engine")


@dataclass(frozen=True)
class Quantization:
    method: str                             # "int8" or "int4"
    group_size: int = DEFAULT_GROUP_SIZE

    @property
    def bits(self) -> int:
        return METHODS[self.method]


def parse_quantization(method: str | None, group_size: int | None = None) -> Quantization | None:
    """LLM's quantization / quantization_group_size, checked: None (float weights) or a scheme."""
    if method is None:
        if group_size is not None:
            raise ValueError("quantization_group_size is set but quantization is None")
        return None
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {sorted(METHODS)} or None, got {method!r}")
    if group_size is None:
        group_size = DEFAULT_GROUP_SIZE
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"quantization_group_size must be an int, got {group_size!r}")
    try:
        check_scheme(METHODS[method], group_size)
    except ValueError as e:
        raise ValueError(f"quantization_group_size: {e}") from None
    return Quantization(method, group_size)


class QuantizedLayers:
    """name, layer -> the linear method of each projection layer of a model to load (models/load.py
    asks it once per layer); `kept_float`: the quantizable layers left float for their shape."""

    def __init__(self, scheme: Quantization, float_method: LinearMethod, native: bool,
                 int8_activations: bool | None = None):
        # the native kernel takes groups of a multiple of 32 (its blocks of x nest in them)
        self.scheme, self.float_method = scheme, float_method
        self.native = native and native_takes(scheme.group_size)
        self.int8_activations = self.native if int8_activations is None else int8_activations
        self.kept_float: list[str] = []

    def __call__(self, name: str, layer) -> LinearMethod | None:
        if not hasattr(layer, "shards"):                 # a MoE layer's stacked experts
            return self._experts(name, layer)
        if name in FLOAT_LAYERS:
            return self.float_method
        if layer.in_features % self.scheme.group_size:
            self.kept_float.append(name)
            return self.float_method
        shards = tuple(layer.shards or ())
        float_shards = tuple(s for s in GDN_FLOAT_SHARDS if s in shards)
        return QuantizedLinearMethod(self.scheme.bits, self.scheme.group_size, native=self.native,
                                     float_shards=float_shards, int8_activations=self.int8_activations,
                                     float_method=self.float_method,
                                     rows_bits=max(self.scheme.bits, LOOKUP_MIN_BITS) if name == "lm_head" else None)

    def _experts(self, name: str, experts) -> LinearMethod | None:
        """Each expert's gate_up and down projections quantized like the others (None: float)."""
        if experts.hidden % self.scheme.group_size or experts.intermediate % self.scheme.group_size:
            self.kept_float.append(name)
            return None
        return QuantizedLinearMethod(self.scheme.bits, self.scheme.group_size, native=self.native,
                                     int8_activations=self.int8_activations)

    def progress_bar(self, tensors):
        """The checkpoint's tensors as they load (each layer quantized once its last one is in),
        with a progress bar on a terminal."""
        from tqdm import tqdm
        return tqdm(tensors, desc=f"quantizing to {self.scheme.method}", unit="tensor", leave=False, disable=None)

    def report(self) -> None:
        if self.kept_float:
            log.warning("%s: %d projection(s) kept float, their input width not a multiple of the group "
                        "size %d: %s", self.scheme.method, len(self.kept_float), self.scheme.group_size,
                        ", ".join(self.kept_float[:5]) + (" ..." if len(self.kept_float) > 5 else ""))


class CheckpointLayers:
    """The same for a checkpoint stored quantized (hybrid_engine/checkpoint_formats/): a
    projection is quantized where the checkpoint holds it so (its format's tensors beside its
    name), each shard of a merged one on its own (GDN's b / a float beside a quantized in_proj),
    as the checkpoint's own choice rules (a quantized MTP head loads quantized, a 16-bit one
    stays 16-bit), in the scheme the checkpoint gives that module (`scheme_for`: a
    compressed-tensors checkpoint may hold int4 and int8 modules side by side); so are a MoE
    layer's experts, stored per expert (routed experts quantized beside a float shared expert
    load so). names: the checkpoint's tensors, internal name -> stored name (models/loader.py
    checkpoint_names)."""

    def __init__(self, checkpoint, names: dict[str, str], float_method: LinearMethod, native: bool,
                 int8_activations: bool | None = None):
        self.checkpoint, self.names, self.float_method = checkpoint, names, float_method
        self.native, self.int8_activations = native, int8_activations

    def __call__(self, name: str, layer) -> LinearMethod | None:
        if not hasattr(layer, "shards"):
            return self._stored_experts(name, layer)
        projections = [base for base, _ in shard_names(layer, name)]
        marker = self.checkpoint.marker
        quantized = [base for base in projections if f"{base}.{marker}" in self.names]
        if not quantized:
            return self.float_method
        # a merged layer runs one scheme: its quantized parts must share it (vLLM requires the same)
        schemes = {base: self.checkpoint.scheme_for(self.names[f"{base}.{marker}"].removesuffix(f".{marker}"))
                   for base in quantized}
        scheme = schemes[quantized[0]]
        if any(s != scheme for s in schemes.values()):
            given = ", ".join(f"int{s.bits} in groups of {s.group_size}" for s in schemes.values())
            raise CheckpointError(f"the projections {quantized} load as one layer {name} but the checkpoint "
                                  f"gives them different schemes: {given}")
        float_shards = tuple(base.rpartition(".")[2] for base in projections if base not in quantized)
        return self._method(scheme, float_shards=float_shards, float_method=self.float_method)

    def _method(self, scheme, **kwargs) -> QuantizedLinearMethod:
        """The method of a projection the checkpoint stores in `scheme` (native where the kernel
        takes its groups)."""
        native = self.native and native_takes(scheme.group_size)
        int8_activations = native if self.int8_activations is None else self.int8_activations
        return QuantizedLinearMethod(scheme.bits, scheme.group_size, native=native,
                                     int8_activations=int8_activations, checkpoint=scheme, **kwargs)

    def _stored_experts(self, name: str, experts) -> LinearMethod | None:
        """A MoE layer's experts as per-expert projection layers where the checkpoint stores any
        of them quantized (`experts.{e}.gate_proj.<marker>`, ...): each layer is then chosen for on
        its own (`__call__`), as stored; None: float, stacked."""
        marker = self.checkpoint.marker
        stored = [self.names[n] for e in range(experts.num_experts) for proj in ("gate_proj", "up_proj", "down_proj")
                  if (n := f"{name}.{e}.{proj}.{marker}") in self.names]
        if not stored:
            return None
        return self._method(self.checkpoint.scheme_for(stored[0].removesuffix(f".{marker}")))

    def progress_bar(self, tensors):
        return tensors                                 # nothing to quantize: the layers only repack

    def report(self) -> None:
        pass


class GgufLayers:
    """The same for a GGUF file (hybrid_engine/checkpoint_formats/gguf.py): a projection runs
    quantized where the file stores it in a quantized type, in int8 if any of a merged layer's
    parts is 8-bit (an int4 value is an int8 one at the same scale), GDN's b / a as its float
    tail; a merged layer whose other parts mix float and quantized runs float (dequantized)."""

    def __init__(self, file, float_method: LinearMethod, native: bool):
        self.file, self.float_method, self.native = file, float_method, native
        self.kept_float: list[str] = []

    def __call__(self, name: str, layer) -> LinearMethod | None:
        if not hasattr(layer, "shards"):
            return self._experts(name)
        if name in FLOAT_LAYERS:
            return self.float_method
        projections = [base for base, _ in shard_names(layer, name)]
        bits = {base: self.file.stored_bits(base) for base in projections}
        float_shards = tuple(b.rpartition(".")[2] for b in projections if b.rpartition(".")[2] in GDN_FLOAT_SHARDS)
        quantized = [bits[b] for b in projections if b.rpartition(".")[2] not in float_shards]
        if not any(quantized):
            return self.float_method
        if not all(quantized):
            self.kept_float.append(name)
            return self.float_method
        from .checkpoint_formats.gguf import GROUP, GgufBlocks
        return QuantizedLinearMethod(max(quantized), GROUP, native=self.native, float_shards=float_shards,
                                     checkpoint=GgufBlocks(max(quantized)), float_method=self.float_method)

    def _experts(self, name: str) -> LinearMethod | None:
        """A MoE layer's experts, stored as stacked quantized tensors (ffn_{gate,up,down}_exps):
        read dequantized, stacked, then quantized per expert as online quantization does
        (models/mlp.py Experts), at the file's bits. That gives the file's blocks again: Q8_0's
        scale is llama.cpp's int8 rule, and int4's scale search finds Q4_0's, where the error of
        the dequantized values is zero (tests/test_gguf.py). None: float, as stored."""
        bits = self.file.stored_expert_bits(name)
        if bits is None:
            return None
        from .checkpoint_formats.gguf import GROUP
        return QuantizedLinearMethod(bits, GROUP, native=self.native)

    def progress_bar(self, tensors):
        return tensors

    def report(self) -> None:
        self.file.report()
        if self.kept_float:
            log.warning("%s: %d projection(s) run float, their parts stored partly float and partly quantized: %s",
                        self.file.path, len(self.kept_float), ", ".join(self.kept_float[:5]))


def quantized_layers(config, float_method: LinearMethod, kernels, gguf_file=None):
    """The per-layer methods of an engine whose config asks for quantization (EngineConfig) or
    whose checkpoint is stored quantized (an HF folder whose quantization_config a format of
    hybrid_engine/checkpoint_formats/ reads, or `gguf_file`: a GGUF file's GgufFile); the native
    kernel's where its backend is the cpu one and the kernels build. None: float weights."""
    from .checkpoint_formats import stored_quantization
    from .kernels.backends import native_cpu_available
    from .models.loader import checkpoint_names
    scheme = parse_quantization(config.quantization, config.quantization_group_size)
    native = kernels.name == "cpu" and native_cpu_available()
    if gguf_file is not None and gguf_file.holds_quantized:
        if scheme is not None:
            raise ValueError(f"{config.model} is stored quantized already: leave quantization unset")
        return GgufLayers(gguf_file, float_method, native)
    stored = None if gguf_file is not None else stored_quantization(config.model)
    if stored is not None:
        if scheme is not None:
            raise ValueError(f"{config.model} is stored quantized already: leave quantization unset")
        return CheckpointLayers(stored, checkpoint_names(config.model), float_method, native)
    if scheme is None:
        return None
    return QuantizedLayers(scheme, float_method, native)


def tensor_parallel_blocks(config, gguf_file=None) -> tuple[int | None, int | None]:
    """What tensor parallelism must keep whole (models/parallel.py check_tensor_parallel): the
    group size along a projection's input columns, and the block of output rows (None: none).
    A GGUF file's blocks where it holds quantized tensors (each rank takes whole blocks of its
    rows and columns); a folder stored quantized, its format's groups or blocks and, along the
    rows, its packed zero points or FP8 scale blocks (each rank takes its part of the stored
    tensors: checkpoint_formats/rank_parts.py); else online quantization's groups, where each
    rank quantizes its own part of each float weight; (None, None) for float weights."""
    from .checkpoint_formats import stored_quantization
    if gguf_file is not None and gguf_file.holds_quantized:
        from .checkpoint_formats.gguf import GROUP
        return GROUP, None
    stored = None if gguf_file is not None else stored_quantization(config.model)
    if stored is not None:
        if getattr(stored, "act_order", False):
            raise ValueError(f"{config.model} is GPTQ with desc_act (activation order): tensor_parallel_size > 1 "
                             "does not load it yet, as a rank's input columns of o_proj / down_proj would hold "
                             "pieces of groups scattered over the input, none whole")
        rows, columns = stored.split_blocks
        return columns, rows if rows > 1 else None
    scheme = parse_quantization(config.quantization, config.quantization_group_size)
    return (None if scheme is None else scheme.group_size), None
