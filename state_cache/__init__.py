"""All cache memory: paged KV blocks, GDN state slots, and the manager that owns both."""

from .kv_slots import kv_slots
from .checkpoints import Checkpoint, CheckpointPool
from .errors import CacheCapacityError
from .hybrid_cache import HybridCacheManager, PrefixHit, RequestCache
from .prefix_blocks import PrefixBlockPool, chain_hashes
from .slot_allocator import SlotAllocator
from .spec import CacheSpec

__all__ = [
    "CacheCapacityError",
    "CacheSpec",
    "Checkpoint",
    "CheckpointPool",
    "HybridCacheManager",
    "PrefixBlockPool",
    "PrefixHit",
    "RequestCache",
    "SlotAllocator",
    "chain_hashes",
    "kv_slots",
]
