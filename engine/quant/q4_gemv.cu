// The one-row DP4A GEMV for 4-bit codes in groups of 32, as CUDA C++ built by
// NVRTC at run time (engine/quant/gemv_cuda.py compiles it; the PyTorch
// reference is gemv.py's gemv_x8_reference). y[n] = sum_k w[n, k] x[k] with
// x quantized to int8 per group of 32 (scale amax / 127, codes
// floor(x * 127 / amax + 0.5)), exactly the Triton DP4A kernel's numerics.
//
// Why a second kernel beside the Triton one: Triton gives a 4-bit GEMV few
// bytes in flight (it will not pipeline loads that feed no tl.dot, and its
// shared-memory pipeline lost, BENCHMARKS.md 2026-12-04), and the step's
// GEMVs sit at 54-91% of their floor. Here:
//   * a thread owns SLOTS fixed groups of K (g = thread + j * THREADS) for
//     the whole launch, so it quantizes its slice of x once, into registers,
//     and never needs shared memory for x;
//   * a block owns ROWS rows at a time and walks the row tiles grid-stride
//     (a persistent grid): it loads the next tile's 16-byte group words and
//     scales while it multiplies the current one, so every thread keeps
//     2 x ROWS x SLOTS loads in flight;
//   * the first tile's weights are loaded before griddepcontrol.wait
//     (programmatic dependent launch): weights are never written by a
//     kernel, only x waits for the kernel before;
//   * FLUSH tiles' cross-warp sums wait in shared memory and are reduced
//     together, at one barrier pair per FLUSH tiles: with a barrier pair
//     every tile the warps of a block walk in step, and an SM whose only
//     block (down: 544 threads, one block an SM) sits at the barrier loads
//     nothing meanwhile.
//   * L2_PREFETCH=1: after its last tile each block asks L2 for its share of
//     the first rows of the projection that runs next (`prefetch`, up to
//     L2_REGIONS byte ranges: its codes and scales), so that DRAM streams
//     that weight through the small kernels between the two GEMVs (norms,
//     GDN steps, attention), which leave it idle.
//   * STAGES > 0: the tiles come through a ring of STAGES shared-memory
//     stages instead, each filled by bulk copies (cp.async.bulk, sm_90's
//     TMA engine) that one thread issues and an mbarrier counts in. Bytes
//     in flight then cost no registers: the register pipeline holds one
//     tile ahead (81 registers, 4 blocks of 160 threads an SM), which on
//     the H200 left the GEMVs at 71-91% of their floor where the H100's
//     reach 90-98% (BENCHMARKS.md 2026-12-05 19:22). A tile's rows are
//     contiguous in every array, so a stage is five copies; each warp
//     frees its stage (an `empty` mbarrier) as soon as it has read the
//     stage into registers, and thread 0 refills it with the block's tile
//     STAGES ahead.
//   (Each thread cp.async-copying its own entries of its next 2-3 tiles into
//   shared memory, no barrier needed, lost 27-38% on every shape on an
//   H100: L1 80% busy, each byte crossing it twice, and three blocks an SM
//   for the copies' shared memory; removed, BENCHMARKS.md 2026-12-07 13:40.)
//   * EARLY_L2_TILES=E > 0: before griddepcontrol.wait each block also asks
//     L2 (one bulk prefetch an array, sm_90) for its next E tiles, the ones
//     its first tile's registers do not hold, so that DRAM streams them
//     while the kernel before finishes; after the wait those loads hit L2.
//     SILU_MUL's tile is two ranges (its gate rows, and the up rows N / 2
//     further on): both are asked.
// (A tile queue, blocks taking their tiles from an atomic counter so that
// the grid ends together, lost 2-17 us on every 27B shape in two sweeps and
// was removed: BENCHMARKS.md 2026-12-04 21:16.)
//
// Layout (engine/quant/tensor.py): qweight uint8 [N, K/2] (byte j: k = 2j in
// its low nibble, 2j + 1 in its high one), so the four int32 words of group
// g hold k = 32g .. 32g + 31, low nibbles the even k and high the odd; sc and
// m int8 [N, K/32]; d and dmin [N, K/S], fp16 or fp32 (D_F32).
// NORM=1 (the add_rms_norm prologue): x is the residual stream and the
// kernel first computes s = round(x + pending) (HAS_PENDING), stores s into
// residual_out from block 0, and multiplies RMSNorm(s) instead of x (ZC:
// Qwen3.5's zero-centred s * rstd * (1 + w); else Llama's w * s * rstd; the
// weight bf16 or fp32, W_F32), so the norm's launch goes away. The row's
// rstd is deferred to the flush: it is one factor common to every group of
// x, so a group's int8 codes of s * (1 + w) (or w * s) are those of the
// normed row, and rstd multiplies the finished sums instead of x's scales.
// Every block covers all of K, so its own s^2 gives the row's norm; its
// warps publish their sums before the tile loop and the flush's barrier
// makes them visible, so the prologue has no barrier of its own and holds
// no group of s across one. (Not bitwise the norm's launch: that rounds
// s * rstd to bf16 before the GEMV quantizes it, this rounds s * (1 + w).)
// GATED=1 (GDN's output norm in the prologue of its out projection): x is
// the recurrence's output [heads x head_dim], `pending` the gate z, norm_w
// the [head_dim] weight; each head's HEAD_GROUPS groups sit on consecutive
// lanes of one warp, which sum its s^2 by shuffles: no barrier. The norm's
// launch goes away.
// SILU=1 (the MLP's activation in the prologue of its down projection): x
// is the gate_up row [2K] and the kernel multiplies SiLU(gate) * up, rounded
// as engine/fused's silu_mul stores it (the SiLU to bf16, then the product),
// so the activation's launch goes away. No reduction: each thread makes its
// own groups.
// CONV=1 (GDN's causal conv + SiLU in the epilogue of its in_proj, for one
// decode token): output rows n < conv.channels are the conv's input
// channels; the thread that writes row n rounds it to bf16 as the plain
// GEMV stores it, convolves it with the channel's window (zeros at position
// 0) and weights, stores SiLU of that instead, and writes the window after
// the token to conv.write_slot. A depthwise conv: channel n needs only row
// n, which one thread of one block writes, so no other thread reads the
// window it rewrites, even when the write slot is the slot it read (decode).
// The conv's launch goes away (gdn_kernels.conv_step, the reference).
// SILU_MUL=1 (the MLP's SiLU(gate) * up in the epilogue of its gate_up
// projection): the weight holds the gate rows then as many up rows, and a
// tile takes ROWS / 2 gate rows and the up rows that pair with them, so the
// flush has both sums of output j and writes SiLU(gate) * up, rounded as
// engine/fused's silu_mul stores it, to out[j]: the output is N / 2 wide and
// the activation's launch goes away. N a multiple of ROWS, ROWS even, the
// register pipeline (a ring stage copies contiguous rows).
// (Reading llama.cpp's Q4_K block header, one 16-byte word a superblock,
// in place of the four scale arrays ran twice as slow on every 27B shape on
// an H100 for 2.7% fewer bytes, and was removed: BENCHMARKS.md 2026-12-07
// 12:23.)
// Compile-time: ROWS, SLOTS, THREADS, GROUPS (K/32), GPS (groups per
// superblock, S/32), ASYM, D_F32, PDL, FLUSH (FLUSH x ROWS <= THREADS),
// STAGES (0: the register pipeline; else N a multiple of ROWS, and each
// stage's arrays whole 16-byte units: gemv_cuda.py's bulk_copyable),
// L2_PREFETCH, EARLY_L2_TILES, NORM, HAS_PENDING, ZC, W_F32, SILU, GATED with
// HEAD_GROUPS (a power of two up to 32) and ROUND; at most one of NORM,
// SILU, GATED; CONV with CONV_K (the conv's width), CONV_W_F32 and
// CONV_WIN_F32 (the weight's and the windows' dtype: fp32, else bf16);
// SILU_MUL; at most one of CONV and SILU_MUL.

