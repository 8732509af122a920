// A probe, not an engine kernel (bench/chain_probe.py builds and times it):
// two one-row DP4A GEMVs and the add_rms_norm between them in ONE persistent
// launch, so that the second GEMV's blocks are resident, with their first
// tile in registers, before the first GEMV ends. Appended to
// engine/quant/q4_gemv.cu's source and built with its NORM prologue flags
// (NORM=1, HAS_PENDING=1, STAGES=0, EARLY_L2_TILES=1, L2_PREFETCH=0) and
// the SECOND GEMV's shape as the build's (ROWS, SLOTS, THREADS, GROUPS,
// FLUSH), whose helpers it calls.
//
// Why: on the H200 each of the int4 step's 129 GEMVs after a norm takes 22.7
// us against a 19.0 us floor and ~20.9 back to back, and the norm's own hop
// is 1.9 us (BENCHMARKS.md 2026-12-07 17:52): the norm -> GEMV boundary is
// the largest cost left. The norm in the GEMV's prologue did not pay, since
// that GEMV's blocks are placed only as the GEMV before leaves; here they
// never leave.
//
//   phase A: out_a = W_a x_a (plain), in blocks of CHAIN_THREADS threads
//   walking tiles of A_ROWS rows, A_SLOTS groups a thread (K_a = A_GROUPS
//   groups), flushing A_FLUSH tiles at once;
//   then each block loads its first tiles of W_b (weights: no kernel writes
//   them), arrives at a grid counter and waits for every block's arrival;
//   phase B: s = round(residual + out_a) (one part of block 0 stores it to
//   residual_out), out_b = W_b RMSNorm(s) with the rstd deferred to the
//   flush, as q4_gemv.cu's NORM prologue does, in PARTS parts of THREADS
//   threads a block, each part a GEMV block of its own (its tiles, its
//   flush barrier); threads past PARTS x THREADS idle in phase B.
//
// The 27B's boundaries need two shapes in one block: the out projections
// (K = 6144: 192 threads, one group each) before gate_up (K = 5120: 160),
// and down (K = 17408: 544 threads, one block an SM) before in_proj or qkv,
// whose three parts of 160 threads then stand for three of their blocks.
// A shared 160-thread block would cost down its registers: at 4 slots a
// thread it takes 126 (rows 1) to 220 (rows 2), at most 3 blocks an SM
// (NVRTC sm_90, 12-07), where at 544 threads it takes 89.
//
// The grid wait needs every block resident at once: the launcher sizes the
// grid from the occupancy query and runs nothing beside it. `arrived` is
// zeroed once and only ever grows by gridDim.x a launch; a block waits for
// the next multiple of gridDim.x past its own ticket, so launches of one grid
// size share one counter. A wait that never ends traps instead of hanging.

using ShapeA = TileShape<A_ROWS, A_SLOTS, CHAIN_THREADS, A_GROUPS>;
using ShapeB = BuildShape;   // one part's

static_assert(A_SLOTS * CHAIN_THREADS >= A_GROUPS, "phase A's slots cover K_a");
static_assert(PARTS * THREADS <= CHAIN_THREADS, "phase B's parts fit the block");
static_assert(PARTS <= 15, "a named barrier a part (ids 1..15)");

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

// the threads that walk one GEMV's tiles together, as flush_tiles sees
// them: phase A's whole block (barrier 0, tiles grid-stride), or one part of
// phase B (named barrier 1 + part, THREADS threads; __syncthreads where the
// part is the whole block), its tiles PARTS x the grid apart
struct Team {
    unsigned thread_;
    int stride_, part;
    bool whole_block;
    __device__ __forceinline__ unsigned thread() const { return thread_; }
    __device__ __forceinline__ int stride() const { return stride_; }
    __device__ __forceinline__ void sync() const {
        if (whole_block)
            __syncthreads();
        else
            asm volatile("bar.sync %0, %1;" :: "r"(1 + part), "r"(THREADS) : "memory");
    }
};

// one GEMV's tiles index, index + stride, ... through q4_gemv.cu's register
// pipeline (next holds tile `index`'s weights on entry) and flush: SCALED by
// the norm's deferred rstd from `squares`, CONVOLVED by the build's conv
template <class Shape, bool SCALED, bool CONVOLVED, int F>
__device__ __forceinline__ void walk_tiles(Group (&next)[Shape::rows][Shape::slots], int index,
                                           int n_rows, const Weight& weights,
                                           const XSlice (&xs)[Shape::slots], u16* out,
                                           const float* squares, float eps,
                                           float (&partial)[F][Shape::rows][Shape::warps],
                                           const ConvStep conv, const ConvLive live,
                                           const Team& team) {
    const int lane = team.thread() & 31, warp = team.thread() >> 5;
    const int tiles = (n_rows + Shape::rows - 1) / Shape::rows;
    int held = 0, first_held = index;
    while (index < tiles) {
        const int following = index + team.stride();
        Group tile[Shape::rows][Shape::slots];
        take_tile<Shape>(tile, next, following, tiles, n_rows, weights, team.thread());
        accumulate_tile(tile, xs, partial, held, lane, warp);
        ++held;
        if (held == F || following >= tiles) {
            flush_tiles<Shape, SCALED, CONVOLVED>(partial, held, first_held, out, n_rows,
                                                  squares, eps, conv, live, team);
            held = 0;
            first_held = following;
        }
        index = following;
    }
}

