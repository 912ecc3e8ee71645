"""All cache memory: paged KV blocks, GDN state slots, and the manager that owns both."""

from .kv_slots import kv_slots
from .checkpoints import Checkpoint, CheckpointPool
from .errors import CacheCapacityError
from .hybrid_cache import HybridCacheManager, RequestCache
from .pools import CachePools
from .prefix_blocks import PrefixBlockPool, chain_hashes
from .prefix_store import PrefixHit, PrefixStore
from .spec import CacheSpec

__all__ = [
    "CacheCapacityError",
    "CachePools",
    "CacheSpec",
    "Checkpoint",
    "CheckpointPool",
    "HybridCacheManager",
    "PrefixBlockPool",
    "PrefixHit",
    "PrefixStore",
    "RequestCache",
    "chain_hashes",
    "kv_slots",
]