typedef unsigned short u16;

// the byte ranges L2_PREFETCH reads ahead, passed by value (gemv_cuda.py's
// _Regions has the same layout); an empty range has bytes 0
constexpr int L2_REGIONS = 5;
struct L2Regions {
    const char* base[L2_REGIONS];
    unsigned bytes[L2_REGIONS];   // multiples of 16, from 16-byte aligned bases
};

// the conv step CONV=1 ends with, passed by value (gemv_cuda.py's _ConvStep
// has the same layout); unused (all zero) in other builds
struct ConvStep {
    const void* weight;           // [channels, CONV_K], CONV_W_F32 ? fp32 : bf16
    void* windows;                // [slots, channels, CONV_K - 1], CONV_WIN_F32 ? fp32 : bf16
    const long long* position;    // the token's position: 0 starts from a zero window
    const long long* in_slot;     // the window read; -1: a padding copy, left alone
    const long long* write_slot;  // where the window after the token goes; -1: nowhere
    long long slot_stride;        // elements from one slot's windows to the next
    int channels;                 // rows [0, channels) are convolved
};

#if D_F32
typedef float scale_t;
__device__ __forceinline__ float scale_float(float v) { return v; }
#else
typedef u16 scale_t;
__device__ __forceinline__ float scale_float(u16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}
#endif

__device__ __forceinline__ float bf16_float(unsigned v) { return __uint_as_float(v << 16); }

