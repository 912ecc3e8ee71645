"""Per-request cache state as named tensors: capture it, save / load it as safetensors, diff two.

A request's state is, per GDN layer, the conv window and recurrent state in its committed
slot, and per attention layer the K and V of its first `num_tokens` positions (gathered
through its block table). Tensors are keyed "{layer}/{kind}" with kind conv | recurrent | k | v;
the caller names the layers, since the cache knows them only by their index in its pools.

On disk: one safetensors file, tensors keyed "r{i}/{layer}/{kind}" (i indexes
metadata["requests"], so request ids need no escaping), and the metadata as JSON under one
key of the safetensors header.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .hybrid_cache import HybridCacheManager

METADATA_KEY = "hybrid_engine.snapshot"
FORMAT_VERSION = 1


class SnapshotError(ValueError):
    """A file that is not a readable snapshot."""


@dataclass
class Snapshot:
    # JSON-able; at least "layers" (names in model depth order) and "requests"
    # ([{"id": ..., "num_tokens": ...}, ...]). The caller adds what it likes (model, step).
    metadata: dict
    states: dict[str, dict[str, torch.Tensor]]   # request id -> "{layer}/{kind}" -> tensor


def capture_request(cache: HybridCacheManager, request_id, num_tokens: int,
                    gdn_layers: Sequence[str], attention_layers: Sequence[str]) -> dict[str, torch.Tensor]:
    """Copies of one request's committed state. `attention_layers` names the first
    len(attention_layers) KV pools (a prefix, so a caller can leave out the MTP layer)."""
    pools = cache.pools
    if len(gdn_layers) != len(pools.conv_states):
        raise ValueError(f"{len(gdn_layers)} GDN layer names for {len(pools.conv_states)} GDN pools")
    if len(attention_layers) > len(pools.kv_caches):
        raise ValueError(f"{len(attention_layers)} attention layer names for {len(pools.kv_caches)} KV pools")
    rc = cache.get(request_id)
    if not 0 <= num_tokens <= rc.num_tokens:
        raise ValueError(f"request {request_id!r} holds KV for {rc.num_tokens} tokens, not {num_tokens}")
    out: dict[str, torch.Tensor] = {}
    for name, conv, rec in zip(gdn_layers, pools.conv_states, pools.recurrent_states):
        out[f"{name}/conv"] = conv[rc.slot].detach().cpu().clone()
        out[f"{name}/recurrent"] = rec[rc.slot].detach().cpu().clone()
    bs = cache.spec.block_size
    pos = torch.arange(num_tokens)
    blocks = torch.tensor(rc.block_table, dtype=torch.int64)[pos // bs]
    for name, kv in zip(attention_layers, pools.kv_caches):
        used = kv[blocks.to(kv.device), :, (pos % bs).to(kv.device)].detach().cpu()   # [n, 2, heads, dim]
        out[f"{name}/k"] = used[:, 0].clone()
        out[f"{name}/v"] = used[:, 1].clone()
    return out


# ---- files -----------------------------------------------------------------------------------

def save_snapshot(path: str | Path, snapshot: Snapshot) -> None:
    from safetensors.torch import save_file

    ids = [r["id"] for r in snapshot.metadata["requests"]]
    if sorted(ids) != sorted(snapshot.states):
        raise ValueError(f"metadata lists requests {ids} but states hold {sorted(snapshot.states)}")
    metadata = dict(snapshot.metadata, format_version=FORMAT_VERSION)
    tensors = {f"r{i}/{key}": t.contiguous() for i, rid in enumerate(ids)
               for key, t in snapshot.states[rid].items()}
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(metadata)})


def load_snapshot(path: str | Path) -> Snapshot:
    """SnapshotError naming the file and the problem when it is not a readable snapshot."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise SnapshotError(f"snapshot file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:  # safetensors raises its own error types on a bad header
        raise SnapshotError(f"cannot read snapshot {path}: not a safetensors file ({e})") from None
    if METADATA_KEY not in header:
        raise SnapshotError(f"cannot read snapshot {path}: a safetensors file without snapshot metadata")
    try:
        metadata = json.loads(header[METADATA_KEY])
        ids = [r["id"] for r in metadata["requests"]]
        metadata["layers"]
    except (ValueError, KeyError, TypeError) as e:
        raise SnapshotError(f"cannot read snapshot {path}: bad metadata ({e!r})") from None
    states: dict[str, dict[str, torch.Tensor]] = {rid: {} for rid in ids}
    for key, t in tensors.items():
        index, _, name = key.partition("/")
        i = int(index[1:]) if index[:1] == "r" and index[1:].isdigit() else -1
        if not 0 <= i < len(ids) or not name:
            raise SnapshotError(f"cannot read snapshot {path}: unexpected tensor {key!r}")
        states[ids[i]][name] = t
    return Snapshot(metadata, states)


