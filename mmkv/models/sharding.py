"""Shard one model over several GPUs with accelerate: plan a device map, place the weights, dispatch.

    lm = mmkv.load_model("random:internvl2.5-26b", device_map="auto")             # every visible GPU
    lm = mmkv.load_model("random:internvl2.5-26b", device_map="layers", max_memory={0: "60GiB", 1: "60GiB"})

Device maps (``device_map=``):

* ``"auto"`` / ``"balanced"``: accelerate's plan (``get_balanced_memory`` + ``infer_auto_device_map``), the same as
  ``from_pretrained(device_map="auto")``: the *weights* are spread evenly, whole blocks (``_no_split_modules``) at a
  time. A VLM's vision tower sits with the first decoder layers, so the first GPU gets fewer decoder layers, and
  with them a smaller share of the KV cache.
* ``"sequential"``: accelerate's plan filling the GPUs in order up to ``max_memory``.
* ``"layers"``: the language model's decoder layers split into equal contiguous runs, one per GPU; what comes
  before them (vision tower, projector, embeddings) goes to the first GPU, what follows (final norm, LM head) to
  the last. Each GPU then holds the same share of the KV cache, which is what bounds the batch at long contexts.
* a dict ``{module name: device}`` (as ``model.hf_device_map`` prints it), used as given.

``max_memory`` (``{0: "70GiB", 1: "70GiB"}``, or the CLI form ``"0=70GiB,1=70GiB"``) limits each GPU; its keys
also say which GPUs to use. Models are placed, never offloaded: a plan that puts weights on ``cpu``/``disk``
while GPUs are in use is refused for the built-in models (hub models go through ``from_pretrained``, which
offloads as accelerate does).

How each kind of model is placed:

* ``random:*``: built with parameters on the meta device (``accelerate.init_empty_weights``; buffers such as RoPE
  frequencies are real, small CPU tensors), planned, then each parameter is allocated directly on its GPU and
  initialized there by the model's own ``initialize_weights`` under a fixed seed. A 26B model never passes
  through CPU memory. Values differ from the single-device build (a different order of random draws), so the
  two are different random models of the same shapes.
* hub ids and folders: ``from_pretrained(device_map=..., max_memory=...)`` (``"layers"`` is first resolved to a
  dict on a meta copy of the model).
* ``smollm2-135m`` and ``demo-*``: loaded on the CPU as usual (they are small), then dispatched.

All paths end in ``accelerate.dispatch_model``: hooks move each block's inputs to its device; the cache
(``cache``, ``past_key_values`` before transformers 5.24) is never moved (``skip_keys``), so every layer's KV
segments stay where that layer runs (``mmkv/cache/placement.py``).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

DEVICE_MAPS = ("auto", "balanced", "sequential", "layers")
OFFLOAD = ("cpu", "disk")
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)


# --- arguments -----------------------------------------------------------------------------------------------------
def parse_max_memory(value) -> dict | None:
    """``{0: "70GiB", "cpu": "100GiB"}`` or ``"0=70GiB,1=70GiB"`` -> ``{0: "70GiB", ...}`` (GPU keys as ints)."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        out = {}
        for part in value.split(","):
            key, sep, size = part.partition("=")
            if not sep or not key.strip() or not size.strip():
                raise ValueError(f"max_memory {value!r}: write DEVICE=SIZE pairs, e.g. '0=70GiB,1=70GiB'")
            out[key.strip()] = size.strip()
        value = out
    if not isinstance(value, dict):
        raise ValueError(f"max_memory must be a dict or 'DEVICE=SIZE,...', got {type(value).__name__}")
    out = {}
    for key, size in value.items():
        out[_device_key(key)] = _check_size(size)
    return out


def _device_key(key):
    if isinstance(key, torch.device):
        key = str(key)
    if isinstance(key, int):
        return key
    k = str(key).strip().lower()
    if k.isdigit():
        return int(k)
    if k.startswith("cuda:") and k[5:].isdigit():
        return int(k[5:])
    if k in OFFLOAD:
        return k
    raise ValueError(f"max_memory key {key!r}: use a GPU index (0, 1, ...), 'cuda:N', 'cpu' or 'disk'")


