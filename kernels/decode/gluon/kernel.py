"""Gluon (explicit-layout Triton) kernels for channel-wise segments (CalibQuant K and V), NVIDIA sm_80+.

Two launches per segment and layer (the merge of all segments' partials is ``decode_attention``'s):

1. **range pass** (``MODE=1``), grid ``(n_cal, H, B)``: reads q, K scale/zero and the K codes of its token range;
   writes ``cal[b, h*G + g, split] = (min, max)`` of the uncalibrated logits (log2 units) of its valid tokens.
   It asks L2 to keep K (``evict_last``) for the main pass.
2. **main pass** (``MODE=0``), grid ``(splits, H, B)``: reduces the ``cal`` row of each head to gamma = min,
   delta = max, folds CalibQuant's pre-softmax map ``g(x) = r*x + (1-r)*gamma - tau1`` (Sec. 2.3) into ``q*s``
   (post-scaling, Sec. 2.2: K is never dequantized) and takes ``M = max g`` as the softmax reference of every
   split and warp: no running max, no rescaling of the accumulator, and the partials of all warps add up without
   exponentials. Reads the K and V codes of its range once; writes the partial ``(sum_t p_t v_t, M, sum_t p_t)``
   at its global split index. Without calibration ``r = 1`` and ``M = delta`` (the range pass runs either way).

Or one **fused** launch (``MODE=2``, 1-bit codes on the int8 K side; ``decode_attention`` picks it where every
program of the grid is resident at once and its logits fit in shared memory): each program runs the range pass's
loop over its split, keeping the raw K logits of every step in shared memory (``ITM`` iterations), writes its
(min, max) to ``cal``, requests its first V codes, then waits at a barrier of the splits of its (row, KV head)
(one int32 counter per pair in ``sync``: a release add, acquire polls; a second add counts programs out and the
last one resets the counter, so the buffer stays zero between launches), reduces ``cal`` as the main pass does and
runs the main pass's loop over V with the logits from shared memory. K is read once; reads q, scales, K and V codes,
``cal`` (written by the other programs of the pair); writes ``cal`` and the partial. On sm_90 (``CL > 0``) the
splits of a pair are instead the ``CL`` CTAs of one thread block cluster and meet at the hardware cluster barrier
(``CL == 1``: one program per pair, no cluster launched, which reduces its own range: no ``cal``); with ``FIN`` the
cluster then merges every partial of its rows (its own and those of the layer's segments launched before it) into
the layer's output, channels split over its CTAs (``_finish``), or, one program and one partial, writes the output
directly.

How the codes become tensor-core operands (per warp and iteration: 8 byte rows of K and V, 16 for 8-bit codes):

* One ``and`` per register (2 codes): the code byte sits in the low byte of an fp16 half, so masking plane ``i``
  leaves ``c * 2**(bits*i - 24)``, an exact fp16 subnormal (tensor cores multiply subnormals exactly; fp32
  accumulation keeps the tiny products). No integer-to-float conversion, no offset to correct.
* K side: ``logits^T[16 rows, head] = mma(codes[rows, channel], (q*s)^T[channel, head])``; rows 0-7 are plane
  2j and rows 8-15 plane 2j+1 of the 8 byte rows (step j), so each row's plane scale ``2**(24 - bits*i)`` is a
  per-register constant of the one FFMA that also adds ``q.z``, the calibration and ``-M``.
* V side: ``out^T[channel, head] += mma(codes^T[channel, 16 rows], p'^T[16 rows, head])``. The B operand is the K
  side's accumulator transposed per 8x8 block (one ``movmatrix`` per register), and ``p' = p * 2**(15 - bits*i)``
  (through the exponent: one FFMA + one ex2 per logit) cancels the plane's scale, so all planes add into one
  accumulator that ends as ``2**-9 * sum p c``.
* Query heads are the MMA's N = 8 (G <= 8).
* ``I8`` (1-bit codes, G <= 4; ``decode_attention`` decides): the K side runs on int8 tensor cores
  (``mma.m16n8k32``). One ``and`` per register of 4 codes (byte values 0 or ``2**i``, the top plane read as -128);
  ``q*s`` is 16-bit fixed point per head whose high and low signed bytes fill columns 2h and 2h + 1, so N = 8 holds
  4 heads without padding and ``high * 256 + low`` is lane-local (layout ``S4``: [W, 16, 4] per-head logits). The
  fixed point's per-head scale (times the calibration ratio) multiplies the row scale; p returns to the fp16 V side
  at the even columns. Exact int32 sums; the fixed point is finer than fp16 ``q*s`` (eval/studies/query_precision.py).
* Channels are relabelled (a fixed permutation, applied to q/K-scales on the K side and to the output/V-scales on
  the V side) so that each lane loads 16-byte vectors and every fragment is a pure register relabelling of them
  (``convert_layout(..., assert_trivial=True)`` proves it at compile time). Codes travel as int32 words: a loop
  that carries uint8 tensors makes LLVM keep one byte per register and repack them (~200 extra ``prmt``).
* The next iteration's words are loaded before this one's are used (two iterations ahead in the range pass),
  inside a branch: without it ptxas sinks the loads to the end of the loop body and every iteration waits. Or,
  with ``ST > 0`` stages (2-8 bit codes in long programs, ``default_stages``), each lane copies its words with
  ``cp.async`` into a swizzled shared-memory ring ``ST - 1`` iterations ahead and reads back its own bytes.
* On sm_90 (``PDL``) the range pass lets the main pass launch at once (``griddepcontrol.launch_dependents``); the
  main pass loads q, the scales and its first codes, then waits (``griddepcontrol.wait``) before it reads ``cal``,
  and lets the merge launch when its loop ends (so does the fused kernel). A fused kernel with ``FIN`` may itself
  be launched as a dependent of the layer's previous segment kernel (``dependent``; that kernel lets it start
  at once): all of its work overlaps that kernel, and it waits only before ``_finish`` reads the partials.
* The epilogue sums the warps' accumulators in registers after one layout conversion (``RL``: each lane holds
  every warp's value of its elements) and writes the partial by physical channel in 16-byte vectors.

Requirements (checked by the caller): one scale block covers the capacity, G <= 8, D in {64, 128}, code rows
contiguous (row stride D). Measured speed and the analysis of what limits it: docs/KERNELS.md, docs/BENCHMARKS.md.
"""