__device__ __forceinline__ u16 float_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// a float as the bf16 a store would leave it
__device__ __forceinline__ float rounded_bf16(float v) { return bf16_float(float_bf16(v)); }

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// read once per launch: keep it out of L1
__device__ __forceinline__ uint4 load_streamed(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

struct Group {        // one row's group of 32 codes and its scales, as loaded
    uint4 words;
    int sc, m;
    scale_t d, dmin;
};

// one projection's arrays (engine/quant/tensor.py's layout), as every tile
// helper reads them; the kernel's parameters, gathered
struct Weight {
    const uint4* __restrict__ qw;
    const scale_t* __restrict__ d;
    const signed char* __restrict__ sc;
    const scale_t* __restrict__ dmin;
    const signed char* __restrict__ m;
};

struct XSlice {       // one group of x as int8 codes, even k and odd k apart
    int even[4], odd[4];
    float scale, code_sum_scaled;
};

// an idle thread's group: it adds nothing to the row
__device__ __forceinline__ void clear_group(Group& e) {
    e.words = uint4{0u, 0u, 0u, 0u};
    e.sc = 0;
    e.d = 0;
#if ASYM
    e.m = 0;
    e.dmin = 0;
#endif
}

// the weight row of tile `index`'s row r
__device__ __forceinline__ long long tile_row(int index, int r, int n_rows) {
#if SILU_MUL
    constexpr int HALF = ROWS / 2;   // gate rows j.., then up rows n_rows / 2 + j..
    return (long long)(r < HALF ? 0 : n_rows / 2) + (long long)index * HALF + r % HALF;
#else
    return min(index * ROWS + r, n_rows - 1);   // rows past N repeat the last
#endif
}

__device__ __forceinline__ void load_tile(Group (&tile)[ROWS][SLOTS], int index, int n_rows,
                                          const Weight& weights) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const long long n = tile_row(index, r, n_rows);
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) {
            const int g = threadIdx.x + j * THREADS;
            Group& e = tile[r][j];
            if (SLOTS * THREADS == GROUPS || g < GROUPS) {   // folds away when none idle
                e.words = load_streamed(weights.qw + n * GROUPS + g);
                // __ldg: the early tiles' prefetch takes these pointers into
                // an asm with a memory clobber, after which nvcc no longer
                // proves them read-only and the scales lost ld.global.nc
                e.sc = __ldg(weights.sc + n * GROUPS + g);
                e.d = __ldg(weights.d + n * (GROUPS / GPS) + g / GPS);
#if ASYM
                e.m = __ldg(weights.m + n * GROUPS + g);
                e.dmin = __ldg(weights.dmin + n * (GROUPS / GPS) + g / GPS);
#endif
            } else {
                clear_group(e);
            }
        }
    }
}

// a group's 32 bf16 values as 16 words, k = 2i in the low half of word i
__device__ __forceinline__ void load_group(const u16* __restrict__ x, int g, unsigned (&raw)[16]) {
    const uint4* src = reinterpret_cast<const uint4*>(x + g * 32);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 v = src[i];
        raw[4 * i] = v.x; raw[4 * i + 1] = v.y; raw[4 * i + 2] = v.z; raw[4 * i + 3] = v.w;
    }
}

// code = floor(x * (127 / amax) + 0.5) in -127..127, as the Triton kernel
__device__ __forceinline__ XSlice quantize_group(const unsigned (&raw)[16]) {
    XSlice s;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i)
        amax = fmaxf(amax, fmaxf(fabsf(bf16_float(raw[i] & 0xFFFF)), fabsf(bf16_float(raw[i] >> 16))));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int code_sum = 0;
#pragma unroll
    for (int w = 0; w < 4; ++w) {         // word w: k = 8w .. 8w + 7 of the group
        unsigned even = 0, odd = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {     // raw[4w + b] holds k = 8w + 2b (low), 8w + 2b + 1
            const unsigned pair = raw[4 * w + b];
            const int lo = (int)fminf(fmaxf(floorf(bf16_float(pair & 0xFFFF) * inv + 0.5f), -127.0f), 127.0f);
            const int hi = (int)fminf(fmaxf(floorf(bf16_float(pair >> 16) * inv + 0.5f), -127.0f), 127.0f);
            code_sum += lo + hi;
            even |= ((unsigned)lo & 0xFFu) << (8 * b);
            odd |= ((unsigned)hi & 0xFFu) << (8 * b);
        }
        s.even[w] = (int)even;
        s.odd[w] = (int)odd;
    }
    s.scale = amax * (1.0f / 127.0f);
    s.code_sum_scaled = (float)code_sum * s.scale;
    return s;
}

#if NORM || GATED
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    return (unsigned)float_bf16(lo) | ((unsigned)float_bf16(hi) << 16);
}

// The norm weight, staged in shared memory before griddepcontrol.wait (no
// kernel writes it) in 16-byte loads: as 32 scalar loads a thread after the
// wait the prologue cost 4.5-4.9 us a GEMV where the norm's own launch cost
// 1.4-1.9 (BENCHMARKS.md 2026-12-04 18:58). Shared memory, not registers:
// held in registers across the s^2 barrier the words took the kernel from
// 96 to 122 registers, 4 to 3 blocks an SM at 160 threads.
#if W_F32
typedef float norm_w_t;
constexpr int W_WORDS = 32;       // k's fp32 bits in word k
__device__ __forceinline__ float weight_at(const unsigned (&w)[W_WORDS], int k) {
    return __uint_as_float(w[k]);
}
#else
typedef u16 norm_w_t;
constexpr int W_WORDS = 16;       // k = 2i in the low half of word i, as load_group
__device__ __forceinline__ float weight_at(const unsigned (&w)[W_WORDS], int k) {
    return bf16_float((k & 1) ? w[k >> 1] >> 16 : w[k >> 1] & 0xFFFF);
}
#endif
constexpr int W_VECS = W_WORDS / 4;   // a group's weights in 16-byte vectors