def _check_size(size):
    if isinstance(size, int) and size > 0:
        return size
    if isinstance(size, str) and _SIZE.match(size):
        return size.strip()
    raise ValueError(f"max_memory size {size!r}: use bytes (int) or a string such as '70GiB' / '500MB'")


def normalize_map(device_map: dict) -> dict[str, str]:
    """Device-map values as strings torch understands: ints -> ``cuda:N``; ``cpu``/``disk``/``meta`` kept."""
    if not isinstance(device_map, dict) or not device_map:
        raise ValueError(f"device_map must be one of {DEVICE_MAPS} or a non-empty dict, got {device_map!r}")
    out = {}
    for name, dev in device_map.items():
        if isinstance(dev, int):
            dev = f"cuda:{dev}"
        elif isinstance(dev, torch.device):
            dev = str(dev)
        elif isinstance(dev, str) and dev.isdigit():
            dev = f"cuda:{dev}"
        if not isinstance(dev, str):
            raise ValueError(f"device_map[{name!r}] = {dev!r} is not a device")
        out[name] = dev
    return out


def check_device_map(device_map) -> None:
    if isinstance(device_map, str) and device_map not in DEVICE_MAPS:
        raise ValueError(f"device_map={device_map!r}; use one of {DEVICE_MAPS} or a dict {{module: device}}")
    if not isinstance(device_map, (str, dict)):
        raise ValueError(f"device_map must be one of {DEVICE_MAPS} or a dict, got {type(device_map).__name__}")


# --- where things are ------------------------------------------------------------------------------------------------
def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Name and ``ModuleList`` of the language model's decoder layers (the one the KV cache is indexed by)."""
    lm = model.get_decoder() if hasattr(model, "get_decoder") else model
    for holder in (lm, getattr(lm, "language_model", None), getattr(lm, "model", None)):
        layers = getattr(holder, "layers", None) if holder is not None else None
        if isinstance(layers, nn.ModuleList):
            for name, mod in model.named_modules():
                if mod is layers:
                    return name, layers
    raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected a .layers ModuleList)")


