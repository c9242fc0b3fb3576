"""The keyword a transformers model takes its KV cache under.

transformers 5.24 renamed ``past_key_values`` to ``cache`` in its models' ``forward`` (the old name still works, with
a FutureWarning, until 5.40). This project supports ``>=5.17,<6``, and on releases before 5.24 ``cache=`` falls
silently into ``**kwargs``: the model runs without any cache. So every call passes the name the model's own
``forward`` declares.
"""
from __future__ import annotations

import functools
import inspect

NAMES = ("cache", "past_key_values")  # accelerate's hooks must never move the cache under either name


@functools.cache
def _name_for(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for ``model(**...)``, under the keyword ``type(model).forward`` declares."""
    return {_name_for(type(model)): cache}