# ---- diff ------------------------------------------------------------------------------------

@dataclass
class TensorDiff:
    request: str
    layer: str
    kind: str
    max_abs: float            # nan when the tensors cannot be compared (missing, shapes differ)
    differs: bool
    note: str = ""            # why they could not be compared


@dataclass
class SnapshotDiff:
    entries: list[TensorDiff] = field(default_factory=list)   # layer depth order, then request
    problems: list[str] = field(default_factory=list)         # request-level mismatches

    @property
    def first(self) -> TensorDiff | None:
        return next((e for e in self.entries if e.differs), None)

    @property
    def equal(self) -> bool:
        return not self.problems and self.first is None


def diff_snapshots(a: Snapshot, b: Snapshot, atol: float = 1e-5, rtol: float = 0.0) -> SnapshotDiff:
    """Element-wise |a - b| <= atol + rtol * |b| (NaN equals NaN) for every tensor both hold."""
    out = SnapshotDiff()
    tokens_a = {r["id"]: r.get("num_tokens") for r in a.metadata["requests"]}
    tokens_b = {r["id"]: r.get("num_tokens") for r in b.metadata["requests"]}
    requests = list(tokens_a) + [rid for rid in tokens_b if rid not in tokens_a]
    for rid in requests:
        if rid not in tokens_b or rid not in tokens_a:
            out.problems.append(f"request {rid} is only in {'A' if rid in tokens_a else 'B'}")
        elif tokens_a[rid] != tokens_b[rid]:
            out.problems.append(f"request {rid} has {tokens_a[rid]} tokens in A and {tokens_b[rid]} in B")
    layers = list(a.metadata["layers"]) + [n for n in b.metadata["layers"] if n not in a.metadata["layers"]]
    depth = {name: i for i, name in enumerate(layers)}
    for rid in requests:
        sa, sb = a.states.get(rid), b.states.get(rid)
        if sa is None or sb is None:
            continue
        for key in list(sa) + [k for k in sb if k not in sa]:
            layer, _, kind = key.rpartition("/")
            out.entries.append(_compare(rid, layer, kind, sa.get(key), sb.get(key), atol, rtol))
    out.entries.sort(key=lambda e: depth.get(e.layer, len(depth)))   # stable: request order kept
    return out


def _compare(rid: str, layer: str, kind: str, x: torch.Tensor | None, y: torch.Tensor | None,
             atol: float, rtol: float) -> TensorDiff:
    if x is None or y is None:
        return TensorDiff(rid, layer, kind, math.nan, True, f"only in {'A' if y is None else 'B'}")
    if x.shape != y.shape:
        return TensorDiff(rid, layer, kind, math.nan, True, f"shape {list(x.shape)} vs {list(y.shape)}")
    x, y = x.double(), y.double()
    close = torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    delta = (x - y).abs()
    both_nan = x.isnan() & y.isnan()
    max_abs = delta.masked_fill(both_nan, 0).max().item() if delta.numel() else 0.0
    return TensorDiff(rid, layer, kind, max_abs, not bool(close.all()))