def _first_device(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def layer_devices(model: nn.Module) -> list[torch.device]:
    """Device of each decoder layer, in order: where that layer's KV cache segments live."""
    return [_first_device(layer) for layer in decoder_layers(model)[1]]


def model_devices(model: nn.Module) -> list[torch.device]:
    """Every device holding weights of ``model`` (sorted: cpu first, then cuda:0, cuda:1, ...)."""
    devs = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    devs.discard(torch.device("meta"))
    return sorted(devs, key=lambda d: (d.type != "cpu", d.type, d.index if d.index is not None else -1))


def input_device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


# --- planning --------------------------------------------------------------------------------------------------------
def _gpus(max_memory: dict | None) -> list:
    if max_memory:
        gpus = sorted(k for k in max_memory if isinstance(k, int))
        if gpus:
            return gpus
    if torch.cuda.is_available():
        return list(range(torch.cuda.device_count()))
    raise ValueError("no GPU to shard over: CUDA is unavailable and max_memory names no GPU index "
                     "(a CPU test may name fake GPUs, e.g. max_memory={0: '1GiB', 1: '1GiB'}, to plan only)")


def layers_map(model: nn.Module, devices: list) -> dict:
    """The ``"layers"`` plan: equal contiguous runs of decoder layers per device, modules registered before the
    layers on the first device, modules after them on the last (a tied LM head stays with the embeddings)."""
    if not devices:
        raise ValueError("layers_map needs at least one device")
    name, layers = decoder_layers(model)
    n, k = len(layers), len(devices)
    plan: dict = {}
    # walk from the root down to the layers list: siblings before the path -> first device, after -> last
    parts = name.split(".")
    for depth in range(len(parts)):
        parent_name = ".".join(parts[:depth])
        parent = model.get_submodule(parent_name) if parent_name else model
        on_path = parts[depth]
        seen = False
        for child, _ in parent.named_children():
            full = f"{parent_name}.{child}" if parent_name else child
            if child == on_path:
                seen = True
                continue
            plan[full] = devices[0] if not seen else devices[-1]
        for pname, _ in parent.named_parameters(recurse=False):  # loose tensors of an ancestor: first device
            plan[f"{parent_name}.{pname}" if parent_name else pname] = devices[0]
        for bname, _ in parent.named_buffers(recurse=False):
            plan[f"{parent_name}.{bname}" if parent_name else bname] = devices[0]
    for i in range(n):
        plan[f"{name}.{i}"] = devices[min(i * k // n, k - 1)]
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        head = target.rpartition(".")[0]  # e.g. lm_head.weight -> model.embed_tokens.weight: one tensor, one device
        if head in plan:
            plan[head] = _owner_device(plan, source.rpartition(".")[0])
    order = {n_: i for i, (n_, _) in enumerate(model.named_modules())}
    return dict(sorted(plan.items(), key=lambda kv: order.get(kv[0], len(order))))


def _owner_device(plan: dict, module_name: str):
    best = None
    for key, dev in plan.items():
        if key == "" or module_name == key or module_name.startswith(key + "."):
            if best is None or len(key) > len(best[0]):
                best = (key, dev)
    if best is None:
        raise ValueError(f"{module_name} is not covered by the device map")
    return best[1]


def plan_device_map(model: nn.Module, device_map, max_memory=None, dtype: torch.dtype | None = None) -> dict:
    """A ``{module: device}`` dict for ``model`` (its parameters may be on the meta device).

    Device values are as accelerate returns them (GPU indices as ints); :func:`normalize_map` turns them into
    ``cuda:N`` strings. Planning allocates nothing, so CPU tests can plan for GPUs that are not there.
    """
    check_device_map(device_map)
    max_memory = parse_max_memory(max_memory)
    if isinstance(device_map, dict):
        return dict(device_map)
    if device_map == "layers":
        return layers_map(model, _gpus(max_memory))
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = sorted(getattr(model, "_no_split_modules", None) or [])
    if max_memory is None:
        max_memory = {i: torch.cuda.mem_get_info(i)[0] for i in _gpus(None)}
    if device_map in ("auto", "balanced") and len([k for k in max_memory if isinstance(k, int)]) > 1:
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                         dtype=dtype)
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)


def check_placed(device_map: dict, allow_offload: bool) -> None:
    where = set(device_map.values())
    if not allow_offload and where & set(OFFLOAD) and where - set(OFFLOAD):
        off = sorted(k for k, v in device_map.items() if v in OFFLOAD)
        raise ValueError(f"the model does not fit the GPUs given max_memory: {len(off)} blocks would be offloaded "
                         f"to cpu/disk (e.g. {off[0]}); raise max_memory or use more GPUs")
    if not any(v != "disk" for v in where):
        raise ValueError("device map places nothing on a device")


# --- placing weights -------------------------------------------------------------------------------------------------
def _tensors_under(model: nn.Module, prefix: str):
    """(owning module, attribute name, tensor, is_param) of every parameter/buffer under ``prefix``
    (a module or a single tensor name)."""
    try:
        mod = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        mod = None
    if mod is not None:
        for sub in mod.modules():
            for n, p in sub._parameters.items():
                if p is not None:
                    yield sub, n, p, True
            for n, b in sub._buffers.items():
                if b is not None:
                    yield sub, n, b, False
        return
    owner_name, _, attr = prefix.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if attr in owner._parameters:
        yield owner, attr, owner._parameters[attr], True
    elif attr in owner._buffers:
        yield owner, attr, owner._buffers[attr], False
    else:
        raise ValueError(f"device map entry {prefix!r} names no module, parameter or buffer of the model")


def materialize(model: nn.Module, device_map: dict, seed: int) -> None:
    """Allocate every meta parameter on its device from ``device_map`` (buffers are copied there), then run the
    model's own weight initialization under ``seed``. Tied parameters stay one tensor (memoized by identity)."""
    device_map = normalize_map(device_map)
    done: dict[int, torch.Tensor] = {}
    for prefix, dev in sorted(device_map.items(), key=lambda kv: kv[0].count(".")):
        if dev == "disk":
            raise ValueError("random models are not offloaded to disk")
        for owner, attr, t, is_param in list(_tensors_under(model, prefix)):
            new = done.get(id(t))
            if new is None:
                if is_param:
                    data = torch.empty(t.shape, dtype=t.dtype, device=dev)
                    new = nn.Parameter(data, requires_grad=False)
                else:
                    new = t.to(dev)
                done[id(t)] = new
            (owner._parameters if is_param else owner._buffers)[attr] = new
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"device map leaves parameters unplaced, e.g. {left[:3]}")
    for t in (*model.parameters(), *model.buffers()):
        if hasattr(t, "_is_hf_initialized"):
            del t._is_hf_initialized
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    devices = sorted({torch.device(d) for d in device_map.values() if d.startswith("cuda")}, key=str)
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
        model.initialize_weights()


