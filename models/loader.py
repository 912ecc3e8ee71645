"""Safetensors checkpoint loading: checkpoint names -> the engine's internal names.

Internal names mirror the HF text model without the leading ``model.`` (``embed_tokens.weight``,
``layers.3.self_attn.q_proj.weight``, ``layers.0.mlp.experts.gate_up_proj``, ``mtp.fc.weight``...).
The caller says which tensors it wants (``expected``: name -> shape); this module finds them in
the folder's ``*.safetensors`` files and converts:

* prefixes: ``model.language_model.`` / ``model.`` are stripped, ``model.visual.*`` / ``visual.*``
  are skipped, ``mtp.*`` and ``lm_head.weight`` are kept as they are;
* Qwen3-Next's grouped ``in_proj_qkvz`` / ``in_proj_ba`` are de-interleaved into the Qwen3.5
  layout ``in_proj_qkv`` (flat ``[q | k | v]``), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``
  (QWEN35_REFERENCE.md §4.2);
* MoE experts stored one module per expert (``experts.{e}.{gate,up,down}_proj.weight``, which is
  what transformers 5.24 ``save_pretrained`` writes) are stacked into the fused
  ``experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``experts.down_proj`` [E, H, I]; the
  fused form is accepted as stored. Where the caller asks for an expert's own tensors instead
  (experts stored quantized: ``experts.{e}.gate_proj.weight_packed``, an FP8 expert's
  ``.weight`` beside its ``.weight_scale_inv``), they are read as they are, like any other.

Only safetensors are read (lazily, with ``safe_open``); pickled ``.bin`` files are refused.
Every problem raises ``CheckpointError`` with one message naming the file or tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open

from ..checkpoint_formats.int32_fields import pack_fields, unpack_fields
from .config import SUPPORTED_MODEL_TYPES, CheckpointError, ModelConfig

INDEX_NAME = "model.safetensors.index.json"
SKIP_PREFIXES = ("model.visual.", "visual.")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
_MAX_LISTED = 5
# safetensors dtype names of floating tensors: F64, F32, F16, BF16, F8_E4M3, F8_E5M2, ...
_FLOAT_DTYPES = ("F", "BF")
# Tensors of quantized checkpoint formats (hybrid_engine/checkpoint_formats/) are read as stored:
# integer codes, and scales at the precision their format chose (not cast to the load dtype).
STORED_AS_IS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
                "weight_scale_inv", "qweight", "qzeros", "scales", "g_idx")


def stored_as_is(name: str) -> bool:
    return name.rpartition(".")[2] in STORED_AS_IS

_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# (a quantized checkpoint stores the grouped in_proj_qkvz's packed values and scales row by row
# as the float weight: each de-interleaves the same way; its zero points are packed along the
# rows, so they are unpacked to rows, de-interleaved and packed again)
_QKVZ_RE = re.compile(r"^(?P<prefix>.*\.linear_attn)\.in_proj_qkvz\."
                      r"(?P<suffix>weight|weight_packed|weight_scale|weight_shape|weight_zero_point)$")
_BA_RE = re.compile(r"^(?P<prefix>.*\.linear_attn)\.in_proj_ba\.weight$")


# ---- dtype ---------------------------------------------------------------------------------------

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(name: str | torch.dtype, config: ModelConfig | None = None) -> torch.dtype:
    """"float32" / "bfloat16" / "float16" (or fp32/bf16/fp16) -> torch dtype; "auto" -> the
    config's torch_dtype when set, else float32. Anything else raises ValueError."""
    if isinstance(name, torch.dtype):
        if name in (torch.float32, torch.bfloat16, torch.float16):
            return name
        raise ValueError(f"unsupported dtype {name}; use float32, bfloat16, float16 or auto")
    key = str(name).strip().lower()
    if key == "auto":
        cfg_dtype = getattr(config, "torch_dtype", None) if config is not None else None
        if not cfg_dtype:
            return torch.float32
        cfg_key = str(cfg_dtype).strip().lower().removeprefix("torch.")
        if cfg_key not in _DTYPES:
            raise ValueError(
                f"config torch_dtype {cfg_dtype!r} is not supported; pass float32, bfloat16 or float16 explicitly"
            )
        return _DTYPES[cfg_key]
    key = key.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use float32, bfloat16, float16 or auto")
    return _DTYPES[key]