// vector i of slot j's group at stash[i][j * THREADS + thread]: a warp's
// 16-byte accesses are consecutive, so they take no bank conflicts. Copied
// by cp.async, global to shared without registers (through registers the
// loads in flight took the kernel from 96 to 104, 4 to 3 blocks an SM).
// .ca, through L1: every block reads the same weight (GATED: one 256-byte
// head weight for all ~50K threads), and with .cg (L2 only) GATED ran
// 74.9 us against 8.8 for the norm's launch and the GEMV (12-04 21:16; ncu:
// DRAM 4.8% busy, half the stalls on L1TEX): the guess is one L2 slice
// serving every copy. Untimed since the change.
// (the 32 weights from element `first` on: g * 32 for NORM, the group's place
// in its head for GATED)
__device__ __forceinline__ void stash_norm_weight(const norm_w_t* __restrict__ weight, int first,
                                                  int j, uint4 (*stash)[SLOTS * THREADS]) {
    const uint4* src = reinterpret_cast<const uint4*>(weight + first);
#pragma unroll
    for (int i = 0; i < W_VECS; ++i) {
        asm volatile("{ .reg .u64 a; .reg .u32 s;\n"
                     "  cvta.to.shared.u64 a, %0; cvt.u32.u64 s, a;\n"
                     "  cp.async.ca.shared.global [s], [%1], 16; }"
                     :: "l"(&stash[i][j * THREADS + threadIdx.x]), "l"(src + i) : "memory");
    }
}

// a thread reads back only what its own cp.async wrote: its wait suffices
__device__ __forceinline__ void stashed_norm_weight(uint4 (*stash)[SLOTS * THREADS], int j,
                                                    unsigned (&w)[W_WORDS]) {
    asm volatile("cp.async.wait_all;" ::: "memory");
#pragma unroll
    for (int i = 0; i < W_VECS; ++i) {
        const uint4 v = stash[i][j * THREADS + threadIdx.x];
        w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
}
#endif

#if GATED
// GDN's output norm of one group, as engine/fused's gated_rms_norm rounds it:
// round(w * round(x * rstd)) (the outer rounding only for a bf16 weight,
// ROUND) times SiLU(z) in fp32, to bf16
__device__ __forceinline__ void gated_group(unsigned (&raw)[16], const unsigned (&gate)[16],
                                            const unsigned (&weight)[W_WORDS], float rstd) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        float v[2] = {bf16_float(raw[i] & 0xFFFF), bf16_float(raw[i] >> 16)};
        const float z[2] = {bf16_float(gate[i] & 0xFFFF), bf16_float(gate[i] >> 16)};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float y = weight_at(weight, 2 * i + half) * rounded_bf16(v[half] * rstd);
#if ROUND
            y = rounded_bf16(y);
#endif
            v[half] = y * (z[half] / (1.0f + __expf(-z[half])));
        }
        raw[i] = pack_bf16(v[0], v[1]);
    }
}
#endif

#if NORM
// s = round(x + pending) for group g (stored by block 0), its sum of squares
__device__ __forceinline__ float residual_group(const u16* __restrict__ x,
                                                const u16* __restrict__ pending,
                                                u16* __restrict__ residual_out, int g,
                                                unsigned (&raw)[16]) {
    load_group(x, g, raw);
#if HAS_PENDING
    unsigned add[16];
    load_group(pending, g, add);
#pragma unroll
    for (int i = 0; i < 16; ++i)
        raw[i] = pack_bf16(bf16_float(raw[i] & 0xFFFF) + bf16_float(add[i] & 0xFFFF),
                           bf16_float(raw[i] >> 16) + bf16_float(add[i] >> 16));
    if (blockIdx.x == 0) {
        uint4* dst = reinterpret_cast<uint4*>(residual_out + g * 32);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            dst[i] = uint4{raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]};
    }
#endif
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const float lo = bf16_float(raw[i] & 0xFFFF), hi = bf16_float(raw[i] >> 16);
        squares += lo * lo + hi * hi;
    }
    return squares;
}

// a group of RMSNorm(s) before its rstd, as bf16 words: s * (1 + w) (ZC)
// or w * s; rstd, common to the whole row, scales the sums at the flush
__device__ __forceinline__ void weighted_group(unsigned (&raw)[16],
                                               const unsigned (&weight)[W_WORDS]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        float v[2] = {bf16_float(raw[i] & 0xFFFF), bf16_float(raw[i] >> 16)};
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const float w = weight_at(weight, 2 * i + half);
#if ZC
            v[half] = v[half] * (1.0f + w);
#else
            v[half] = w * v[half];
#endif
        }
        raw[i] = pack_bf16(v[0], v[1]);
    }
}
#endif