extern "C" __global__ void __launch_bounds__(CHAIN_THREADS, CHAIN_MIN_BLOCKS)
tandem_q4_chain(const u16* __restrict__ x_a, const uint4* __restrict__ qw_a,
                const scale_t* __restrict__ d_a, const signed char* __restrict__ sc_a,
                const scale_t* __restrict__ dmin_a, const signed char* __restrict__ m_a,
                u16* out_a, int n_a,
                const uint4* __restrict__ qw_b, const scale_t* __restrict__ d_b,
                const signed char* __restrict__ sc_b, const scale_t* __restrict__ dmin_b,
                const signed char* __restrict__ m_b, u16* __restrict__ out_b, int n_b,
                const u16* residual, const void* __restrict__ norm_w, float eps,
                u16* residual_out, unsigned* arrived, const ConvStep conv) {
    __shared__ float partial_a[A_FLUSH][A_ROWS][ShapeA::warps];
    __shared__ float partial_b[PARTS][FLUSH][ROWS][WARPS];
    __shared__ float squares_of_warp[PARTS][WARPS];
    __shared__ uint4 weight_stash[W_VECS][SLOTS * CHAIN_THREADS];
    const Weight a{qw_a, d_a, sc_a, dmin_a, m_a}, b{qw_b, d_b, sc_b, dmin_b, m_b};
    const Team block{threadIdx.x, (int)gridDim.x, 0, true};
    // PARTS 1: part 0 at compile time, so the part's indices fold away
    constexpr bool WHOLE = PARTS * THREADS == CHAIN_THREADS;
    const int part = PARTS == 1 ? 0 : threadIdx.x / THREADS;
    const Team team{threadIdx.x - part * THREADS, (int)gridDim.x * PARTS, part,
                    WHOLE && PARTS == 1};
    const bool in_b = WHOLE || (int)threadIdx.x < PARTS * THREADS;

    Group next_a[A_ROWS][A_SLOTS];
    if ((int)blockIdx.x < (n_a + A_ROWS - 1) / A_ROWS)
        load_tile<ShapeA>(next_a, blockIdx.x, n_a, a, threadIdx.x);
    if (in_b) {
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) {
            const int g = team.thread() + j * THREADS;
            if (SLOTS * THREADS == GROUPS || g < GROUPS)
                stash_norm_weight<CHAIN_THREADS>(static_cast<const norm_w_t*>(norm_w), g * 32, j,
                                                 weight_stash);
        }
    }
    // each GEMV's second tile asked of L2 before its wait, as the step's
    // GEMVs do (EARLY_L2_TILES=1, their default)
    if (threadIdx.x == 0 && (int)(blockIdx.x + gridDim.x) < (n_a + A_ROWS - 1) / A_ROWS)
        prefetch_tile_l2<ShapeA>(blockIdx.x + gridDim.x, n_a, a);
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const ConvLive live = conv_live_of(conv);   // the second GEMV's epilogue, if CONV
    XSlice xs_a[A_SLOTS];
#pragma unroll
    for (int j = 0; j < A_SLOTS; ++j) {
        const int g = threadIdx.x + j * CHAIN_THREADS;
        if (A_SLOTS * CHAIN_THREADS == A_GROUPS || g < A_GROUPS) {
            unsigned raw[16];
            load_group(x_a, g, raw);
            xs_a[j] = quantize_group(raw);
        } else {
            xs_a[j] = XSlice{};
        }
    }
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    walk_tiles<ShapeA, false, false>(next_a, blockIdx.x, n_a, a, xs_a, out_a, nullptr, eps,
                                     partial_a, conv, live, block);

    const int index_b = blockIdx.x * PARTS + part, stride_b = team.stride();
    Group next_b[ROWS][SLOTS];
    if (in_b && index_b < (n_b + ROWS - 1) / ROWS)
        load_tile<ShapeB>(next_b, index_b, n_b, b, team.thread());
    if (in_b && team.thread() == 0 && index_b + stride_b < (n_b + ROWS - 1) / ROWS)
        prefetch_tile_l2<ShapeB>(index_b + stride_b, n_b, b);
    grid_wait(arrived);
    if (!in_b) return;   // after the last __syncthreads: the parts' barriers are named

    XSlice xs_b[SLOTS];
    float squares = 0.0f;
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
        const int g = team.thread() + j * THREADS;
        if (SLOTS * THREADS == GROUPS || g < GROUPS) {
            unsigned raw[16], add[16], weight[W_WORDS];
            // through L2: other blocks of this launch wrote out_a (the
            // residual, beside it, takes the same path)
            load_group<true>(residual, g, raw);
            load_group<true>(out_a, g, add);
            // as residual_group: bitwise its s
            add_residual(raw, add, residual_out, g, blockIdx.x == 0 && part == 0);
            squares += group_squares(raw);
            stashed_norm_weight<CHAIN_THREADS>(weight_stash, j, weight);
            weighted_group(raw, weight);
            xs_b[j] = quantize_group(raw);
        } else {
            xs_b[j] = XSlice{};
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
    // read after the part's first flush barrier
    if ((team.thread() & 31) == 0) squares_of_warp[part][team.thread() >> 5] = squares;
    walk_tiles<ShapeB, true, CONV != 0>(next_b, index_b, n_b, b, xs_b, out_b,
                                        squares_of_warp[part], eps, partial_b[part], conv, live,
                                        team);
}
