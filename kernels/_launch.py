"""Cached kernel launches with little Python per call.

Triton's ``kernel[grid](...)`` binds and specializes every argument, builds a cache key and checks globals on each
call: with ~30 arguments that is tens of microseconds of host time per launch, more than a whole decode-attention
call takes on the GPU at small batch. ``Launcher`` goes through that path once per specialization (which compiles
and launches), keeps the ``CompiledKernel`` and afterwards calls its C launcher directly.

The cache key reproduces Triton's specialization (argument dtypes, 16-byte alignment of pointers, integers equal
to 1 / divisible by 16 / 32-bit) plus a caller-supplied key of the constexpr values, so a cached binary is only
reused where Triton itself would reuse it. Anything unexpected (another Triton version's internals, the
interpreter) falls back to the ordinary launch for good. ``MMKV_FAST_LAUNCH=0`` disables the shortcut. The key also
holds the current CUDA device (kernels are loaded per GPU); callers make the tensors' GPU current (``on_device``).
"""

from __future__ import annotations

import contextlib

import torch

from .switches import interpreted, switch


def _spec(a):
    t = type(a)
    if t is int:
        return (a == 1, not (a & 15), -2147483648 <= a <= 2147483647)
    if t is float:
        return "f"
    if isinstance(a, torch.Tensor):
        return (a.dtype, not (a.data_ptr() & 15))
    if t is bool:
        return ("b", a)
    if a is None:
        return None
    return (t.__name__, a)


try:  # the raw handle of the current stream without building a torch.cuda.Stream object (~1 us instead of ~4)
    _raw_stream = torch._C._cuda_getCurrentRawStream
    _cur_device = torch._C._cuda_getDevice

    def _stream() -> int:
        return _raw_stream(_cur_device())
except AttributeError:  # pragma: no cover
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def _cur_device() -> int:
        return torch.cuda.current_device()


def on_device(t: torch.Tensor):
    """Context that makes ``t``'s GPU the current one. Triton compiles for, and launches on, the *current* CUDA
    device, so a kernel over tensors of another GPU (a layer of a sharded model, docs/MULTIGPU.md) must switch
    first; when ``t`` is already on the current device (the single-GPU case) this costs one integer compare."""
    if t.is_cuda and t.device.index is not None and t.device.index != _cur_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


class Launcher:
    """``Launcher(kernel)(grid, args, consts, ckey, num_warps=..)``: ``args`` are the runtime parameters in order
    (they must come first in the kernel signature), ``consts`` the constexpr ones by name, ``ckey`` a hashable
    summary of ``consts`` (cheap to hash; equal ``ckey`` must mean equal ``consts``)."""

    def __init__(self, fn):
        self.fn = fn
        self.cache: dict = {}
        self.ok = switch("MMKV_FAST_LAUNCH") != "0"

    def __call__(self, grid, args, consts, ckey, cluster: int = 0, **opts):
        if cluster:
            return self._cluster(grid, args, consts, ckey, cluster, opts)
        if not self.ok or interpreted():
            return self.fn[grid](*args, **consts, **opts)
        # the device is part of the key: a CompiledKernel's function handle belongs to one GPU's context
        key = (ckey, tuple(opts.items()), _cur_device(), tuple(map(_spec, args)))
        hit = self.cache.get(key)
        if hit is None:
            if len(self.cache) > 4096:  # shapes that change on every call: do not grow without bound
                self.cache.clear()
            kernel = self.fn[grid](*args, **consts, **opts)
            try:
                params = self.fn.params
                n = len(args)
                if any(p.is_constexpr for p in params[:n]) or not all(p.is_constexpr for p in params[n:]):
                    raise TypeError("runtime parameters must precede constexpr ones")
                tail = tuple(consts[p.name] for p in params[n:])
                kernel.run, kernel.function, kernel.packed_metadata  # noqa: B018 - the attributes we rely on
                self.cache[key] = (kernel, tail)
            except Exception:
                self.ok = False
            return kernel
        kernel, tail = hit
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = _stream()
        try:
            kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *tail)
        except Exception:
            self.ok = False
            return self.fn[grid](*args, **consts, **opts)
        return kernel

    def _cluster(self, grid, args, consts, ckey, cluster, opts):
        """Launch as thread block clusters of ``cluster`` CTAs along grid x (``grid[0]`` a multiple of it; sm_90).
        The kernel is compiled as an ordinary one-CTA kernel (so its program ids and stores stay per CTA, which
        Triton's own multi-CTA mode would not give) and launched through Triton's C launcher with ``num_ctas`` set,
        which adds the cluster dimension. There is no slow path: the caller only asks where this one works."""
        if grid[0] % cluster:
            raise ValueError(f"grid x {grid[0]} is not a multiple of the cluster size {cluster}")
        key = (ckey, "cluster", cluster, tuple(opts.items()), _cur_device(), tuple(map(_spec, args)))
        hit = self.cache.get(key)
        if hit is None:
            if len(self.cache) > 4096:
                self.cache.clear()
            kernel = self.fn.warmup(*args, **consts, **opts, grid=grid)  # compiles, does not launch
            kernel.run  # noqa: B018 - loads the binary (sets kernel.function, n_regs)
            n = len(args)
            tail = tuple(consts[p.name] for p in self.fn.params[n:])
            meta = kernel.packed_metadata
            hit = self.cache[key] = (kernel, tail, (meta[0], cluster, *meta[2:]))
        kernel, tail, meta = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0] // cluster, g1, g2, _stream(), kernel.function, meta, None, None, None, *args, *tail)
        return kernel
