"""Gluon kernel behind `attnserve.models.layers.mid_gemm_gluon` (import that module, not this one).

``y = x @ W^T (+ b)`` for ``16 < M <= 256`` decode rows on Hopper (sm_90a), swapped-operand
("swap-AB") and persistent, with a stream-K work split and warp specialization.

* Swap-AB: a CTA tile is ``BLOCK_N`` weight rows; each consumer warpgroup owns ``WG_ROWS =
  BLOCK_N / NUM_CONSUMERS`` of them as the wgmma ``A`` operand (M side, 64 or 128 rows) and
  the activation rows are the ``B`` operand (wgmma ``N``) in one or two power-of-two pieces
  ``BLOCK_M1 (+ BLOCK_M2)`` (`mid_gemm.m_pieces`: 144 = 128 + 16), so the rows need no
  padding to 256. TMA zero-fills rows past ``M`` / ``N`` and columns past ``K``.
* Stream-K (Osama et al., "Stream-K: Work-centric Parallel Decomposition for Dense
  Matrix-Matrix Multiplication on the GPU", PPoPP 2023): the ``n_tiles x k_steps`` units
  are cut into ``G`` (= grid) contiguous, equal ranges; CTA ``c`` owns units
  ``[c * T // G, (c + 1) * T // G)``, so a CTA holds at most two partial tile segments
  (its first and its last; the ones between are whole tiles, written directly). Fixup by
  partials in workspace slots (the serial split-K / stream-K reduction of CUTLASS's
  stream-K scheduler, our own code): a partial segment's float32 accumulators go, with
  plain coalesced stores (``st.global.cg``, 8-byte chunks), into the CTA's own slot ``2 c``
  (first segment) or ``2 c + 1`` (last) of ``ws [2 G, H * BLOCK_N, MP]``; then a release
  (``fence.acq_rel.gpu`` in every thread, a warpgroup barrier, one acq-rel atomic add of the
  segment's K steps to the tile's counter, one per consumer warpgroup). The CTA whose add
  completes ``k_steps`` (the last arriver, in any order) fences (acquire), reads the
  contributors' slots with plain ``ld.global.cg`` loads in CTA order (its own included, so
  the sum's order does not depend on who arrives last: bit-reproducible), adds the bias,
  writes ``y`` and resets the counter. Slots are overwritten, never accumulated into, so
  the data needs no zeroing; the counters are left zero, so no memset is ever launched and
  no CTA waits for another (any grid size is deadlock-free). ``G`` dividing ``n_tiles`` is a
  data-parallel launch (whole tiles only, no workspace traffic); ``G = S * n_tiles`` is a
  split-K by ``S`` (``S`` dividing ``k_steps``: one segment a CTA).
* Gated (constexpr ``GATED``): the fused ``gate_up`` projection and its SiLU / GELU-tanh
  gate in the epilogue (each consumer holds gate and up accumulators of its rows).
* Warp specialization (``gl.warp_specialize``): a 1-warp loader issues the TMA copies of
  each unit's weight tile and activation pieces into a ``NUM_STAGES`` ring (``ready`` /
  ``empty`` mbarriers) and runs ahead across tile boundaries, so the next tile's weight is
  in flight during a consumer's epilogue; ``NUM_CONSUMERS`` (1 or 2) warpgroups issue async
  wgmmas (one ``K`` step kept in flight, its stage released when the next step's wait
  retires it) and run the epilogue (+ float32 bias, bf16 store, or the workspace path).
* ``USE_PDL`` (programmatic dependent launch, `attnserve.pdl`): the loader issues the
  weight copies of its first ``NUM_STAGES`` steps, then ``griddepcontrol.wait`` before any
  activation copy; consumers wait before their first global write (``y``, workspace and
  counters are touched only after the previous kernel completed).

``BLOCK_K`` is a multiple of 64: each stage holds ``BLOCK_K / 64`` chunks of 64 columns
(128-byte swizzle: a TMA box row is at most the swizzle width), the weight chunk as one
``[WG_ROWS, 64]`` box per consumer. Every activation tile is re-read from L2 for every
weight tile: ``M / BLOCK_N`` activation bytes per weight byte, so ``BLOCK_N`` 256 (2 x 128
rows, at most ~160 rows of ``M`` within the register budget) halves that traffic against
128. Ideas (not code) from the
Triton Gluon tutorials (persistence, warp specialization) and CUTLASS's stream-K; the code
is our own. Written against Triton 3.6's Gluon API; imported only when used.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__: list[str] = []  # kernel-internal; the public names are `mid_gemm_gluon`'s

CHUNK = gl.constexpr(64)  # K columns of one TMA box / shared tile (128 bytes of bf16)


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _fence_acq_rel_gpu():
    gl.inline_asm_elementwise("fence.acq_rel.gpu; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _my_units(N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """``(k_steps, u0, u1)``: this CTA's stream-K range of units ``[u0, u1)`` (unit ``u`` is
    tile ``u // k_steps``, K step ``u % k_steps``)."""
    ks = gl.cdiv(K, BLOCK_K)
    total = gl.cdiv(N, BLOCK_N) * ks
    pid = gl.program_id(0)
    g = gl.num_programs(0)
    return ks, pid * total // g, (pid + 1) * total // g


