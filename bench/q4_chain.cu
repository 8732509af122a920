// A probe, not an engine kernel (bench/chain_probe.py builds and times it):
// two one-row DP4A GEMVs of the same K and the add_rms_norm between them in
// ONE persistent launch, so that the second GEMV's blocks are resident, with
// their first tile in registers, before the first GEMV ends. Appended to
// engine/quant/q4_gemv.cu's source and built with its NORM prologue flags
// (NORM=1, HAS_PENDING=1, STAGES=0, EARLY_L2_TILES=0, L2_PREFETCH=0), whose
// helpers it calls.
//
// Why: on the H200 each of the int4 step's 129 GEMVs after a norm takes 22.7
// us against a 19.0 us floor and ~20.9 back to back, and the norm's own hop
// is 1.9 us (BENCHMARKS.md 2026-12-07 17:52): the norm -> GEMV boundary is
// the largest cost left. The norm in the GEMV's prologue did not pay, since
// that GEMV's blocks are placed only as the GEMV before leaves; here they
// never leave.
//
//   phase A: out_a = W_a x_a (plain), every block over its tiles;
//   then each block loads its first tile of W_b (weights: no kernel writes
//   them), arrives at a grid counter and waits for every block's arrival;
//   phase B: s = round(residual + out_a) (block 0 stores it to
//   residual_out), out_b = W_b RMSNorm(s) with the rstd deferred to the
//   flush, as q4_gemv.cu's NORM prologue does.
//
// The grid wait needs every block resident at once: the launcher sizes the
// grid from the occupancy query and runs nothing beside it. `arrived` is
// zeroed once and only ever grows by gridDim.x a launch; a block waits for
// the next multiple of gridDim.x past its own ticket, so launches of one grid
// size share one counter. A wait that never ends traps instead of hanging.

// 16 bf16 pairs of group g, read through L2 (ld.global.cg): other blocks of
// this launch wrote them, so no non-coherent path may serve them
__device__ __forceinline__ void load_group_coherent(const u16* x, int g, unsigned (&raw)[16]) {
    const uint4* src = reinterpret_cast<const uint4*>(x + g * 32);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 v = __ldcg(src + i);
        raw[4 * i] = v.x; raw[4 * i + 1] = v.y; raw[4 * i + 2] = v.z; raw[4 * i + 3] = v.w;
    }
}

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// every block's writes before it are visible to every block after it
__device__ __forceinline__ void grid_wait(unsigned* arrived) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned ticket = atomicAdd(arrived, 1u);
        const unsigned target = (ticket / gridDim.x + 1u) * gridDim.x;
        unsigned spins = 0;
        while ((int)(load_acquire(arrived) - target) < 0) {
            if (++spins == (1u << 24)) __trap();   // a block never came: not resident
        }
    }
    __syncthreads();
}

// one GEMV's tiles from `index` on, the register pipeline of q4_gemv.cu
// (next holds tile `index`'s weights on entry); the flushed sums times
// `scale_of_row` (1, or the norm's deferred rstd) go to out
__device__ __forceinline__ void chain_tiles(Group (&next)[ROWS][SLOTS], int index, int n_rows,
                                            const Weight& weights, const XSlice (&xs)[SLOTS],
                                            u16* out, const float* squares, float eps,
                                            float (&partial)[FLUSH][ROWS][WARPS]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles = (n_rows + ROWS - 1) / ROWS;
    int held = 0, first_held = index;
    while (index < tiles) {
        const int following = index + gridDim.x;
        Group tile[ROWS][SLOTS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int j = 0; j < SLOTS; ++j) tile[r][j] = next[r][j];
        if (following < tiles) load_tile(next, following, n_rows, weights);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < SLOTS; ++j) acc += group_dot(tile[r][j], xs[j]);
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1)
                acc += __shfl_xor_sync(0xFFFFFFFFu, acc, offset);
            if (lane == 0) partial[held][r][warp] = acc;
        }
        ++held;
        if (held == FLUSH || following >= tiles) {
            const int t = threadIdx.x / ROWS, r = threadIdx.x % ROWS;
            const int n = (first_held + t * (int)gridDim.x) * ROWS + r;
            __syncthreads();
            if (threadIdx.x < held * ROWS && n < n_rows) {
                const float scale = squares != nullptr ? flush_scale(squares, eps) : 1.0f;
                out[n] = float_bf16(warp_total(partial, t, r) * scale);
            }
            __syncthreads();
            held = 0;
            first_held = following;
        }
        index = following;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
tandem_q4_chain(const u16* __restrict__ x_a, const uint4* __restrict__ qw_a,
                const scale_t* __restrict__ d_a, const signed char* __restrict__ sc_a,
                const scale_t* __restrict__ dmin_a, const signed char* __restrict__ m_a,
                u16* out_a, int n_a,
                const uint4* __restrict__ qw_b, const scale_t* __restrict__ d_b,
                const signed char* __restrict__ sc_b, const scale_t* __restrict__ dmin_b,
                const signed char* __restrict__ m_b, u16* __restrict__ out_b, int n_b,
                const u16* residual, const void* __restrict__ norm_w, float eps,
                u16* residual_out, unsigned* arrived) {
    __shared__ float partial[FLUSH][ROWS][WARPS];
    __shared__ float squares_of_warp[WARPS];
    __shared__ uint4 weight_stash[W_VECS][SLOTS * THREADS];
    const Weight a{qw_a, d_a, sc_a, dmin_a, m_a}, b{qw_b, d_b, sc_b, dmin_b, m_b};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    Group next[ROWS][SLOTS];
    if ((int)blockIdx.x < (n_a + ROWS - 1) / ROWS) load_tile(next, blockIdx.x, n_a, a);
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
        const int g = threadIdx.x + j * THREADS;
        if (SLOTS * THREADS == GROUPS || g < GROUPS)
            stash_norm_weight(static_cast<const norm_w_t*>(norm_w), g * 32, j, weight_stash);
    }
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    XSlice xs[SLOTS];
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
        const int g = threadIdx.x + j * THREADS;
        if (SLOTS * THREADS == GROUPS || g < GROUPS) {
            unsigned raw[16];
            load_group(x_a, g, raw);
            xs[j] = quantize_group(raw);
        } else {
            xs[j] = XSlice{};
        }
    }
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    chain_tiles(next, blockIdx.x, n_a, a, xs, out_a, nullptr, eps, partial);

    if ((int)blockIdx.x < (n_b + ROWS - 1) / ROWS) load_tile(next, blockIdx.x, n_b, b);
    grid_wait(arrived);

    float squares = 0.0f;
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
        const int g = threadIdx.x + j * THREADS;
        if (SLOTS * THREADS == GROUPS || g < GROUPS) {
            unsigned raw[16], add[16], weight[W_WORDS];
            load_group_coherent(residual, g, raw);
            load_group_coherent(out_a, g, add);
            add_residual(raw, add, residual_out, g);   // as residual_group: bitwise its s
            squares += group_squares(raw);
            stashed_norm_weight(weight_stash, j, weight);
            weighted_group(raw, weight);
            xs[j] = quantize_group(raw);
        } else {
            xs[j] = XSlice{};
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
    if (lane == 0) squares_of_warp[warp] = squares;   // read after the first flush's barrier
    chain_tiles(next, blockIdx.x, n_b, b, xs, out_b, squares_of_warp, eps, partial);
}
