"""The one error the cache raises when memory runs out."""


class CacheCapacityError(RuntimeError):
    """Not enough free KV blocks or GDN state slots; nothing was allocated."""
