from .cache import MODALITIES, MMKVCache
from .layer import MMKVLayer

__all__ = ["MMKVCache", "MMKVLayer", "MODALITIES"]
