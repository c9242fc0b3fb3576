"""One decoded token's K and V written into a dense segment at each row's length, and the lengths advanced, in one
launch (spec: ``reference.append_token``).

The decode append of ``mmkv/cache/layer.py`` on a GPU must read each row's position from the device (a captured
step replays it), so in torch it is a tensor of rows, the lengths cast to int64, two ``index_put`` and an add to the
lengths: five kernels a layer. In the decode step of random:internvl2.5-8b on an H200 the two ``index_put`` alone
took 3.6-3.9 us each, 64 a step (docs/BENCHMARKS.md, "Whole waves chosen inside the step": 0.23-0.25 ms of a
6.2-22.6 ms step). One
program per row loads its length, stores every head's K and V at that slot and writes the length back; it is the
only program that touches its row's length, and a barrier orders its threads' reads of it before the write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import Launcher, on_device


@triton.jit
def _append_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, lens_ptr, H, D, T,
                   sk_b, sk_h, sv_b, sv_h, skc_b, skc_h, skc_t, svc_b, svc_h, svc_t,
                   HB: tl.constexpr, DP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(lens_ptr + b)
    t = pos.to(tl.int64)
    offs_d = tl.arange(0, DP)[None, :]
    heads = tl.where(t < T, H, 0)  # a length at capacity writes nothing past the segment
    for h0 in range(0, H, HB):  # HB heads at a time: a 32-head MHA layer does not fill the registers
        offs_h = (h0 + tl.arange(0, HB)[:, None]).to(tl.int64)
        ok = (offs_h < heads) & (offs_d < D)
        kk = tl.load(k_ptr + b * sk_b + offs_h * sk_h + offs_d, mask=ok)
        vv = tl.load(v_ptr + b * sv_b + offs_h * sv_h + offs_d, mask=ok)
        tl.store(kc_ptr + b * skc_b + offs_h * skc_h + t * skc_t + offs_d, kk.to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(vc_ptr + b * svc_b + offs_h * svc_h + t * svc_t + offs_d, vv.to(vc_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()  # every thread has read the length before one writes it back
    tl.store(lens_ptr + b, pos + 1)


_APPEND = Launcher(_append_kernel)


def supports(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             lens: torch.Tensor) -> bool:
    """``k``/``v [B, H, 1, D]`` into ``k_cache``/``v_cache [B, H, T, D]`` of their dtype on one device, ``lens [B]``
    int32, the last axis of every tensor contiguous."""
    if k.dim() != 4 or k_cache.dim() != 4 or v.shape != k.shape or v_cache.shape != k_cache.shape:
        return False
    B, H, t, D = k.shape
    return (t == 1 and k_cache.shape[0] == B and k_cache.shape[1] == H and k_cache.shape[3] == D
            and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and lens.shape == (B,) and lens.dtype == torch.int32
            and len({x.device for x in (k_cache, v_cache, k, v, lens)}) == 1
            and all(x.stride(-1) == 1 for x in (k_cache, v_cache, k, v)))


def append_token(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lens: torch.Tensor, check: bool = True) -> None:
    """``reference.append_token`` in one launch: ``k[b, :, 0]`` and ``v[b, :, 0]`` go to slot ``lens[b]`` of row
    ``b``, then ``lens += 1``. The caller makes sure every ``lens[b] < T`` (the layer grows its segment first); a row
    at capacity is not written (its length still advances), where the reference's indexing raises.
    ``check=False``: the caller has checked ``supports`` (a few us of host time per call, as ``silu_mul``)."""
    if check and not supports(k_cache, v_cache, k, v, lens):
        raise ValueError(f"append_token: unsupported k {tuple(k.shape)} into {tuple(k_cache.shape)}, lens "
                         f"{tuple(lens.shape)} {lens.dtype} (one token [B, H, 1, D] into [B, H, T, D], int32 "
                         "lengths [B], one dtype and device, last axes contiguous)")
    B, H, _, D = k.shape
    if not B:
        return
    DP = triton.next_power_of_2(D)
    HB = min(triton.next_power_of_2(H), max(1, 2048 // DP))
    with on_device(k):
        _APPEND((B,), (k, v, k_cache, v_cache, lens, H, D, k_cache.shape[2],
                       k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                       k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                       v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)),
                {"HB": HB, "DP": DP}, (HB, DP), num_warps=4)