@gluon.jit
def _issue_x(x1_desc, x2_desc, x1_s, x2_s, bar, slot0, k0, BLOCK_M1: gl.constexpr, HAS_M2: gl.constexpr,
             KC: gl.constexpr):
    for c in gl.static_range(KC):
        tma.async_copy_global_to_shared(x1_desc, [0, k0 + c * CHUNK], bar, x1_s.index(slot0 + c))
        if HAS_M2:
            tma.async_copy_global_to_shared(x2_desc, [BLOCK_M1, k0 + c * CHUNK], bar, x2_s.index(slot0 + c))


@gluon.jit
def _issue_w(w_desc, w_s, bar, slot0, row0, k0, N, KC: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
             GATED: gl.constexpr):
    """The weight tile as ``KC x NUM_CONSUMERS (x 2 gated)`` boxes of ``[WG_ROWS, 64]`` (box
    ``(c, j, h)``: K chunk ``c`` of consumer ``j``'s rows, gate ``h = 0`` / up ``h = 1`` rows
    ``N`` further)."""
    WG_ROWS: gl.constexpr = w_desc.block_type.shape[0]
    H: gl.constexpr = 2 if GATED else 1
    for c in gl.static_range(KC):
        for j in gl.static_range(NUM_CONSUMERS):
            for h in gl.static_range(H):
                tma.async_copy_global_to_shared(w_desc, [row0 + j * WG_ROWS + h * N, k0 + c * CHUNK], bar,
                                                w_s.index(((slot0 + c) * NUM_CONSUMERS + j) * H + h))


