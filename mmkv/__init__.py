"""mmkv: run LLMs and VLMs with a KV cache quantized per token kind, read directly by fused kernels.

    import mmkv
    lm = mmkv.load_model("smollm2-135m")
    out = mmkv.Engine(lm).generate("Hello", spec="visual=calibquant:bits=1 text=kivi:bits=2")
"""

from . import attention, methods
from .cache import MMKVCache
from .engine import Engine, GenerationOutput, Stream
from .models import LoadedModel, available_models, load_model
from .spec import CacheSpec

__version__ = "0.1.0"

__all__ = ["CacheSpec", "Engine", "GenerationOutput", "LoadedModel", "MMKVCache", "Stream", "attention",
           "available_models", "load_model", "methods", "__version__"]
