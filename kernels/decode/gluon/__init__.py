"""Gluon (explicit-layout Triton) kernels for channel-wise segments, NVIDIA sm_80+ (``kernel.py`` describes them).

``operands`` (constexpr helpers, bit planes -> MMA operands) <- ``tile`` (one tile, the shared-memory ring) <-
``reduce`` (calibration, barriers, epilogue) <- ``kernel`` (``_channel_kernel``) <- ``launch`` (host side).
"""

from __future__ import annotations

from .launch import (
    build_layouts,
    fused_shared_bytes,
    int8_layouts,
    kernel_consts,
    launch_channel,
    programs_by_registers,
    resident_programs,
    ring_layout,
)
from .operands import HAVE_GLUON, P_EXP, default_stages, rows_per_warp

__all__ = ["HAVE_GLUON", "P_EXP", "build_layouts", "default_stages", "fused_shared_bytes", "int8_layouts",
           "kernel_consts", "launch_channel", "programs_by_registers", "resident_programs", "ring_layout",
           "rows_per_warp"]