#if SILU
// group g of SiLU(gate) * up as bf16 words; gate_up holds gate then up
__device__ __forceinline__ void activated_group(const u16* __restrict__ gate_up, int g,
                                                unsigned (&raw)[16]) {
    unsigned up[16];
    load_group(gate_up, g, raw);
    load_group(gate_up + GROUPS * 32, g, up);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const float gate_lo = bf16_float(raw[i] & 0xFFFF), gate_hi = bf16_float(raw[i] >> 16);
        const float act_lo = rounded_bf16(gate_lo / (1.0f + __expf(-gate_lo)));
        const float act_hi = rounded_bf16(gate_hi / (1.0f + __expf(-gate_hi)));
        raw[i] = (unsigned)float_bf16(act_lo * bf16_float(up[i] & 0xFFFF))
                 | ((unsigned)float_bf16(act_hi * bf16_float(up[i] >> 16)) << 16);
    }
}
#endif

#if L2_PREFETCH || EARLY_L2_TILES
// the whole 16-byte units of [base, base + bytes) asked of L2 (sm_90's bulk
// prefetch, which takes 16-byte aligned ranges only and nothing waits for)
__device__ __forceinline__ void prefetch_range_l2(const void* base, long long bytes) {
    const unsigned long long lo = ((unsigned long long)base + 15ull) & ~15ull;
    const unsigned long long hi = ((unsigned long long)base + (unsigned long long)bytes) & ~15ull;
    if (hi > lo)
        asm volatile("{ .reg .u64 a;\n"
                     "  cvta.to.global.u64 a, %0;\n"
                     "  cp.async.bulk.prefetch.L2.global [a], %1; }"
                     :: "l"(lo), "r"((unsigned)(hi - lo)) : "memory");
}
#endif

#if L2_PREFETCH
// this block's share of each range, in 16-byte multiples
__device__ __forceinline__ void prefetch_share(const L2Regions& regions) {
#pragma unroll
    for (int i = 0; i < L2_REGIONS; ++i) {
        const unsigned bytes = regions.bytes[i];
        const unsigned share = (bytes + gridDim.x * 16u - 1u) / (gridDim.x * 16u) * 16u;
        const unsigned first = blockIdx.x * share;
        if (share == 0u || first >= bytes) continue;
        prefetch_range_l2(regions.base[i] + first, min(share, bytes - first));
    }
}
#endif

#if EARLY_L2_TILES
// rows [first, first + rows) of every array into L2
__device__ __forceinline__ void prefetch_rows_l2(long long first, long long rows,
                                                 const Weight& weights) {
    prefetch_range_l2(weights.qw + first * GROUPS, rows * GROUPS * 16);
    prefetch_range_l2(weights.sc + first * GROUPS, rows * GROUPS);
    prefetch_range_l2(weights.d + first * (GROUPS / GPS), rows * (GROUPS / GPS) * (long long)sizeof(scale_t));
#if ASYM
    prefetch_range_l2(weights.m + first * GROUPS, rows * GROUPS);
    prefetch_range_l2(weights.dmin + first * (GROUPS / GPS), rows * (GROUPS / GPS) * (long long)sizeof(scale_t));
#endif
}

// tile `index`'s rows into L2 (SILU_MUL's tile is two ranges, its gate rows
// and its up rows, where tile_row puts them); one thread issues it
__device__ __forceinline__ void prefetch_tile_l2(int index, int n_rows,
                                                 const Weight& weights) {
#if SILU_MUL
    constexpr int HALF = ROWS / 2;   // N is a multiple of ROWS: both halves whole
    prefetch_rows_l2(tile_row(index, 0, n_rows), HALF, weights);
    prefetch_rows_l2(tile_row(index, HALF, n_rows), HALF, weights);
#else
    const long long first = (long long)index * ROWS;
    prefetch_rows_l2(first, min((long long)ROWS, (long long)n_rows - first), weights);
#endif
}
#endif

#if STAGES
// A stage: the tile's ROWS rows of words, then of sc, d (and m, dmin), each
// contiguous in global memory from row index * ROWS on
constexpr int WORD_BYTES = ROWS * GROUPS * 16;
constexpr int SC_BYTES = ROWS * GROUPS;
constexpr int D_BYTES = ROWS * (GROUPS / GPS) * (int)sizeof(scale_t);
constexpr int SC_AT = WORD_BYTES;
constexpr int D_AT = SC_AT + SC_BYTES;
#if ASYM
constexpr int M_AT = D_AT + D_BYTES;
constexpr int DMIN_AT = M_AT + SC_BYTES;
constexpr int STAGE_BYTES = DMIN_AT + D_BYTES;
#else
constexpr int STAGE_BYTES = D_AT + D_BYTES;
#endif
static_assert(SC_BYTES % 16 == 0 && D_BYTES % 16 == 0,
              "a bulk copy moves whole 16-byte units: gemv_cuda.bulk_copyable refuses this plan");

__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
    return s;
}

__device__ __forceinline__ void barrier_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;"
                 :: "r"(shared_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void barrier_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];"
                 :: "r"(shared_address(bar)) : "memory");
}

__device__ __forceinline__ void barrier_wait(unsigned long long* bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{ .reg .pred p;\n"
                     "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "  selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(shared_address(bar)), "r"(parity) : "memory");
    } while (!done);
}