from __future__ import annotations

from .operands import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .operands import _V_SCALE, _cols8, _gdc, _head_consts, _per_head, _rows_cols, _rw
    from .reduce import _arrive, _cluster, _depart, _finish, _own_calibrated, _reference, _store_range, _wait
    from .tile import _issue, _iterations, _load

    @gluon.jit
    def _channel_kernel(
        q_ptr, sq_b, sq_h,
        kc_ptr, vc_ptr, sc_b, sc_h,
        ks_ptr, kz_ptr, sk_b, sk_h,
        vs_ptr, vz_ptr, sv_b, sv_h,
        lens_ptr, T, rows_cap,
        cal_ptr, n_cal, tau1, tau2,
        out_ptr, ml_ptr, HQ, S_total, s_off,
        it_per_prog, qk_scale, sync_ptr, fo_ptr, so_b, so_h, lse_ptr,
        G: gl.constexpr, D: gl.constexpr, BITS: gl.constexpr, W: gl.constexpr,
        SDK: gl.constexpr, SDV: gl.constexpr, CALIB: gl.constexpr, MODE: gl.constexpr, PF: gl.constexpr,
        ST: gl.constexpr, PDL: gl.constexpr, RING: gl.constexpr,
        XL: gl.constexpr, Y0L: gl.constexpr, YL: gl.constexpr, MMA: gl.constexpr, QL: gl.constexpr,
        DA: gl.constexpr, DB: gl.constexpr, I8: gl.constexpr, S4: gl.constexpr, DA8: gl.constexpr,
        DB8: gl.constexpr, ITM: gl.constexpr, SML: gl.constexpr, CL: gl.constexpr, FIN: gl.constexpr,
    ):
        PER: gl.constexpr = 8 // BITS
        FUSED: gl.constexpr = MODE == 2
        NJ: gl.constexpr = 1 if BITS == 8 else 4 // BITS
        PA: gl.constexpr = 1 if FUSED else MODE  # the mode of the (first) pass over K
        RW: gl.constexpr = _rw(BITS)
        ROWS: gl.constexpr = W * RW
        CPQ: gl.constexpr = D // 4
        if PDL and MODE == 1:  # the main pass may start its programs (they wait before reading this pass's output)
            _gdc(T, "launch_dependents")
        sp = gl.program_id(0)
        h = gl.program_id(1)
        b = gl.program_id(2)
        L = gl.minimum(gl.load(lens_ptr + b), T)
        rows_l = (L + PER - 1) // PER
        row0 = sp * it_per_prog * ROWS
        n_it = gl.minimum(it_per_prog, (gl.maximum(rows_l - row0, 0) + ROWS - 1) // ROWS)
        n_full = gl.minimum(n_it, gl.maximum(L // PER - row0, 0) // ROWS)

        # the first codes are in flight while the constants are prepared
        xrow, xcol = _rows_cols(XL, W, RW, D // 4)
        yrow, ycol = _rows_cols(Y0L, W, RW, D // 4)
        kbase = kc_ptr + b * sc_b + h * sc_h
        vbase = vc_ptr + b * sc_b + h * sc_h
        codes = (kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, n_it)
        if ST > 0:
            smk = gl.allocate_shared_memory(gl.int32, [ST, W, RW, D // 4], RING)
            if MODE == 0:
                smv = gl.allocate_shared_memory(gl.int32, [ST, W, RW, D // 4], RING)
            else:
                smv = smk
            for i in gl.static_range(ST - 1):
                _issue(smk, smv, i, codes, MODE, D, ST)
            xk = gl.zeros([W, RW, D // 4], gl.int32, layout=XL)
            xv = gl.zeros([W, RW, D // 4], gl.int32, layout=Y0L)
        else:
            smk = 0
            smv = 0
            # fused programs of up to 4 warps request their first codes inside a branch, before the prologue (ptxas
            # would sink them below it): B=64 n=8192 80.6 -> 79.7 us. Larger programs were faster with the loads after
            # the prologue (B=16 n=8192, 16 warps: 21.6 vs 22.2 us; B=8, 8 warps: 15.7 vs 15.9), and so were the
            # two-pass kernels (B=16 n=32768: 91.6 vs 93.8 us, B=1 n=32768: 18.5 vs 19.5 in the table).
            if FUSED and W <= 4:
                if n_it > 0:
                    xk, xv = _load(kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, PA, D, Y0L)
                else:
                    xk = gl.zeros([W, RW, D // 4], gl.int32, layout=XL)
                    xv = gl.zeros([W, RW, D // 4], gl.int32, layout=Y0L)
            else:
                xk, xv = _load(kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, PA, D, Y0L)

        # the epilogue sums the warps' accumulators in RL (each lane holds all warps' values of its elements and
        # D/32 consecutive channels of 8/W columns: register-local sums, 16-byte stores); V scale/zero are loaded now
        if W <= 8:
            RL: gl.constexpr = gl.BlockedLayout([W, D // 32, 8 // W], [1, 32, 1], [1, 1, W], [1, 2, 0])
        else:  # 16 warps: eight hold the columns, the rest split the channels
            RL: gl.constexpr = gl.BlockedLayout([W, D * 8 // (32 * W), 1], [1, 32, 1], [1, W // 8, 8], [1, 2, 0])
        CHL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(0, RL))
        if MODE != 1:
            ch = gl.arange(0, D, layout=CHL)
            vsc = gl.load(vs_ptr + b * sv_b + h * sv_h + ch * SDV).to(gl.float32)
            vzc = gl.load(vz_ptr + b * sv_b + h * sv_h + ch * SDV).to(gl.float32)

        # ---- q*s as the K-side B operand [W, D (k), 8 (column)]; phi: the physical channel of logical k ----------
        # (int8 path: column n holds head n // 2, its high byte at even n and its low byte at odd n)
        qw = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, QL)))
        qk_ = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, QL)))
        qn = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, QL)))
        if I8:
            phi = CPQ * ((qk_ // 4) % 4) + 8 * (qk_ // 32) + 4 * ((qk_ // 16) % 2) + qk_ % 4
            qh = qn // 2
        else:
            phi = CPQ * ((qk_ // 2) % 4) + 4 * (qk_ // 16) + 2 * (qk_ % 2) + (qk_ // 8) % 2
            qh = qn
        k3 = gl.expand_dims(gl.expand_dims(phi, 0), 2)
        n3 = gl.expand_dims(gl.expand_dims(qh, 0), 1)
        w3 = gl.expand_dims(gl.expand_dims(qw, 1), 2)
        qmask = (n3 < G) & (k3 >= 0) & (w3 >= 0)
        qv = gl.load(q_ptr + b * sq_b + (h * G + n3) * sq_h + k3 + w3 * 0, mask=qmask, other=0.0).to(gl.float32)
        ksv = gl.load(ks_ptr + b * sk_b + h * sk_h + k3 * SDK).to(gl.float32)
        kzv = gl.load(kz_ptr + b * sk_b + h * sk_h + k3 * SDK).to(gl.float32)
        qz = gl.sum(qv * kzv, axis=1) * qk_scale  # [W, 8]
        qsf = qv * ksv * qk_scale
        qw2 = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(1, QL)))
        g2 = gl.expand_dims(qh, 0) + gl.expand_dims(qw2, 1) * 0  # [W, 8] head index
        if MODE == 0:
            if PDL:  # launched before the range pass ended: only its min/max are read after this point
                n_cal = _gdc(n_cal, "wait")
            ratio, m_ref, c0 = _reference(cal_ptr, n_cal, b * HQ + h * G, g2, qz, tau1, tau2, G, CALIB, False)
            if CALIB and not I8:  # the int8 path applies ratio to its per-head scale instead
                qsf = qsf * gl.expand_dims(ratio, 1)
        else:
            c0 = qz
        if I8:  # q*s per head as 16-bit fixed point (|q16| <= 127 * 256), split into a high and a low signed byte
            sc = gl.max(gl.abs(qsf), axis=1) / 32512.0  # [W, 8]
            sc = gl.where(sc > 0, sc, 1.0)
            q16 = gl.floor(qsf / gl.expand_dims(sc, 1) + 0.5).to(gl.int32)
            qhi = (q16 + 128) >> 8
            qb = gl.where((gl.expand_dims(gl.expand_dims(qn, 0), 1) % 2) == 0, qhi, q16 - qhi * 256)
            a_q = gl.convert_layout(qb.to(gl.int8), DB8)
            if MODE == 0 and CALIB:
                c0 = (_per_head(sc * ratio, S4), _per_head(c0, S4))
            elif FUSED and CL == 1:  # 16 warps, B=16 n=8192: 21.6 -> 21.1 us; slower in 2-8 warp clusters (+0.1-0.6)
                c0 = _head_consts(q_ptr + b * sq_b + h * G * sq_h, sq_h, ks_ptr + b * sk_b + h * sk_h,
                                  kz_ptr + b * sk_b + h * sk_h, qk_scale, G, D, W, SDK, S4)
            else:
                c0 = (_per_head(sc, S4), _per_head(c0, S4))
            LA: gl.constexpr = S4
            NC: gl.constexpr = 4
        else:
            a_q = gl.convert_layout(qsf.to(gl.float16), DB)
            c0 = gl.expand_dims(gl.convert_layout(c0, gl.SliceLayout(1, MMA)), 1)  # [W, 1, 8]
            LA: gl.constexpr = MMA
            NC: gl.constexpr = 8

        l_acc = gl.zeros([W, 16, NC], gl.float32, layout=LA)
        acc = gl.zeros([W, D, 8], gl.float32, layout=MMA)
        lo = gl.full([W, 16, NC], float("inf"), gl.float32, layout=LA)
        hi = gl.full([W, 16, NC], float("-inf"), gl.float32, layout=LA)
        if PF == 2 and ST == 0:
            xk2, xv2 = _load(kbase, vbase, row0 + ROWS, xrow, xcol, yrow, ycol, rows_cap, PA, D, Y0L)
        else:
            xk2, xv2 = xk, xv
        HL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, MMA))
        hn = gl.arange(0, 8, layout=HL)  # column; its head and whether it is the head's column:
        if I8:
            hd = hn // 2
            hv = (hn % 2 == 0) & (hd < G)
        else:
            hd = hn
            hv = hn < G
        if FUSED:  # the raw logits of every step stay in shared memory until V is read; one buffer per step j, so
            # that Triton's shared-memory hazard pass puts one block barrier per iteration, not one per store
            sml = ()
            for _ in gl.static_range(NJ):
                sml = sml + (gl.allocate_shared_memory(gl.float32, [ITM, W, 16, NC], SML),)
        else:
            sml = 0
        xk, xv, xk2, xv2, l_acc, acc, lo, hi = _iterations(0, n_full, codes, L, a_q, c0, xk, xv, xk2, xv2, l_acc, acc,
                                                           lo, hi, smk, smv, PA, False, PF, ST, BITS, D, XL, Y0L, YL,
                                                           MMA, DA, DB, I8, S4, DA8, sml, FUSED)
        xk, xv, xk2, xv2, l_acc, acc, lo, hi = _iterations(n_full, n_it, codes, L, a_q, c0, xk, xv, xk2, xv2, l_acc,
                                                           acc, lo, hi, smk, smv, PA, True, PF, ST, BITS, D, XL, Y0L,
                                                           YL, MMA, DA, DB, I8, S4, DA8, sml, FUSED)
        if FUSED:
            # (min, max) of this split, then wait for every split of the (sequence, KV head): the V codes of the first
            # iterations are requested meanwhile
            if CL != 1:  # one program per pair reduces its own range instead (no cal)
                _store_range(cal_ptr, (b * HQ + h * G + hd) * n_cal + sp, lo, hi, hv, I8, MMA)
                if CL > 1:  # the splits of the pair are the CTAs of one cluster: the hardware barrier
                    n_cal = _cluster(n_cal, "arrive.release")
                else:
                    pair = sync_ptr + b * gl.num_programs(1) + h
                    seen = _arrive(pair)
            xk, xv = _load(kbase, vbase, row0, xrow, xcol, yrow, ycol, rows_cap, 0, D, Y0L, True)
            xk2, xv2 = _load(kbase, vbase, row0 + ROWS, xrow, xcol, yrow, ycol, rows_cap, 0, D, Y0L, True)
            if CL == 1:
                c0, m4 = _own_calibrated(lo, hi, c0[0], c0[1], tau1, tau2, G, CALIB)
            else:
                if CL > 1:
                    n_cal = _cluster(n_cal, "wait.acquire")
                else:
                    _wait(pair, seen, n_cal)
                ratio, m_ref, c0 = _reference(cal_ptr, n_cal, b * HQ + h * G, g2, qz, tau1, tau2, G, CALIB, True)
                if CL == 0:
                    _depart(pair, n_cal)
                if CALIB:
                    sc = sc * ratio
                c0 = (_per_head(sc, S4), _per_head(c0, S4))
            xk, xv, xk2, xv2, l_acc, acc, lo, hi = _iterations(0, n_full, codes, L, a_q, c0, xk, xv, xk2, xv2, l_acc,
                                                               acc, lo, hi, smk, smv, 0, False, PF, ST, BITS, D, XL,
                                                               Y0L, YL, MMA, DA, DB, I8, S4, DA8, sml, True)
            xk, xv, xk2, xv2, l_acc, acc, lo, hi = _iterations(n_full, n_it, codes, L, a_q, c0, xk, xv, xk2, xv2,
                                                               l_acc, acc, lo, hi, smk, smv, 0, True, PF, ST, BITS, D,
                                                               XL, Y0L, YL, MMA, DA, DB, I8, S4, DA8, sml, True)

        if PDL and MODE != 1 and FIN == 0:  # the merge may start its programs (they wait for this pass to end)
            _gdc(T, "launch_dependents")
        # ---- epilogue: sum the W warps, write the partial ---------------------------------------------------------
        if MODE == 1:
            _store_range(ml_ptr, (b * HQ + h * G + hd) * S_total + s_off + sp, lo, hi, hv, I8, MMA)
        else:
            row_ml = (b * HQ + h * G + hd) * S_total + s_off + sp
            if I8:
                l_acc = _cols8(l_acc, 0.0, MMA)
            l_h = gl.convert_layout(gl.sum(gl.sum(l_acc, axis=1), axis=0), HL)  # [8]
            # logical m = 16 b + 8 c + a holds physical channel 16 a + 2 b + c (D = 128; ``psi``): reorder to
            # physical channels on the way into RL
            accp = gl.permute(gl.reshape(acc, [W, D // 16, 2, 8, 8]), [0, 3, 1, 2, 4])
            acc_s = gl.sum(gl.convert_layout(gl.reshape(accp, [W, D, 8]), RL), axis=0)  # [D (physical), 8]
            OL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, RL))
            hn2 = gl.arange(0, 8, layout=OL)
            if I8:
                go = gl.expand_dims(hn2 // 2, 0)
                gv = gl.expand_dims((hn2 % 2 == 0) & (hn2 // 2 < G), 0)
            else:
                go = gl.expand_dims(hn2, 0)
                gv = gl.expand_dims(hn2 < G, 0)
            o = acc_s * gl.expand_dims(vsc * _V_SCALE, 1) + gl.expand_dims(gl.convert_layout(l_h, OL), 0) * \
                gl.expand_dims(vzc, 1)
            c2 = gl.expand_dims(ch, 1)
            if FUSED and CL == 1:  # column n holds head n // 2
                m_h = gl.convert_layout(gl.reshape(gl.join(m4, m4), [8]), HL)
            else:
                m_h = gl.convert_layout(gl.max(m_ref, axis=0), HL)
            if FIN > 0 and CL == 1 and S_total == 1:  # the layer's only partial: it is the output
                l_o = gl.expand_dims(gl.convert_layout(l_h, OL), 0)
                live = l_o > 0
                res = gl.where(live, o / gl.where(live, l_o, 1.0), 0.0)
                gl.store(fo_ptr + b * so_b + (h * G + go) * so_h + c2, res.to(fo_ptr.dtype.element_ty),
                         mask=gv & (c2 >= 0))
                if FIN == 2:
                    lse = gl.where(l_h > 0, (m_h + gl.log2(gl.where(l_h > 0, l_h, 1.0))) * 0.6931471805599453,
                                   float("-inf"))
                    gl.store(lse_ptr + b * HQ + h * G + hd, lse, mask=hv)
            else:
                gl.store(out_ptr + ((b * HQ + h * G + go) * S_total + s_off + sp) * D + c2, o, mask=gv & (c2 >= 0))
                gl.store(ml_ptr + row_ml * 2, gl.where(l_h > 0, m_h, -1.0e30), mask=hv)
                gl.store(ml_ptr + row_ml * 2 + 1, l_h, mask=hv)
                if FIN > 0:  # the layer's last kernel: the cluster merges every partial of its rows into the output
                    r = sp
                    if PDL:  # launched while the layer's previous segment kernel runs: its partials are read next
                        r = _gdc(r, "wait")
                    r = _cluster(_cluster(r, "arrive.release"), "wait.acquire")
                    _finish(out_ptr, ml_ptr, fo_ptr, lse_ptr, so_b, so_h, b, h, r, HQ, S_total, G, D, CL, W, FIN)
