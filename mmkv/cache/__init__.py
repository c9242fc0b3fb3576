from .cache import MODALITIES, MMKVCache
from .kwarg import cache_kwargs
from .layer import MMKVLayer

__all__ = ["MMKVCache", "MMKVLayer", "MODALITIES", "cache_kwargs"]