__device__ __forceinline__ void bulk_copy(unsigned char* dst, const void* src, unsigned bytes,
                                          unsigned long long* full) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];"
                 :: "r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(full))
                 : "memory");
}

// tile `index` into `stage`; `full` completes once its bytes have landed
__device__ __forceinline__ void fill_stage(unsigned char* stage, unsigned long long* full,
                                           int index, const Weight& weights) {
    const long long row = (long long)index * ROWS;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(shared_address(full)), "r"((unsigned)STAGE_BYTES) : "memory");
    bulk_copy(stage, weights.qw + row * GROUPS, WORD_BYTES, full);
    bulk_copy(stage + SC_AT, weights.sc + row * GROUPS, SC_BYTES, full);
    bulk_copy(stage + D_AT, weights.d + row * (GROUPS / GPS), D_BYTES, full);
#if ASYM
    bulk_copy(stage + M_AT, weights.m + row * GROUPS, SC_BYTES, full);
    bulk_copy(stage + DMIN_AT, weights.dmin + row * (GROUPS / GPS), D_BYTES, full);
#endif
}

// this thread's groups of the stage's rows, as load_tile gives them
__device__ __forceinline__ void read_stage(Group (&tile)[ROWS][SLOTS],
                                           const unsigned char* stage) {
    const uint4* words = reinterpret_cast<const uint4*>(stage);
    const signed char* sc = reinterpret_cast<const signed char*>(stage + SC_AT);
    const scale_t* d = reinterpret_cast<const scale_t*>(stage + D_AT);
#if ASYM
    const signed char* m = reinterpret_cast<const signed char*>(stage + M_AT);
    const scale_t* dmin = reinterpret_cast<const scale_t*>(stage + DMIN_AT);
#endif
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < SLOTS; ++j) {
            const int g = threadIdx.x + j * THREADS;
            Group& e = tile[r][j];
            if (SLOTS * THREADS == GROUPS || g < GROUPS) {
                e.words = words[r * GROUPS + g];
                e.sc = sc[r * GROUPS + g];
                e.d = d[r * (GROUPS / GPS) + g / GPS];
#if ASYM
                e.m = m[r * GROUPS + g];
                e.dmin = dmin[r * (GROUPS / GPS) + g / GPS];
#endif
            } else {
                clear_group(e);
            }
        }
    }
}
#endif

#if CONV
#if CONV_WIN_F32
typedef float window_t;
__device__ __forceinline__ float window_float(float v) { return v; }
__device__ __forceinline__ float window_store(float v) { return v; }
#else
typedef u16 window_t;
__device__ __forceinline__ float window_float(u16 v) { return bf16_float(v); }
__device__ __forceinline__ u16 window_store(float v) { return float_bf16(v); }
#endif

struct ConvTaps {     // one channel's window (its last CONV_K - 1 inputs) and weights
    float window[CONV_K - 1];
    float weight[CONV_K];
};

// loaded before the flush's barrier, so that their latency passes behind it
__device__ __forceinline__ ConvTaps load_taps(const ConvStep& conv, int n, long long slot,
                                              bool warm) {
    ConvTaps taps;
    const window_t* window = static_cast<const window_t*>(conv.windows)
                             + (warm ? slot : 0) * conv.slot_stride + (long long)n * (CONV_K - 1);
#pragma unroll
    for (int j = 0; j < CONV_K - 1; ++j) taps.window[j] = warm ? window_float(window[j]) : 0.0f;
#pragma unroll
    for (int j = 0; j < CONV_K; ++j) {
#if CONV_W_F32
        taps.weight[j] = static_cast<const float*>(conv.weight)[(long long)n * CONV_K + j];
#else
        taps.weight[j] = bf16_float(static_cast<const u16*>(conv.weight)[(long long)n * CONV_K + j]);
#endif
    }
    return taps;
}

// SiLU of channel n's conv over its window and y, the new input as the plain
// GEMV stores it; the window after y goes to slot dst (-1: nowhere)
__device__ __forceinline__ float conv_channel(const ConvStep& conv, const ConvTaps& taps, int n,
                                              float y, long long dst) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < CONV_K - 1; ++j) acc += taps.window[j] * taps.weight[j];
    acc += y * taps.weight[CONV_K - 1];
    if (dst >= 0) {
        window_t* window = static_cast<window_t*>(conv.windows) + dst * conv.slot_stride
                           + (long long)n * (CONV_K - 1);
#pragma unroll
        for (int j = 0; j < CONV_K - 2; ++j) window[j] = window_store(taps.window[j + 1]);
        window[CONV_K - 2] = window_store(y);
    }
    return acc / (1.0f + __expf(-acc));
}
#endif

__device__ __forceinline__ float group_dot(const Group& e, const XSlice& x) {
    int dot = 0;
    const unsigned w[4] = {e.words.x, e.words.y, e.words.z, e.words.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        dot = dp4a((int)(w[i] & 0x0F0F0F0Fu), x.even[i], dot);
        dot = dp4a((int)((w[i] >> 4) & 0x0F0F0F0Fu), x.odd[i], dot);
    }
    float part = (float)dot * (scale_float(e.d) * (float)e.sc) * x.scale;
#if ASYM
    part -= scale_float(e.dmin) * (float)e.m * x.code_sum_scaled;
#endif
    return part;
}