# ---- file discovery ------------------------------------------------------------------------------

def _list_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read, and the index's weight_map when there is an index."""
    index_path = folder / INDEX_NAME
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read checkpoint index {index_path}: {e}") from e
        names = sorted(set(weight_map.values()))
        files = []
        for name in names:
            path = folder / name
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {name} listed in {INDEX_NAME} is missing from {folder}")
            files.append(path)
        if not files:
            raise CheckpointError(f"{index_path} lists no tensors")
        return files, weight_map
    files = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"no *.safetensors files in {folder}; found {', '.join(pickles)}, but PyTorch "
                "pickle checkpoints (.bin/.pt) are not supported (convert them to safetensors)"
            )
        raise CheckpointError(f"no *.safetensors files in {folder}")
    return files, None


# ---- name mapping --------------------------------------------------------------------------------

def map_name(name: str) -> str | None:
    """Checkpoint tensor name -> internal name, or None for tensors the engine never uses."""
    if name.startswith(SKIP_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return name[len("model.language_model."):]
    if name.startswith("model."):
        return name[len("model."):]
    return name  # lm_head.weight, mtp.*, and anything else (reported if unexpected)


def _fmt(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" (and {len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


class _Source:
    """Where one raw checkpoint tensor lives."""

    __slots__ = ("file", "key", "shape", "dtype")

    def __init__(self, file: Path, key: str, shape: tuple[int, ...], dtype: str):
        self.file, self.key, self.shape, self.dtype = file, key, shape, dtype


def _check_shape(what: str, found: tuple[int, ...], want: tuple[int, ...], file: Path | None = None):
    if tuple(found) != tuple(want):
        where = f" (in {file.name})" if file is not None else ""
        raise CheckpointError(
            f"tensor {what}{where} has the wrong shape: expected {_fmt(want)}, found {_fmt(found)}"
        )


def checkpoint_names(folder: str | Path) -> dict[str, str]:
    """The internal names of every tensor in `folder`'s safetensors files (headers only) -> the
    name each is stored under; a grouped in_proj_qkvz's under the names of the parts it loads as too."""
    files, _ = _list_files(Path(folder))
    names = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                names.update((map_name(key), key) for key in f.keys() if map_name(key) is not None)
        except Exception as e:
            raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from e
    for name, key in list(names.items()):
        if m := _QKVZ_RE.match(name):
            names.update((f"{m['prefix']}.{part}.{m['suffix']}", key) for part in ("in_proj_qkv", "in_proj_z"))
    return names


class WeightStream:
    """A checkpoint's tensors by internal name, read one at a time as they are iterated
    ((name, tensor) pairs; `dict(stream)` reads them all): the caller can take each tensor into
    its layer, and a layer quantize or repack its weights, before the next one is read, so
    loading never holds the whole model in the load dtype. names: every name it gives, in order."""

    def __init__(self, names: list[str], read: Callable[[], Iterator[tuple[str, torch.Tensor]]]):
        self.names, self._read = names, read

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._read()

    def __len__(self) -> int:
        return len(self.names)


# ---- main entry point ----------------------------------------------------------------------------

def load_weights(
    folder: str | Path,
    config: ModelConfig,
    expected: Mapping[str, torch.Size | tuple[int, ...]],
    dtype: torch.dtype,
    optional_prefixes: tuple[str, ...] = ("mtp.",),
    other_ranks: tuple[str, ...] = (),
) -> WeightStream:
    """Every tensor named in `expected` (internal names -> shapes) from `folder`'s safetensors,
    converted to the internal layout and cast to `dtype`: checked against the headers now, read
    one at a time as the stream is iterated (`dict(...)` reads them all).

    Tensors under an `optional_prefixes` prefix are all-or-nothing: if the checkpoint has none of
    them they are left out of the result; if it has some, every expected one must be there.
    Tensors under an `other_ranks` prefix belong to other tensor-parallel ranks (their experts,
    stored per expert) and are left unread.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder not found: {folder}")
    if config.family not in _FAMILIES:
        raise CheckpointError(
            f"unsupported model family {config.family!r}; supported model_types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"unsupported load dtype {dtype}; use float32, bfloat16 or float16")
    expected = {k: tuple(int(s) for s in v) for k, v in expected.items()}
    files, weight_map = _list_files(folder)

    # 1. headers: every raw tensor's file and shape (no data is read here)
    raw: dict[str, _Source] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    header = f.get_slice(key)
                    if key in raw:
                        raise CheckpointError(
                            f"tensor {key} appears in both {raw[key].file.name} and {path.name}"
                        )
                    raw[key] = _Source(path, key, tuple(header.get_shape()), header.get_dtype())
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types (and OSError) on bad files
            raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from e
    if weight_map is not None:
        for key, fname in weight_map.items():
            src = raw.get(key)
            if src is None or src.file.name != Path(fname).name:
                raise CheckpointError(f"{INDEX_NAME} lists tensor {key} in {fname}, but that file does not hold it")

    # 2. plan: internal name -> how to build it from raw tensors
    direct: dict[str, _Source] = {}
    experts: dict[str, dict[str, dict[int, _Source]]] = {}  # "<...>.experts" -> proj -> idx -> src
    qkvz: dict[tuple[str, str], _Source] = {}  # ("<...>.linear_attn", tensor suffix) -> src
    ba: dict[str, _Source] = {}
    for key, src in raw.items():
        name = map_name(key)
        if name is None:
            continue
        # (experts stored quantized are asked for per expert, each under its own name: read as is)
        if name not in expected and (m := _EXPERT_RE.match(name)):
            experts.setdefault(m["prefix"], {}).setdefault(m["proj"], {})[int(m["idx"])] = src
        elif m := _QKVZ_RE.match(name):
            qkvz[(m["prefix"], m["suffix"])] = src
        elif m := _BA_RE.match(name):
            ba[m["prefix"]] = src
        else:
            if name in direct:
                raise CheckpointError(f"tensors {direct[name].key} and {key} both map to {name}")
            direct[name] = src

    provided: dict[str, tuple] = {name: ("direct", src) for name, src in direct.items()}

    def name_in_file(name: str) -> str:
        """The checkpoint tensor(s) behind an internal name, for messages."""
        kind, arg = provided[name]
        if kind == "direct":
            return arg.key
        if kind == "qkvz":
            return qkvz[arg].key
        if kind == "ba":
            return ba[arg].key
        proj = "down_proj" if kind == "experts_down" else "gate_proj"
        if not experts[arg].get(proj):
            proj = "up_proj"
        key = next(iter(experts[arg][proj].values())).key
        return f"{key.rsplit('.', 3)[0]}.{{e}}.{proj}.weight"

    def provide(name: str, recipe: tuple, source_key: str):
        if name in provided:
            raise CheckpointError(
                f"checkpoint holds {name} twice: stored as {name_in_file(name)} and derived from {source_key}"
            )
        provided[name] = recipe

    for prefix, projs in sorted(experts.items()):
        for proj, target, kind in (("gate_proj", "gate_up_proj", "experts_gate_up"),
                                   ("up_proj", "gate_up_proj", "experts_gate_up"),
                                   ("down_proj", "down_proj", "experts_down")):
            if not projs.get(proj):
                continue
            name = f"{prefix}.{target}"
            if provided.get(name, ("",))[0] == kind:
                continue  # gate_proj and up_proj feed the same fused tensor
            provide(name, (kind, prefix), next(iter(projs[proj].values())).key)
    for (prefix, suffix), src in sorted(qkvz.items()):
        provide(f"{prefix}.in_proj_qkv.{suffix}", ("qkvz", (prefix, suffix)), src.key)
        provide(f"{prefix}.in_proj_z.{suffix}", ("qkvz", (prefix, suffix)), src.key)
    for prefix, src in sorted(ba.items()):
        provide(f"{prefix}.in_proj_b.weight", ("ba", prefix), src.key)
        provide(f"{prefix}.in_proj_a.weight", ("ba", prefix), src.key)

    # 3. which names to load; missing / unexpected
    wanted = dict(expected)
    ignored: set[str] = set()
    if "lm_head.weight" in provided and "lm_head.weight" not in expected and config.tie_word_embeddings:
        ignored.add("lm_head.weight")  # tied checkpoints may carry a copy of the embedding
    ignored.update(n for n in provided if n.startswith(other_ranks))
    for prefix in optional_prefixes:
        exp_opt = [n for n in expected if n.startswith(prefix)]
        got_opt = [n for n in provided if n.startswith(prefix)]
        if not exp_opt:
            ignored.update(got_opt)  # the caller does not want them (e.g. MTP disabled)
        elif not any(n in provided for n in exp_opt):
            for n in exp_opt:
                wanted.pop(n)
            ignored.update(got_opt)
    missing = [n for n in wanted if n not in provided]
    if missing:
        raise CheckpointError(
            f"checkpoint in {folder} is missing {len(missing)} tensor(s): {_listing(missing)}"
        )
    unexpected = [n for n in provided if n not in wanted and n not in ignored]
    if unexpected:
        shown = sorted({name_in_file(n) for n in unexpected})
        raise CheckpointError(
            f"checkpoint in {folder} has {len(shown)} unexpected tensor(s): {_listing(shown)}"
        )

    # 4. dtype and shape checks against headers, before any data is read
    for src in raw.values():
        # Every tensor the model has is floating point; an int or bool one is a broken export.
        name = map_name(src.key)
        if name is not None and not stored_as_is(name) and not src.dtype.startswith(_FLOAT_DTYPES):
            raise CheckpointError(f"tensor {src.key} in {src.file.name} is stored as {src.dtype}; "
                                  "weights must be floating point (F32, BF16, F16, ...)")
        # An FP8 weight means W / scale: without its block scales it would load as a wrong model.
        if (name is not None and src.dtype.startswith("F8")
                and f"{src.key.rpartition('.')[0]}.weight_scale_inv" not in raw):
            raise CheckpointError(f"tensor {src.key} in {src.file.name} is float8 without its weight_scale_inv "
                                  "beside it: FP8 weights need their block scales")
    for name, want in wanted.items():
        kind, arg = provided[name]
        if kind == "direct":
            _check_shape(arg.key, arg.shape, want, arg.file)
        elif kind in ("experts_gate_up", "experts_down"):
            _check_experts(arg, experts[arg], name, want, kind)
        elif kind == "qkvz":
            _check_qkvz(config, qkvz[arg], wanted, arg)
        elif kind == "ba":
            _check_ba(config, ba[arg], wanted, arg)

    # 5. read, convert, cast (one source tensor at a time, as the caller takes them)
    def read_all() -> Iterator[tuple[str, torch.Tensor]]:
        handles: dict[Path, object] = {}

        def read(src: _Source) -> torch.Tensor:
            try:
                f = handles.get(src.file)
                if f is None:
                    f = handles[src.file] = safe_open(str(src.file), framework="pt")
                return f.get_tensor(src.key)
            except Exception as e:
                raise CheckpointError(f"cannot read tensor {src.key} from checkpoint file {src.file}: {e}") from e

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype).contiguous() if t.is_floating_point() else t.contiguous()

        def checked(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
            _check_finite(t, name_in_file(name), dtype)
            return name, t

        def grouped_parts(kind: str, arg) -> dict[str, torch.Tensor]:
            """Both parts of a grouped Qwen3-Next tensor (one read), those the caller wants."""
            if kind == "qkvz":
                prefix, suffix = arg
                if suffix == "weight_zero_point":
                    qkv, z = split_packed_qkvz(read(qkvz[arg]), config)
                else:
                    qkv, z = split_qkvz(read(qkvz[arg]), config, rows_only=suffix == "weight_shape")
                keep = (lambda t: t.contiguous()) if stored_as_is(suffix) else cast
                parts = {f"{prefix}.in_proj_qkv.{suffix}": keep(qkv), f"{prefix}.in_proj_z.{suffix}": keep(z)}
            else:
                b, a = split_ba(read(ba[arg]), config)
                parts = {f"{arg}.in_proj_b.weight": cast(b), f"{arg}.in_proj_a.weight": cast(a)}
            return {n: t for n, t in parts.items() if n in wanted}

        split: dict[str, torch.Tensor] = {}     # the parts of a grouped tensor not handed out yet

        try:
            for name in wanted:
                kind, arg = provided[name]
                if kind == "direct":
                    yield checked(name, read(arg).contiguous() if stored_as_is(name) else cast(read(arg)))
                elif kind == "experts_gate_up":
                    projs = experts[arg]
                    yield checked(name, torch.stack(
                        [cast(torch.cat([read(projs["gate_proj"][e]), read(projs["up_proj"][e])], dim=0))
                         for e in range(len(projs["gate_proj"]))]))
                elif kind == "experts_down":
                    projs = experts[arg]
                    yield checked(name, torch.stack([cast(read(projs["down_proj"][e]))
                                                     for e in range(len(projs["down_proj"]))]))
                else:                 # a part of a grouped tensor: one read splits it into all its parts
                    if name not in split:
                        split.update(grouped_parts(kind, arg))
                    yield checked(name, split.pop(name))
        finally:
            handles.clear()

    return WeightStream(list(wanted), read_all)


def _check_finite(t: torch.Tensor, what: str, dtype: torch.dtype) -> None:
    """NaN or Inf weights would give NaN logits and token 0 forever; one pass over the loaded
    tensors (in slices, so no bool copy of a whole embedding) is cheap next to reading them."""
    flat = t.reshape(-1)
    bad = sum(int((~torch.isfinite(part)).sum()) for part in flat.split(1 << 24))
    if bad:
        raise CheckpointError(f"tensor {what} holds {bad} NaN or Inf value(s) of {flat.numel()} once "
                              f"loaded as {str(dtype).removeprefix('torch.')}")


# ---- conversions ---------------------------------------------------------------------------------

def _check_experts(prefix: str, projs: dict[str, dict[int, _Source]], name: str, want: tuple, kind: str):
    if len(want) != 3:
        raise CheckpointError(f"tensor {name} is expected with shape {_fmt(want)}, but experts are 3-D [E, out, in]")
    n_exp = want[0]
    names = ("gate_proj", "up_proj") if kind == "experts_gate_up" else ("down_proj",)
    miss = [f"{prefix}.{e}.{proj}.weight" for proj in names for e in range(n_exp) if e not in projs.get(proj, {})]
    if miss:
        raise CheckpointError(f"checkpoint is missing {len(miss)} tensor(s): {_listing(miss)}")
    extra = [src.key for proj in names for e, src in projs.get(proj, {}).items() if e >= n_exp]
    if extra:
        raise CheckpointError(
            f"checkpoint has {len(extra)} unexpected tensor(s): {_listing(extra)} (the model has {n_exp} experts)"
        )
    if kind == "experts_gate_up" and want[1] % 2:
        raise CheckpointError(f"tensor {name} is expected with an odd row count {want[1]}")
    rows = want[1] // 2 if kind == "experts_gate_up" else want[1]
    for proj in names:
        for e in range(n_exp):
            src = projs[proj][e]
            _check_shape(src.key, src.shape, (rows, want[2]), src.file)


def _gdn_dims(config: ModelConfig) -> tuple[int, int, int, int, int]:
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    return hk, hv, config.linear_key_head_dim, config.linear_value_head_dim, hv // hk


def _hidden_from(wanted_shapes: Iterable[tuple | None], src: _Source) -> int:
    for w in wanted_shapes:
        if w is not None and len(w) == 2:
            return w[1]
    return src.shape[-1] if src.shape else 0


def _check_qkvz(config: ModelConfig, src: _Source, wanted: Mapping[str, tuple], arg: tuple[str, str]):
    """Check the grouped source against the shapes the caller wants for in_proj_qkv / in_proj_z
    (a quantized checkpoint's packed values and scales have rows as the weight; its weight_shape
    is [2]: read and split as its values)."""
    prefix, suffix = arg
    hk, hv, dk, dv, r = _gdn_dims(config)
    qkv_w = wanted.get(f"{prefix}.in_proj_qkv.{suffix}")
    z_w = wanted.get(f"{prefix}.in_proj_z.{suffix}")
    if suffix == "weight_shape":
        _check_shape(src.key, src.shape, (2,), src.file)
        return
    if suffix == "weight_zero_point":
        bits = _packed_row_bits(src.shape[0], 2 * hk * dk + 2 * hv * dv)
        groups = src.shape[1] if len(src.shape) == 2 else -1
        _check_shape(src.key, src.shape, (-(-(2 * hk * dk + 2 * hv * dv) * bits // 32), groups), src.file)
        for what, want, rows in (("in_proj_qkv", qkv_w, 2 * hk * dk + hv * dv), ("in_proj_z", z_w, hv * dv)):
            if want is not None:
                _check_shape(f"{prefix}.{what}.{suffix} (from {src.key})", want, (-(-rows * bits // 32), groups))
        return
    hidden = _hidden_from((qkv_w, z_w), src)
    _check_shape(src.key, src.shape, (2 * hk * dk + 2 * hv * dv, hidden), src.file)
    if qkv_w is not None:
        _check_shape(f"{prefix}.in_proj_qkv.{suffix} (from {src.key})", qkv_w, (2 * hk * dk + hv * dv, hidden))
    if z_w is not None:
        _check_shape(f"{prefix}.in_proj_z.{suffix} (from {src.key})", z_w, (hv * dv, hidden))


def _check_ba(config: ModelConfig, src: _Source, wanted: Mapping[str, tuple], prefix: str):
    """Check the grouped source against the shapes the caller wants for in_proj_b / in_proj_a."""
    hk, hv, dk, dv, r = _gdn_dims(config)
    b_w = wanted.get(f"{prefix}.in_proj_b.weight")
    a_w = wanted.get(f"{prefix}.in_proj_a.weight")
    hidden = _hidden_from((b_w, a_w), src)
    _check_shape(src.key, src.shape, (2 * hv, hidden), src.file)
    for what, w in (("in_proj_b", b_w), ("in_proj_a", a_w)):
        if w is not None:
            _check_shape(f"{prefix}.{what}.weight (from {src.key})", w, (hv, hidden))


def split_qkvz(w: torch.Tensor, config: ModelConfig, rows_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_qkvz [Hk*(2dk + 2r*dv), H], grouped per key head as
    [q_g | k_g | v_g (r heads) | z_g (r heads)] -> (in_proj_qkv [all q | all k | all v], in_proj_z).
    rows_only: w is a quantized checkpoint's weight_shape [rows, H]: -> the parts' shapes."""
    hk, hv, dk, dv, r = _gdn_dims(config)
    if rows_only:
        cols = int(w.reshape(-1)[1])
        return (torch.tensor([2 * hk * dk + hv * dv, cols], dtype=w.dtype), torch.tensor([hv * dv, cols], dtype=w.dtype))
    g = w.view(hk, 2 * dk + 2 * r * dv, w.shape[-1])
    q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
    qkv = torch.cat([q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hv * dv, -1)], dim=0)
    return qkv, z.reshape(hv * dv, -1).clone()


def _packed_row_bits(packed_rows: int, rows: int) -> int:
    """The field width (4 or 8 bits) at which `rows` pack into `packed_rows` int32 words (4 where
    neither does: the shape check then names the tensor)."""
    return next((bits for bits in (4, 8) if packed_rows == -(-rows * bits // 32)), 4)


def split_packed_qkvz(packed: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A compressed-tensors in_proj_qkvz.weight_zero_point (int32 fields packed along the rows)
    -> the parts' own, each packed the same way."""
    hk, hv, dk, dv, r = _gdn_dims(config)
    rows = 2 * hk * dk + 2 * hv * dv
    bits = _packed_row_bits(packed.shape[0], rows)
    qkv, z = split_qkvz(unpack_fields(packed, bits, dim=0)[:rows], config)
    return pack_fields(qkv, bits, dim=0), pack_fields(z, bits, dim=0)


def split_ba(w: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next in_proj_ba [2Hv, H], grouped per key head as [b_g (r) | a_g (r)] -> (in_proj_b, in_proj_a)."""
    hk, hv, dk, dv, r = _gdn_dims(config)
    g = w.view(hk, 2 * r, w.shape[-1])
    b, a = torch.split(g, [r, r], dim=1)
    return b.reshape(hv, -1).clone(), a.reshape(hv, -1).clone()
