"""How big the cache is: its layout for a model (`cache_spec_for`), one sequence's share of the
byte budget, and the cache an engine's config asks for (`build_cache`: from cache_memory_bytes,
or sized for max_num_seqs sequences, max_num_seqs derived from the budget when not given)."""

from __future__ import annotations

import warnings

import torch

from hybrid_engine.models import HybridForCausalLM, ModelConfig
from hybrid_engine.models.parallel import SINGLE, TensorParallel
from hybrid_engine.state_cache import CacheSpec, CheckpointPool, HybridCacheManager

from .config import EngineConfig

# Each sequence's share of the cache: KV for this many tokens (or max_model_len, if fewer). It
# sizes the budget when cache_memory_bytes is not given, and max_num_seqs when only it is.
DEFAULT_KV_TOKENS_PER_SEQ = 4096
# max_num_seqs when neither it nor cache_memory_bytes is given, and the most a budget derives.
DEFAULT_MAX_NUM_SEQS = 64
MAX_DERIVED_NUM_SEQS = 256


def cache_spec_for(cfg: ModelConfig, model: HybridForCausalLM, block_size: int,
                   checkpoint_hidden: bool = False, tp: TensorParallel = SINGLE) -> CacheSpec:
    """checkpoint_hidden: prefix checkpoints keep a hidden state, for the MTP layer. tp: a
    tensor-parallel rank's cache holds its own heads only (the byte budget is per rank)."""
    dtype = model.embed_tokens.weight.dtype
    hk, hv = tp.heads(cfg.linear_num_key_heads), tp.heads(cfg.linear_num_value_heads)
    return CacheSpec(
        num_attention_layers=model.num_kv_layers, num_kv_heads=tp.heads(cfg.num_key_value_heads),
        head_dim=cfg.head_dim, block_size=block_size, kv_dtype=dtype,
        num_gdn_layers=len(cfg.linear_attention_layers),
        conv_dim=2 * hk * cfg.linear_key_head_dim + hv * cfg.linear_value_head_dim,
        conv_kernel=cfg.linear_conv_kernel_dim, num_v_heads=hv,
        key_head_dim=cfg.linear_key_head_dim, value_head_dim=cfg.linear_value_head_dim,
        conv_dtype=dtype, state_dtype=torch.float32,
        hidden_size=cfg.hidden_size if checkpoint_hidden else 0,
    )


def seq_share_bytes(spec: CacheSpec, k: int, tokens_per_seq: int, checkpoints_per_seq: int, prefix_on: bool) -> int:
    """One sequence's share of the cache: its 1 + k state slots, KV for tokens_per_seq tokens,
    and with prefix caching its checkpoints_per_seq checkpoints."""
    checkpoints = checkpoints_per_seq * CheckpointPool.bytes_per_checkpoint(spec) if prefix_on else 0
    return (1 + k) * spec.bytes_per_slot + spec.blocks_for(tokens_per_seq) * spec.bytes_per_block + checkpoints


def derive_max_num_seqs(cache_memory_bytes: int | None, max_num_batched_tokens: int, k: int, per_seq: int,
                        shared: int) -> int:
    """max_num_seqs when not given: as many sequences' shares (seq_share_bytes) as the budget
    holds beside `shared`, or DEFAULT_MAX_NUM_SEQS without a budget; at least 1, at most
    MAX_DERIVED_NUM_SEQS, and no more than a step of max_num_batched_tokens can decode (or verify)."""
    n = DEFAULT_MAX_NUM_SEQS if cache_memory_bytes is None else (cache_memory_bytes - shared) // per_seq
    return max(1, min(n, MAX_DERIVED_NUM_SEQS, max_num_batched_tokens // (1 + k)))


def checkpoint_shortfall(cache: HybridCacheManager, budget: int, max_num_seqs: int, wanted: int) -> str:
    """The warning for a budget that keeps fewer prefix checkpoints than asked, and what it costs."""
    kept, spec = cache.prefix_store.checkpoints.size, cache.spec
    # What keeps them all beside today's KV blocks, at least one block per checkpoint.
    more = ((wanted - kept) * CheckpointPool.bytes_per_checkpoint(spec)
            + max(wanted - cache.num_blocks, 0) * spec.bytes_per_block)
    cost = ("no prompt prefix can be resumed from the cache: repeated prompts are computed again" if kept == 0
            else "fewer cached prefixes can be resumed (the least recently used are evicted sooner)")
    return (f"prefix caching keeps {kept} of {wanted} GDN checkpoints: cache_memory_bytes={budget} holds no more "
            f"beside the state slots of max_num_seqs={max_num_seqs} and {cache.num_blocks} KV blocks (a checkpoint "
            f"is of use beside a KV block of its own); {cost}. Keeping all {wanted} takes {more} bytes more "
            f"({more // spec.bytes_per_block} KV blocks' worth), or a lower max_num_seqs")


def build_cache(config: EngineConfig, spec: CacheSpec, k: int, tokens_per_seq: int) -> HybridCacheManager:
    """The cache, from cache_memory_bytes or sized for max_num_seqs sequences of tokens_per_seq
    tokens, and max_num_seqs derived from the budget when not given (set in config)."""
    prefix_on = config.enable_prefix_caching
    # One sequence's share (its slots, KV for tokens_per_seq tokens, 2 prefix checkpoints
    # unless their number is given) and what no sequence owns (the pad slot, given checkpoints).
    per_seq = seq_share_bytes(spec, k, tokens_per_seq, 2 if config.prefix_checkpoints is None else 0, prefix_on)
    shared = spec.bytes_per_slot
    if prefix_on and config.prefix_checkpoints is not None:
        shared += config.prefix_checkpoints * CheckpointPool.bytes_per_checkpoint(spec)
    if config.max_num_seqs is None:
        config.max_num_seqs = derive_max_num_seqs(config.cache_memory_bytes, config.max_num_batched_tokens, k,
                                                  per_seq, shared)
        config.validate()                   # cuda_graph_batch_sizes against the derived number
    if config.max_num_batched_tokens < config.max_num_seqs * (1 + k):
        raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
                         f"max_num_seqs * (1 + num_speculative_tokens) = {config.max_num_seqs * (1 + k)}")
    num_checkpoints = (config.prefix_checkpoints or 2 * config.max_num_seqs) if prefix_on else 0
    budget = config.cache_memory_bytes
    if budget is None:
        budget = config.max_num_seqs * per_seq + shared
    # Draft slots are part of the budget: each request holds 1 + k state slots. With MTP the
    # MTP layer rewrites its KV at a prefix hit's last position: that block is copied, not shared.
    cache = HybridCacheManager.from_budget(spec, budget, config.max_num_seqs, k, device=config.device,
                                           num_checkpoints=num_checkpoints, copy_last_hit_block=k > 0)
    if cache.prefix_store.checkpoints.size < num_checkpoints:
        warnings.warn(checkpoint_shortfall(cache, budget, config.max_num_seqs, num_checkpoints), stacklevel=3)
    return cache