constexpr int WARPS = THREADS / 32;

// the sum of flushed tile t's row r over the block's warps, in warp order:
// the same order in every build, so an epilogue sees the plain GEMV's sums
__device__ __forceinline__ float warp_total(const float (&partial)[FLUSH][ROWS][WARPS], int t,
                                            int r) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += partial[t][r][w];
    return total;
}

// what the flushed sums are multiplied by: NORM's deferred rstd, from its
// warps' sums of s^2 (`squares`, published before the tile loop and visible
// after the flush's barrier) added in warp order, the same in every thread
// and block; else 1
__device__ __forceinline__ float flush_scale(const float* squares, float eps) {
#if NORM
    float row = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) row += squares[w];
    return rsqrtf(row / (float)(GROUPS * 32) + eps);
#else
    return 1.0f;
#endif
}

// GATED asks for two blocks an SM: left alone ptxas gave it 140 registers.
// It takes 112 then and spills nothing, yet the driver still runs two
// 192-thread blocks an SM, not three (H200 12-04 21:40: the occupancy query
// and ncu's "Block Limit Registers" both say 2)
#if GATED
#define GEMV_BOUNDS __launch_bounds__(THREADS, 2)
#else
#define GEMV_BOUNDS __launch_bounds__(THREADS)
#endif
extern "C" __global__ void GEMV_BOUNDS
tandem_q4_gemv(const u16* __restrict__ x, const uint4* __restrict__ qw,
               const scale_t* __restrict__ d, const signed char* __restrict__ sc,
               const scale_t* __restrict__ dmin, const signed char* __restrict__ m,
               u16* __restrict__ out, int n_rows,
               const u16* __restrict__ pending, const void* __restrict__ norm_w,
               float eps, u16* __restrict__ residual_out, const L2Regions prefetch,
               const ConvStep conv) {
    __shared__ float partial[FLUSH][ROWS][WARPS];
#if NORM
    __shared__ float squares_of_warp[WARPS];
    const float* const norm_squares = squares_of_warp;
#else
    const float* const norm_squares = nullptr;
#endif
    const Weight weights{qw, d, sc, dmin, m};
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles = (n_rows + ROWS - 1) / ROWS;
    int index = blockIdx.x;
#if STAGES
    extern __shared__ __align__(16) unsigned char ring[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            barrier_init(&full[s], 1);        // thread 0's arrive, with the stage's bytes
            barrier_init(&empty[s], WARPS);   // every warp has read the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0) {   // weights: no kernel writes them, so before the wait
#pragma unroll
        for (int s = 0; s < STAGES; ++s)
            if (index + s * (int)gridDim.x < tiles)
                fill_stage(ring + s * STAGE_BYTES, &full[s], index + s * gridDim.x, weights);
    }
    int taken = 0;            // tiles this block has read from the ring
#else
    Group next[ROWS][SLOTS];
    if (index < tiles)
        load_tile(next, index, n_rows, weights);
#endif
#if NORM || GATED
    __shared__ uint4 weight_stash[W_VECS][SLOTS * THREADS];
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
        const int g = threadIdx.x + j * THREADS;
#if GATED
        const int first = (g % HEAD_GROUPS) * 32;
#else
        const int first = g * 32;
#endif
        if (SLOTS * THREADS == GROUPS || g < GROUPS)
            stash_norm_weight(static_cast<const norm_w_t*>(norm_w), first, j, weight_stash);
    }
#endif
#if EARLY_L2_TILES && !STAGES
    if (threadIdx.x == 0) {
#pragma unroll
        for (int e = 1; e <= EARLY_L2_TILES; ++e)
            if (index + e * (int)gridDim.x < tiles)
                prefetch_tile_l2(index + e * gridDim.x, n_rows, weights);
    }
#endif
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if CONV
    // read once, after the wait (an earlier kernel may write them); used at each flush
    const long long conv_slot = *conv.in_slot;
    const bool conv_live = conv_slot >= 0;
    const bool conv_warm = conv_live && *conv.position > 0;
    const long long conv_dst = conv_live ? *conv.write_slot : -1;
#endif
    XSlice xs[SLOTS];
#if GATED
    // each head's s^2 over its HEAD_GROUPS lanes; every lane shuffles (an
    // idle one adds 0), so the shuffles see a whole warp
    unsigned head_raw[SLOTS][16], gate_raw[SLOTS][16];
    float head_rstd[SLOTS];
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
        const int g = threadIdx.x + j * THREADS;
        float squares = 0.0f;
        if (SLOTS * THREADS == GROUPS || g < GROUPS) {
            load_group(x, g, head_raw[j]);
            load_group(pending, g, gate_raw[j]);
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const float lo = bf16_float(head_raw[j][i] & 0xFFFF);
                const float hi = bf16_float(head_raw[j][i] >> 16);
                squares += lo * lo + hi * hi;
            }
        }