@gluon.jit
def _loader(w_desc, x1_desc, x2_desc, w_s, x1_s, x2_s, ready, empty, N, K, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, BLOCK_M1: gl.constexpr, HAS_M2: gl.constexpr, NUM_STAGES: gl.constexpr,
            USE_PDL: gl.constexpr, NUM_CONSUMERS: gl.constexpr, GATED: gl.constexpr):
    """Worker partition (1 warp): TMA copies of every unit of this CTA's range, in order."""
    KC: gl.constexpr = BLOCK_K // CHUNK
    H: gl.constexpr = 2 if GATED else 1
    nbytes: gl.constexpr = KC * (H * NUM_CONSUMERS * w_desc.block_type.nbytes + x1_desc.block_type.nbytes
                                 + (x2_desc.block_type.nbytes if HAS_M2 else 0))
    ks, u0, u1 = _my_units(N, K, BLOCK_N, BLOCK_K)
    n = u1 - u0
    start = 0
    if USE_PDL:
        # the weight of the first NUM_STAGES steps before the wait (fresh stages: no empty
        # wait); the activations, written by the kernel before, only after it
        pre = gl.minimum(n, NUM_STAGES)
        for i in range(pre):
            t = (u0 + i) // ks
            mbarrier.expect(ready.index(i), nbytes)
            _issue_w(w_desc, w_s, ready.index(i), i * KC, t * BLOCK_N, (u0 + i - t * ks) * BLOCK_K, N, KC,
                     NUM_CONSUMERS, GATED)
        _gdc_wait()
        for i in range(pre):
            t = (u0 + i) // ks
            _issue_x(x1_desc, x2_desc, x1_s, x2_s, ready.index(i), i * KC, (u0 + i - t * ks) * BLOCK_K, BLOCK_M1,
                     HAS_M2, KC)
        start = pre
    for i in range(start, n):
        s = i % NUM_STAGES
        mbarrier.wait(empty.index(s), ((i // NUM_STAGES) & 1) ^ 1)  # a fresh barrier counts as released
        t = (u0 + i) // ks
        k0 = (u0 + i - t * ks) * BLOCK_K
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        _issue_w(w_desc, w_s, bar, s * KC, t * BLOCK_N, k0, N, KC, NUM_CONSUMERS, GATED)
        _issue_x(x1_desc, x2_desc, x1_s, x2_s, bar, s * KC, k0, BLOCK_M1, HAS_M2, KC)


@gluon.jit
def _gate_act(g, ACT: gl.constexpr):
    """``ACT`` 0: SiLU ``g * sigmoid(g)``; 1: GELU tanh ``0.5 g (1 + tanh(sqrt(2/pi)(g + 0.044715
    g^3)))`` (float32; exponentials of non-positive arguments only, so nothing overflows)."""
    if ACT == 0:
        e = gl.exp(-gl.abs(g))
        a = g * gl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = gl.exp(-2.0 * gl.abs(z))
        th = (1.0 - e) / (1.0 + e)
        a = 0.5 * g * (1.0 + gl.where(z >= 0, th, -th))
    return a


@gluon.jit
def _store_out(acc, up, rows, cols, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: gl.constexpr, GATED: gl.constexpr,
               ACT: gl.constexpr):
    """``y[cols, rows] = acc (+ b[rows])`` (acc is ``[weight rows, tokens]``), masked to
    ``N`` x ``M``; GATED: ``act(acc + b[rows]) * (up + b[N + rows])``."""
    if HAS_BIAS:
        acc = acc + gl.load(b_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
        if GATED:
            up = up + gl.load(b_ptr + N + rows, mask=rows < N, other=0.0).to(gl.float32)[:, None]
    if GATED:
        acc = _gate_act(acc, ACT) * up
    ptrs = y_ptr + cols[None, :] * stride_ym + rows[:, None]
    gl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows < N)[:, None] & (cols < M)[None, :])


@gluon.jit
def _wait_all(acc1, acc2, up1, up2, N_OUT: gl.constexpr, HAS_M2: gl.constexpr, GATED: gl.constexpr):
    """``warpgroup_mma_wait(N_OUT)`` over the accumulators in use (the others pass through)."""
    if GATED:
        if HAS_M2:
            acc1, acc2, up1, up2 = warpgroup_mma_wait(N_OUT, deps=[acc1, acc2, up1, up2])
        else:
            acc1, up1 = warpgroup_mma_wait(N_OUT, deps=[acc1, up1])
    else:
        if HAS_M2:
            acc1, acc2 = warpgroup_mma_wait(N_OUT, deps=[acc1, acc2])
        else:
            acc1 = warpgroup_mma_wait(N_OUT, deps=[acc1])
    return acc1, acc2, up1, up2


@gluon.jit
def _slot_ptrs(ws_ptr, slot, r_loc, cols, h, BLOCK_N: gl.constexpr, MP: gl.constexpr, H: gl.constexpr):
    """Rows ``r_loc`` (tile-local) x ``cols`` of workspace slot ``slot`` (``[H * BLOCK_N, MP]``
    float32, token-contiguous: a thread's pair of accumulator columns is one 8-byte chunk);
    ``h`` 1 is the up half."""
    return ws_ptr + slot * (H * BLOCK_N * MP) + (h * BLOCK_N + r_loc)[:, None] * MP + cols[None, :]


@gluon.jit
def _publish(ws_ptr, slot, acc, up, r_loc, cols, BLOCK_N: gl.constexpr, MP: gl.constexpr, GATED: gl.constexpr):
    """A partial tile (and up tile) written, plain stores past L1, into this CTA's slot."""
    H: gl.constexpr = 2 if GATED else 1
    gl.store(_slot_ptrs(ws_ptr, slot, r_loc, cols, 0, BLOCK_N, MP, H), acc, cache_modifier=".cg")
    if GATED:
        gl.store(_slot_ptrs(ws_ptr, slot, r_loc, cols, 1, BLOCK_N, MP, H), up, cache_modifier=".cg")


@gluon.jit
def _gather(ws_ptr, t, ks, T, G, up, r_loc, cols, BLOCK_N: gl.constexpr, MP: gl.constexpr, GATED: gl.constexpr,
            PAIR: gl.constexpr):
    """Tile ``t``'s sum over its contributors' slots, CTAs ``c_first .. c_last`` in that fixed
    order (whichever CTA gathers: bit-reproducible). CTA ``c`` owns units ``[c T // G, (c + 1)
    T // G)``, so the owner of unit ``u`` is ``((u + 1) G - 1) // T``; its share of ``t`` is in
    slot ``2 c`` when its range starts inside ``t``, else (it began in an earlier tile, so
    ``t`` is its last segment) in slot ``2 c + 1`` (only ``c_first`` can be such a CTA). Loads
    bypass L1 (``.cg``); the sum starts from the first slot (no zero tensor: fewer registers).
    ``up`` is returned as is unless GATED. ``PAIR`` (where registers allow a sum and two
    slots): two slots loaded before their two additions, half the round trips."""
    H: gl.constexpr = 2 if GATED else 1
    c_first = ((t * ks + 1) * G - 1) // T
    c_last = ((t + 1) * ks * G - 1) // T
    slot0 = 2 * c_first + ((c_first * T // G) < t * ks).to(gl.int32)  # the others start inside t: 2 c
    tot = gl.load(_slot_ptrs(ws_ptr, slot0, r_loc, cols, 0, BLOCK_N, MP, H), cache_modifier=".cg")
    if PAIR:  # two slots' loads in flight a round trip (the same additions, in the same order)
        for c in range(c_first + 1, c_last, 2):
            a = gl.load(_slot_ptrs(ws_ptr, 2 * c, r_loc, cols, 0, BLOCK_N, MP, H), cache_modifier=".cg")
            b = gl.load(_slot_ptrs(ws_ptr, 2 * c + 2, r_loc, cols, 0, BLOCK_N, MP, H), cache_modifier=".cg")
            tot = tot + a
            tot = tot + b
        if (c_last - c_first) % 2 == 1:
            tot += gl.load(_slot_ptrs(ws_ptr, 2 * c_last, r_loc, cols, 0, BLOCK_N, MP, H), cache_modifier=".cg")
    else:
        for c in range(c_first + 1, c_last + 1):
            tot += gl.load(_slot_ptrs(ws_ptr, 2 * c, r_loc, cols, 0, BLOCK_N, MP, H), cache_modifier=".cg")
    tu = up
    if GATED:  # a second pass: only one sum and one slot's loads in flight at a time (registers)
        tu = gl.load(_slot_ptrs(ws_ptr, slot0, r_loc, cols, 1, BLOCK_N, MP, H), cache_modifier=".cg")
        for c in range(c_first + 1, c_last + 1):
            tu += gl.load(_slot_ptrs(ws_ptr, 2 * c, r_loc, cols, 1, BLOCK_N, MP, H), cache_modifier=".cg")
    return tot, tu


@gluon.jit
def _consumer(w_s, x1_s, x2_s, ready, empty, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym,
              WG: gl.constexpr, NUM_CONSUMERS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              BLOCK_M1: gl.constexpr, BLOCK_M2: gl.constexpr, HAS_M2: gl.constexpr, NUM_STAGES: gl.constexpr,
              HAS_BIAS: gl.constexpr, USE_PDL: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr):
    """Consumer warpgroup ``WG``: rows ``WG * WG_ROWS ..`` of every tile of this CTA's range
    (GATED: those gate rows and the up rows ``N`` further)."""
    KC: gl.constexpr = BLOCK_K // CHUNK
    H: gl.constexpr = 2 if GATED else 1
    WG_ROWS: gl.constexpr = BLOCK_N // NUM_CONSUMERS
    MP: gl.constexpr = BLOCK_M1 + (BLOCK_M2 if HAS_M2 else 0)
    GROUPS: gl.constexpr = KC * H * (2 if HAS_M2 else 1)  # async wgmma groups issued per K step
    # fixup gather: a sum and two slots of a piece (3 x its accumulator registers) within a
    # consumer's budget (REGISTER_PLAN: 168 a thread with two consumers, 255 with one)?
    SLACK: gl.constexpr = 120 if NUM_CONSUMERS == 2 else 200
    PAIR1: gl.constexpr = (not GATED) and 3 * (WG_ROWS * BLOCK_M1 // 128) <= SLACK
    PAIR2: gl.constexpr = (not GATED) and 3 * (WG_ROWS * BLOCK_M2 // 128) <= SLACK
    L1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M1, 16])
    L2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M2, 16])
    if USE_PDL:
        _gdc_wait()  # y, the workspace and the counters are touched only after the kernel before
    ks, u0, u1 = _my_units(N, K, BLOCK_N, BLOCK_K)
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    T = gl.cdiv(N, BLOCK_N) * ks  # units
    ROW0: gl.constexpr = WG * WG_ROWS
    r_loc = gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, L1)) + ROW0
    r_loc2 = gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, L2)) + ROW0
    cols1 = gl.arange(0, BLOCK_M1, layout=gl.SliceLayout(0, L1))
    cols2 = gl.arange(0, BLOCK_M2, layout=gl.SliceLayout(0, L2)) + BLOCK_M1
    for t in range(u0 // ks, (u1 + ks - 1) // ks):
        k_lo = gl.maximum(u0 - t * ks, 0)
        k_hi = gl.minimum(u1 - t * ks, ks)
        acc1 = gl.zeros([WG_ROWS, BLOCK_M1], gl.float32, L1)
        acc2 = gl.zeros([WG_ROWS, BLOCK_M2], gl.float32, L2)
        up1 = acc1
        up2 = acc2
        for k in range(k_lo, k_hi):
            i = t * ks + k - u0
            s = i % NUM_STAGES
            mbarrier.wait(ready.index(s), (i // NUM_STAGES) & 1)
            for c in gl.static_range(KC):
                a = w_s.index(((s * KC + c) * NUM_CONSUMERS + WG) * H)
                b1 = x1_s.index(s * KC + c).permute((1, 0))
                acc1 = warpgroup_mma(a, b1, acc1, is_async=True)
                if GATED:
                    up1 = warpgroup_mma(w_s.index(((s * KC + c) * NUM_CONSUMERS + WG) * H + 1), b1, up1,
                                        is_async=True)
                if HAS_M2:
                    b2 = x2_s.index(s * KC + c).permute((1, 0))
                    acc2 = warpgroup_mma(a, b2, acc2, is_async=True)
                    if GATED:
                        up2 = warpgroup_mma(w_s.index(((s * KC + c) * NUM_CONSUMERS + WG) * H + 1), b2, up2,
                                            is_async=True)
            # retire the previous step's wgmmas (this step's stay in flight), free its stage
            acc1, acc2, up1, up2 = _wait_all(acc1, acc2, up1, up2, GROUPS, HAS_M2, GATED)
            if k > k_lo:
                mbarrier.arrive(empty.index((i - 1) % NUM_STAGES))
        acc1, acc2, up1, up2 = _wait_all(acc1, acc2, up1, up2, 0, HAS_M2, GATED)
        mbarrier.arrive(empty.index((t * ks + k_hi - 1 - u0) % NUM_STAGES))
        rows1 = t * BLOCK_N + r_loc
        rows2 = t * BLOCK_N + r_loc2
        if (k_lo == 0) & (k_hi == ks):  # the whole tile: write it
            _store_out(acc1, up1, rows1, cols1, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS, GATED, ACT)
            if HAS_M2:
                _store_out(acc2, up2, rows2, cols2, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS, GATED, ACT)
        else:  # a share of it: into this CTA's slot; the last to arrive sums the slots, writes y
            slot = 2 * pid + (u0 < t * ks).to(gl.int32)  # 0: first segment, 1: last segment
            _publish(ws_ptr, slot, acc1, up1, r_loc, cols1, BLOCK_N, MP, GATED)
            if HAS_M2:
                _publish(ws_ptr, slot, acc2, up2, r_loc2, cols2, BLOCK_N, MP, GATED)
            _fence_acq_rel_gpu()  # every thread's stores ordered before the counter's release
            gl.thread_barrier()
            cnt = cnt_ptr + t * NUM_CONSUMERS + WG
            done = gl.atomic_add(cnt, k_hi - k_lo, sem="acq_rel") + (k_hi - k_lo)
            if done == ks:
                _fence_acq_rel_gpu()  # acquire in every thread before reading the other slots
                tot1, tu1 = _gather(ws_ptr, t, ks, T, G, up1, r_loc, cols1, BLOCK_N, MP, GATED, PAIR1)
                _store_out(tot1, tu1, rows1, cols1, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS, GATED, ACT)
                if HAS_M2:
                    tot2, tu2 = _gather(ws_ptr, t, ks, T, G, up2, r_loc2, cols2, BLOCK_N, MP, GATED, PAIR2)
                    _store_out(tot2, tu2, rows2, cols2, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS, GATED, ACT)
                gl.atomic_xchg(cnt, 0, sem="relaxed")


@gluon.jit(do_not_specialize=["M"])
def _gluon_mid_gemm_kernel(
    w_desc, x1_desc, x2_desc, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_M1: gl.constexpr, BLOCK_M2: gl.constexpr,
    HAS_M2: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr, HAS_BIAS: gl.constexpr,
    USE_PDL: gl.constexpr, CONSUMER_REGS: gl.constexpr = 240, LOADER_REGS: gl.constexpr = 24,
    GATED: gl.constexpr = False, ACT: gl.constexpr = 0,
):
    """Persistent grid of ``G <= n_tiles * k_steps`` CTAs, ``num_warps=4`` (consumer 0; the
    kernel adds ``4 * (NUM_CONSUMERS - 1) + 1`` worker warps). Registers (``maxnreg`` at
    launch, then ``setmaxnreg``): the host's `mid_gemm_gluon.REGISTER_PLAN`.

    ``w_desc``: TMA descriptor of ``W [N, K]`` with ``[BLOCK_N / NUM_CONSUMERS, 64]`` boxes; ``x1_desc`` /
    ``x2_desc``: of ``x [M, K]`` with ``[BLOCK_M1, 64]`` / ``[BLOCK_M2, 64]`` boxes (x2 unused
    without HAS_M2); all 128-byte swizzled. ``b [N]`` read when HAS_BIAS; ``y [M, N]`` rows
    ``stride_ym`` apart. ``ws``: float32 slots ``[2 G, H * BLOCK_N, BLOCK_M1 + BLOCK_M2 *
    HAS_M2]`` (any contents; unused when every tile is whole), ``cnt``: int32 zeros
    ``[cdiv(N, BLOCK_N) * NUM_CONSUMERS]`` (left zero on exit).

    GATED (fused ``gate_up``): ``w`` is ``[2N, K]`` = ``[gate | up]`` (``N``: output columns);
    a tile is ``BLOCK_N`` gate rows and the up rows ``N`` further (twice the weight bytes and
    accumulators a stage); ``y = act(gate + b[:N]) * (up + b[N:])`` with ``ACT`` 0 SiLU, 1
    GELU-tanh (float32); ``b [2N]``; a ``ws`` slot has the up rows after the gate rows. A gate
    box past ``N`` reads up rows: they feed only columns that are not stored.
    """
    KC: gl.constexpr = BLOCK_K // CHUNK
    gl.static_assert(BLOCK_K % CHUNK == 0, "BLOCK_K must be a multiple of 64")
    if USE_PDL:
        _gdc_launch_dependents()
    H: gl.constexpr = 2 if GATED else 1
    w_s = gl.allocate_shared_memory(w_desc.dtype,
                                    [NUM_STAGES * KC * NUM_CONSUMERS * H, BLOCK_N // NUM_CONSUMERS, CHUNK],
                                    w_desc.layout)
    x1_s = gl.allocate_shared_memory(x1_desc.dtype, [NUM_STAGES * KC, BLOCK_M1, CHUNK], x1_desc.layout)
    if HAS_M2:
        x2_s = gl.allocate_shared_memory(x2_desc.dtype, [NUM_STAGES * KC, BLOCK_M2, CHUNK], x2_desc.layout)
    else:
        x2_s = x1_s  # never read
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=NUM_CONSUMERS)
    fence_async_shared()  # the initialised barriers visible to the TMA unit (async proxy) ...
    gl.thread_barrier()  # ... and to every warp before any partition starts
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (w_s, x1_s, x2_s, ready, empty, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym, 0,
                         NUM_CONSUMERS, BLOCK_N, BLOCK_K, BLOCK_M1, BLOCK_M2, HAS_M2, NUM_STAGES, HAS_BIAS, USE_PDL,
                         GATED, ACT)),
            (_consumer, (w_s, x1_s, x2_s, ready, empty, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym, 1,
                         NUM_CONSUMERS, BLOCK_N, BLOCK_K, BLOCK_M1, BLOCK_M2, HAS_M2, NUM_STAGES, HAS_BIAS, USE_PDL,
                         GATED, ACT)),
            (_loader, (w_desc, x1_desc, x2_desc, w_s, x1_s, x2_s, ready, empty, N, K, BLOCK_N, BLOCK_K, BLOCK_M1,
                       HAS_M2, NUM_STAGES, USE_PDL, NUM_CONSUMERS, GATED)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (w_s, x1_s, x2_s, ready, empty, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, stride_ym, 0,
                         NUM_CONSUMERS, BLOCK_N, BLOCK_K, BLOCK_M1, BLOCK_M2, HAS_M2, NUM_STAGES, HAS_BIAS, USE_PDL,
                         GATED, ACT)),
            (_loader, (w_desc, x1_desc, x2_desc, w_s, x1_s, x2_s, ready, empty, N, K, BLOCK_N, BLOCK_K, BLOCK_M1,
                       HAS_M2, NUM_STAGES, USE_PDL, NUM_CONSUMERS, GATED)),
        ], [1], [LOADER_REGS])