def dispatch(model: nn.Module, device_map: dict) -> nn.Module:
    """accelerate's hooks over a placed model: inputs follow the blocks, the cache object is never moved."""
    from accelerate import dispatch_model

    from ..cache.kwarg import NAMES as CACHE_NAMES  # here: mmkv.cache imports mmkv.models

    device_map = normalize_map(device_map)
    main = _owner_device(device_map, next(n for n, m in model.named_modules() if m is model.get_input_embeddings()))
    own = getattr(model, "_skip_keys_device_placement", None) or ()
    skip = sorted({*own, *CACHE_NAMES})  # the cache, under either name
    # force_hooks: the hooks also run when the whole map is one device (CPU tests walk the same path as 2 GPUs)
    quiet = logging.getLogger("accelerate.big_modeling")
    level = quiet.level
    if set(device_map.values()) == {"cpu"}:  # its "offloaded to the cpu" warning is wrong here: nothing is offloaded
        quiet.setLevel(logging.ERROR)
    try:
        dispatch_model(model, device_map, main_device=main, skip_keys=skip, force_hooks=True)
    finally:
        quiet.setLevel(level)
    model.hf_device_map = dict(device_map)
    return model


def build_random_sharded(cls, config, dtype: torch.dtype, device_map, max_memory, seed: int) -> nn.Module:
    """A ``random:*`` model built on the meta device, planned, allocated per device, initialized, dispatched."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=dtype)
    model.tie_weights()  # meta construction leaves tied weights (a tied LM head) as two tensors
    plan = normalize_map(plan_device_map(model, device_map, max_memory, dtype))
    check_placed(plan, allow_offload=not torch.cuda.is_available())
    materialize(model, plan, seed)
    return dispatch(model.eval(), plan)


def dispatch_loaded(model: nn.Module, device_map, max_memory, dtype: torch.dtype) -> nn.Module:
    """A model already in memory (CPU) spread over devices by a plan (small built-ins: smollm2, demo-*)."""
    plan = normalize_map(plan_device_map(model, device_map, max_memory, dtype))
    check_placed(plan, allow_offload=not torch.cuda.is_available())
    return dispatch(model.to(dtype).eval(), plan)


def hub_device_map(name: str, device_map, max_memory, dtype, cls, config):
    """What ``from_pretrained`` gets: accelerate's named maps pass through; ``"layers"`` becomes a dict."""
    check_device_map(device_map)
    if device_map != "layers":
        return device_map if isinstance(device_map, str) else normalize_map(device_map)
    from accelerate import init_empty_weights

    build = cls.from_config if hasattr(cls, "from_config") else cls._from_config  # Auto* classes / model classes
    with init_empty_weights(include_buffers=False):
        meta = build(config, dtype=dtype)
    meta.tie_weights()
    return normalize_map(layers_map(meta, _gpus(parse_max_memory(max_memory))))