#pragma unroll
        for (int offset = 1; offset < HEAD_GROUPS; offset <<= 1)
            squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
        head_rstd[j] = rsqrtf(squares / (float)(HEAD_GROUPS * 32) + eps);
    }
#endif
#if NORM
    float squares = 0.0f;
#endif
#pragma unroll
    for (int j = 0; j < SLOTS; ++j) {
        const int g = threadIdx.x + j * THREADS;
        if (SLOTS * THREADS == GROUPS || g < GROUPS) {
#if NORM
            unsigned raw[16], weight[W_WORDS];   // this thread's own stash: no barrier needed
            squares += residual_group(x, pending, residual_out, g, raw);
            stashed_norm_weight(weight_stash, j, weight);
            weighted_group(raw, weight);
            xs[j] = quantize_group(raw);
#elif GATED
            unsigned weight[W_WORDS];
            stashed_norm_weight(weight_stash, j, weight);
            gated_group(head_raw[j], gate_raw[j], weight, head_rstd[j]);
            xs[j] = quantize_group(head_raw[j]);
#else
            unsigned group_raw[16];
#if SILU
            activated_group(x, g, group_raw);
#else
            load_group(x, g, group_raw);
#endif
            xs[j] = quantize_group(group_raw);
#endif
        } else {
            xs[j] = XSlice{};   // zero codes and scales: an idle slot adds nothing
        }
    }
#if NORM
    // read only after the first flush's barrier: published without one here
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        squares += __shfl_xor_sync(0xFFFFFFFFu, squares, offset);
    if (lane == 0) squares_of_warp[warp] = squares;
#endif
    // (Released only as each block's last tile began, so that a GEMV's first
    // tiles would not meet the one before's stream, the int4 step lost
    // 0.18 ms on an H100: the kernel after a GEMV is then launched too late
    // to be ready at its end. Removed, BENCHMARKS.md 2026-12-07 15:17.)
#if PDL
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    int held = 0;                 // tiles whose sums wait in partial
    int first_held = index;       // the first of them; the others follow by gridDim.x
    while (index < tiles) {
        const int following = index + gridDim.x;
        Group tile[ROWS][SLOTS];
#if STAGES
        {
            const int s = taken % STAGES;
            const unsigned parity = (taken / STAGES) & 1;
            unsigned char* stage = ring + s * STAGE_BYTES;
            barrier_wait(&full[s], parity);
            read_stage(tile, stage);
            __syncwarp();
            if (lane == 0) barrier_arrive(&empty[s]);
            const int refill = index + STAGES * (int)gridDim.x;
            if (threadIdx.x == 0 && refill < tiles) {
                barrier_wait(&empty[s], parity);
                fill_stage(stage, &full[s], refill, weights);
            }
            ++taken;
        }
#else
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int j = 0; j < SLOTS; ++j) tile[r][j] = next[r][j];
        if (following < tiles)
            load_tile(next, following, n_rows, weights);
#endif
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            acc[r] = 0.0f;
#pragma unroll
            for (int j = 0; j < SLOTS; ++j) acc[r] += group_dot(tile[r][j], xs[j]);
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1)
                acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], offset);
            if (lane == 0) partial[held][r][warp] = acc[r];
        }
        ++held;
        if (held == FLUSH || following >= tiles) {   // the same in every thread of the block
#if SILU_MUL
            constexpr int HALF = ROWS / 2;
            __syncthreads();
            if (threadIdx.x < held * HALF) {
                const int t = threadIdx.x / HALF, r = threadIdx.x % HALF;
                const float scale = flush_scale(norm_squares, eps);
                // rounded as the plain GEMV stores them
                const float gate = rounded_bf16(warp_total(partial, t, r) * scale);
                const float up = rounded_bf16(warp_total(partial, t, r + HALF) * scale);
                const float act = rounded_bf16(gate / (1.0f + __expf(-gate)));
                out[(first_held + t * (int)gridDim.x) * HALF + r] = float_bf16(act * up);
            }
#else
            const int t = threadIdx.x / ROWS, r = threadIdx.x % ROWS;
            const int n = (first_held + t * (int)gridDim.x) * ROWS + r;
#if CONV
            const bool convolved = threadIdx.x < held * ROWS && n < conv.channels && conv_live;
            ConvTaps taps;
            if (convolved) taps = load_taps(conv, n, conv_slot, conv_warm);
#endif
            __syncthreads();
            if (threadIdx.x < held * ROWS) {
                float total = warp_total(partial, t, r) * flush_scale(norm_squares, eps);
#if CONV
                if (convolved) total = conv_channel(conv, taps, n, rounded_bf16(total), conv_dst);
#endif
                if (n < n_rows) out[n] = float_bf16(total);
            }
#endif
            __syncthreads();   // partial is rewritten by the next tiles
            held = 0;
            first_held = following;
        }
        index = following;
    }
#if L2_PREFETCH
    if (threadIdx.x == 0) prefetch_share(prefetch);
#endif
}
