"""All cache memory: paged KV blocks, GDN state slots, and the manager that owns both."""

from .block_allocator import BlockAllocator, kv_slots
from .errors import CacheCapacityError
from .hybrid_cache import HybridCacheManager, RequestCache
from .slot_allocator import SlotAllocator
from .spec import CacheSpec

__all__ = [
    "BlockAllocator",
    "CacheCapacityError",
    "CacheSpec",
    "HybridCacheManager",
    "RequestCache",
    "SlotAllocator",
    "kv_slots",
]
