// conv2d.cu: 2-D convolution (cross-correlation) as implicit GEMM, float32, NCHW, zero padding.
//
// One shared-memory tiled, register-blocked GEMM body C[M][NG] = sum_kk A[M][KR] * B[KR][NG] with
// three index mappings (MODE), so no im2col matrix is ever written to memory:
//
//   kernel                 M   NG        KR        A[m][kk]              B[kk][j]                   C[m][j]
//   conv2d_fprop           K   N*P*Q     C*R*S     w[m][c,r,s]           x[n][c][p*st-pad+r][..]    y[n][m][p][q] (+bias, relu)
//   conv2d_dgrad           C   N*H*W     K*R*S     w[k][m][r][s]         dy[n][k][p][q], p*st=h+pad-r  dx[n][m][h][w]
//   conv2d_fprop_partial   as conv2d_fprop, kk in split z's range                              ws[z][m][j]
//   conv2d_dgrad_partial   as conv2d_dgrad, kk in split z's range                              ws[z][m][j]
//   conv2d_wgrad_partial   K   C*R*S     N*P*Q     dy[n][m][p][q]        x[n][c][p*st-pad+r][..]    ws[z][m][j]
//   conv2d_split_reduce    out = sum over z = 0..splits-1 of ws[z], in that order, into NCHW (+bias, relu)
//
// relu: max(v, 0) with NaN propagated (relu(NaN) = NaN, as np.maximum and numpy_ops.relu_fprop), see
// conv_relu. The sums propagate NaN and +-inf as IEEE arithmetic does (inf - inf = NaN), in any order.
//
// Shapes: x (N, C, H, W), w (K, C, R, S), bias (K,) or NULL, y / dy (N, K, P, Q) with
// P = (H + 2*pad - R)/stride + 1, Q likewise; ws (splits, M, NG); dw (K, C, R, S).
// The GEMM kernels take a last argument tab: the layer's tap table (Planner.conv_tap_table), or NULL
// for the bounds-testing path (see CONV_TABLE; the results are the same).
// Launch (GEMM kernels): block CONV_THREADS = (BM/TM)*(BN/TN) threads (1-D), grid (ceil(NG/BN),
// ceil(M/BM), splits), static shared memory STAGES*BK*(AS_PITCH + BS_PITCH) floats (ConvSmem, shared
// by a kernel's instantiations; 27.8 KiB for the 64x64 tile with 3 stages). The tile (BM, BN) is
// chosen at compile time (-DCONV_BM, -DCONV_BN; 64x64 by default, 32x128 for GEMMs of <= 32 rows:
// see Planner.conv_tile); so are the register block TM x TN (4x4; 8 rows or columns in
// tiles.CONV_TRIAL_TILES), the K-slab BK (16) and the shared-memory stages (CONV_STAGES: 3, and 1
// below sm_80). conv2d_fprop / conv2d_dgrad write C in place (splits = 1, chunk = KR).
// Split-K: the *_partial kernels sum kk in [z*chunk, min(KR, (z+1)*chunk)) for z = blockIdx.z
// (any chunk >= 1; Planner.gemm_split picks multiples of CONV_BK) into a workspace, and
// conv2d_split_reduce adds the splits in a fixed order, without atomics, so every result is
// bit-reproducible run to run. wgrad always splits its N*P*Q reduction; fprop and dgrad split when
// their output alone gives too few blocks to fill the GPU (Planner.gemm_split).
// conv2d_split_reduce: see its comment (two-level, fixed order).
//
// Tile: each block computes a BM x BN tile of C, stepping KR in slabs of BK; thread (ty, tx) owns
// the TM x TN register block of rows ty*4 + i and columns tx*4 + j (i, j < 4) of each row and column
// band (one band with 4x4 blocks) and reads each run of 4 rows of As or columns of Bs as one float4
// per kk. The 32 threads of a warp own an 8 (tx) x 4 (ty) patch of blocks (the lane
// layout of CUTLASS's SIMT GEMMs), so per kk a warp reads 64 bytes of As and 128 of Bs, one
// shared-memory wavefront each, where a row of 16 or 32 threads would read 256 or 512 bytes of Bs.
// Main loop (CONV_STAGES): on sm_80+ a multistage pipeline, CUTLASS's "multistage" mainloop: each
// thread copies its elements of a slab from global straight into one of 3 shared-memory stages with
// cp.async (4-byte copies, zero-filled in the padding by a source size of 0), so 2 slabs are in flight
// while one is multiplied, with one barrier per slab and no staging registers. Below sm_80 (and in the
// CONV_STAGES=1 trial tiles) the next slab is loaded into registers while the current one is
// multiplied, then stored: two barriers per slab.
// Loads are cheap in the main loop: a thread's B loads share one slab row kk and its A loads one kk.
// With a tap table (filters of <= 32 taps, the common case; see CONV_TABLE) what a row kk shares
// (the B offset, its filter-tap bits, the A offset) is one 8-byte and one 4-byte load, fetched one
// slab ahead, and a B load is one AND of bit masks (the zero padding: tap bits against a column's
// in-image taps, or the reverse for wgrad) and one address computation. Without one (larger
// filters, dgrad with stride > 1) the digits of kk ((c, r, s), (k, r, s) or (n, p, q)) are stepped
// from slab to slab without integer division and a B load is two adds and two unsigned bounds
// compares (conv_load_b); dgrad with stride > 1 is its own instantiation, so the unit-stride loops
// divide nothing. Either way a B column's origin in its image is decoded once, and columns and rows
// beyond the output are clamped to its last one (their results are never stored). The epilogue
// stores a row of the block as one float4 when its 4 columns are consecutive in memory and 16-byte
// aligned, else element by element.
// Offsets: image bases and workspace offsets are 64-bit (N*C*H*W may pass 2^31); offsets within one
// image and within the filter are int (contract.conv_geometry checks that C*H*W, K*P*Q, K*C*R*S and
// (H + 2*pad)*(W + 2*pad) fit), as is a block's count of reduction terms (gemm_split: <= 2^30).

// The constants shared with the Python side (mpiasgd/ops/cuda/constants.py), this file's tile among them.
#include "constants.cuh"

// Tile shape: the production values are constants.cuh's CONV_BM x CONV_BN (64x64), CONV_TM x CONV_TN
// (4x4: one float4 of As per 4 rows and of Bs per 4 columns per kk; 4 or 8 each), CONV_BK (16: the
// reduction slab; split-K ranges are multiples of it) and CONV_STAGES (3); each may be overridden
// with -D (the Python side compiles one variant per tile it launches, tiles.tile_defines; the CPU
// harness tests several). Everything below is derived from them; the static_asserts say what a tile
// must satisfy (BN a multiple of 32, BM of 16, the loaders tiling the slabs).

// Shared-memory stages of the main loop. 1: the next slab is fetched into registers while the current one
// is multiplied, then stored (two barriers per slab). >= 2 (sm_80+): a multistage pipeline of
// asynchronous copies (cp.async) straight into STAGES slab buffers, STAGES - 1 slabs in flight while one
// is multiplied, one barrier per slab, no staging registers. Below sm_80 (no cp.async) always 1.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#undef CONV_STAGES
#define CONV_STAGES 1
#endif
// A thread's TM rows are TM/4 runs of 4, one in each of the TM/4 equal row bands of the tile (and its
// columns likewise), so that a warp's float4 reads of a band are consecutive (see the main loop).
#define CONV_RBAND (CONV_BM / (CONV_TM / 4))  // rows per band
#define CONV_CBAND (CONV_BN / (CONV_TN / 4))  // columns per band
#define CONV_TX (CONV_BN / CONV_TN)
#define CONV_TY (CONV_BM / CONV_TM)
#define CONV_THREADS (CONV_TX * CONV_TY)              // 256
#define CONV_WARP_TX 8  // a warp's threads: 8 register blocks along BN x 4 along BM
#define CONV_WARP_TY 4
#define CONV_A_LOADS (CONV_BM * CONV_BK / CONV_THREADS)  // A slab elements per thread (64x64: 4)
#define CONV_B_LOADS (CONV_BK * CONV_BN / CONV_THREADS)  // B slab elements per thread (64x64: 4)
// B loader: thread t loads B_COLS columns t % B_ROW + c*B_ROW (c < B_COLS) of B_RROWS slab rows
// t / B_ROW + r*B_RSTEP (r < B_RROWS): it decodes its columns once, before the loop, and steps one
// reduction index kk per row, which the row's loads share. At most 4 columns: registers.
#define CONV_B_COLS (CONV_B_LOADS < 4 ? CONV_B_LOADS : 4)
#define CONV_B_ROW (CONV_BN / CONV_B_COLS)        // threads per slab row
#define CONV_B_RSTEP (CONV_THREADS / CONV_B_ROW)  // slab rows the block's threads cover at once
#define CONV_B_RROWS (CONV_BK / CONV_B_RSTEP)     // slab rows per thread
// Row pitches, multiples of 4 floats so that every row is 16-byte aligned for the float4 reads.
// As: 4 floats of padding spread the BK kk rows that one warp's A stores touch over the banks (at
// most 2 per bank with BK = 16). Bs: a warp's B stores cover 32 / B_ROW rows of B_ROW columns; a
// pitch of BN + B_ROW (BN is a multiple of 32) puts them in different banks.
#define CONV_AS_PITCH (CONV_BM + 4)
#define CONV_BS_PITCH (CONV_BN + (CONV_B_ROW < 32 && CONV_B_ROW % 4 == 0 ? CONV_B_ROW : 0))

// What the loaders, the float4 reads and the bank layout rely on (a tile choice that breaks one
// fails to compile instead of computing garbage or serialising the shared-memory stores).
static_assert((CONV_TM == 4 || CONV_TM == 8) && (CONV_TN == 4 || CONV_TN == 8), "register block: 4 or 8 rows, columns");
static_assert(CONV_BM % CONV_TM == 0 && CONV_BN % CONV_TN == 0, "BM, BN: multiples of the register block");
static_assert(CONV_THREADS % CONV_BK == 0 && CONV_BN % CONV_B_COLS == 0 && CONV_THREADS % CONV_B_ROW == 0 &&
                  CONV_BK % CONV_B_RSTEP == 0 && CONV_B_RROWS * CONV_B_COLS == CONV_B_LOADS,
              "THREADS: a multiple of BK, and the B loader's rows of BN/B_COLS threads tiling the slab");
static_assert((CONV_BM * CONV_BK) % CONV_THREADS == 0 && (CONV_BK * CONV_BN) % CONV_THREADS == 0,
              "every thread loads the same number of A and of B slab elements");
static_assert(CONV_AS_PITCH % 32 != 0, "As pitch: not a multiple of 32 banks (8-way store conflicts)");
static_assert(CONV_AS_PITCH % 4 == 0 && CONV_BS_PITCH % 4 == 0, "shared rows: 16-byte aligned for float4 reads");
static_assert(CONV_THREADS <= MAX_BLOCK_THREADS, "at most 1,024 threads per block");
static_assert(CONV_STAGES >= 1 && CONV_STAGES <= 4, "1 to 4 shared-memory stages");
static_assert(CONV_STAGES * CONV_BK * (CONV_AS_PITCH + CONV_BS_PITCH) * 4 <= MAX_STATIC_SHARED,
              "static shared memory: at most 48 KB per block");
static_assert(2 * CONV_BK <= CONV_TAB_PAD, "the tap table's CONV_TAB_PAD zero rows cover two slabs");
static_assert(CONV_TAB_MAX_TAPS <= 32, "a column's taps in the tap table path are one 32-bit mask");
static_assert(CONV_TX % CONV_WARP_TX == 0 && CONV_TY % CONV_WARP_TY == 0,
              "BN a multiple of 32 and BM of 16: whole warps of 8 x 4 register blocks");

#define CONV_FPROP 0
#define CONV_DGRAD 1
#define CONV_WGRAD 2

// How a block finds its loads (template parameter PATH of conv_gemm; the kernels pick it, uniformly):
#define CONV_TABLE 0    // R*S <= 32 (DGRAD: stride 1), given a tap table: see below
#define CONV_BOUNDS 1   // any pass: the digits of kk stepped per slab, two unsigned compares per B load
#define CONV_STRIDED 2  // DGRAD with stride > 1: as BOUNDS, and the divisions of conv_load_b_strided

// Tap table (PATH CONV_TABLE), built by the host once per layer geometry (Planner.conv_tap_table):
// entry kk holds four ints {off, bits, a_off, 0}, what every load of slab row kk shares, so the main
// loop steps no digits and tests no bounds. A bit stands for a filter tap (r, s): bit r*S + s (R*S <= 32).
//   FPROP kk = (c, r, s): off = (c*H + r - pad)*W + s - pad, bits = the tap's bit, a_off = kk
//   DGRAD kk = (k, r, s): off = (k*P - r)*Q - s, bits = the tap's bit, a_off = k*C*R*S + r*S + s
//   WGRAD kk = (n, p, q): off = n*C*H*W + (p*st - pad)*W + q*st - pad (0 for a row without taps
//                         inside the image), bits = the taps that read inside the image at output
//                         pixel (p, q), a_off = n*K*P*Q + p*Q + q
// and a B column j holds the other side as ConvCol::mask: FPROP/DGRAD the taps that read inside the
// image at its pixel, WGRAD (j = (c, r, s)) its tap's bit. So B[kk][j] = (mask_j & bits_kk) ?
// col_j.origin[off_kk] : 0 (FPROP, DGRAD) or (x + off_kk)[c*H*W + r*W + s] (WGRAD), and A[m][kk] =
// A[a_off_kk + m*mstride]. The table has KR + 128 entries, those past KR all zero: the loads of the
// last slab, and of the entries one slab ahead, stay inside it. Every offset of a row with bits lies
// between an in-bounds address minus one image and that address, so it fits an int when the tensor
// does; the host builds no table (and the kernels test bounds) where it would not (WGRAD: N*C*H*W,
// N*K*P*Q >= 2^31).
// CONV_TAB_INTS (constants.cuh): 4 ints per entry (16 bytes: the {off, bit} pair is one 8-byte load)

// A reduction index kk as three digits (hi, mid, lo) with radices (.., MID, LO): FPROP/DGRAD
// kk = (c or k, r, s) with radices (R, S); WGRAD kk = (n, p, q) with radices (P, Q). Decoded with
// divisions once; every later slab steps all digits by the decoded CONV_BK, with carries and no
// division (integer division by a runtime value costs about twenty instructions on the GPU).
struct Digits {
  int hi, mid, lo;
};

__device__ __forceinline__ Digits digits_of(long long kk, int mid_radix, int lo_radix) {
  const long long ml = (long long)mid_radix * lo_radix;
  const long long hi = kk / ml;
  const int rem = (int)(kk - hi * ml);
  Digits d;
  d.hi = (int)hi;
  d.mid = rem / lo_radix;
  d.lo = rem - d.mid * lo_radix;
  return d;
}

// d += step (step.mid < mid_radix and step.lo < lo_radix, so each carry is at most 1)
__device__ __forceinline__ void digits_step(Digits& d, const Digits& step, int mid_radix, int lo_radix) {
  d.lo += step.lo;
  int carry = d.lo >= lo_radix;
  if (carry) d.lo -= lo_radix;
  d.mid += step.mid + carry;
  carry = d.mid >= mid_radix;
  if (carry) d.mid -= mid_radix;
  d.hi += step.hi + carry;
}

// One B column j, decoded once per thread (j is fixed over the KR loop). The B element at reduction
// index kk is col.origin[tap.off] (FPROP, DGRAD) or tap.origin[col.base] (WGRAD) when (h, w) =
// (a + kh(kk), b + kw(kk)) is inside [0, Hb) x [0, Wb), else a zero of the padding; kh, kw and the
// tap's offset or origin depend on kk only, so the loads of one slab row share them (see conv_tap):
//   FPROP (x, column (n, p, q)):  (a, b) = (p*st - pad, q*st - pad), origin = x + n*C*H*W + p*st*W + q*st
//   DGRAD (dy, column (n, h, w)): (a, b) = (h + pad, w + pad), origin = dy + n*K*P*Q + a*Q + b
//   WGRAD (x, column (c, r, s)):  (a, b) = (r - pad, s - pad), base = c*H*W + a*W + b
// An origin may lie outside its image; it is only dereferenced at in-bounds (h, w). A column
// j >= NG (the last tile's overhang) is decoded as NG - 1: its loads stay in bounds and its results
// are never stored. Ints are enough: contract.conv_geometry bounds C*H*W, K*P*Q and (H + 2*pad)*
// (W + 2*pad) by 2^31 - 1, and each part of an in-bounds address (base or origin offset, tap offset)
// lies between -pad*W - pad and the image size (FPROP puts -pad in the tap, not in the column: the
// column part p*st*W + q*st is >= 0, so the tap part stays below C*H*W). Tap offsets of slab rows
// past the reduction (kk >= KR: loaded as zeros, never dereferenced) may leave the int range: they
// are computed in unsigned arithmetic, which wraps instead of overflowing.
struct ConvCol {
  const float* origin;  // FPROP, DGRAD
  int a, b, base;       // base: WGRAD
  unsigned mask;        // PATH CONV_TABLE: FPROP, DGRAD the taps (bit r*S + s) inside the image; WGRAD its tap
};

// Bit r*S + s set for each tap (r, s) that reads inside the image, (a + sg*r, b + sg*s) in
// [0, Hb) x [0, Wb) (sg = 1 FPROP, -1 DGRAD); R*S <= 32.
__device__ __forceinline__ unsigned conv_tap_mask(int a, int b, int sg, int R, int S, int Hb, int Wb) {
  unsigned row = 0, mask = 0;
  for (int s = 0; s < S; ++s) row |= (unsigned)((unsigned)(b + sg * s) < (unsigned)Wb) << s;
  for (int r = 0; r < R; ++r)
    if ((unsigned)(a + sg * r) < (unsigned)Hb) mask |= row << (r * S);
  return mask;
}

// p (i) as an opaque register value, computed once and kept: without it the compiler re-derives a
// column's origin from the kernel parameter and a 64-bit element offset at every load (5 instructions
// instead of one IMAD.WIDE), and recomputes A's row offsets in every slab.
__device__ __forceinline__ const float* conv_opaque(const float* p) {
#ifdef __CUDA_ARCH__
  asm("mov.b64 %0, %0;" : "+l"(p));
#endif
  return p;
}

__device__ __forceinline__ int conv_opaque(int i) {
#ifdef __CUDA_ARCH__
  asm("mov.b32 %0, %0;" : "+r"(i));
#endif
  return i;
}

template <int MODE, int PATH>
__device__ __forceinline__ ConvCol conv_decode_col(const float* __restrict__ B, long long j, long long NG, int C,
                                                   int H, int W, int K, int R, int S, int P, int Q, int stride,
                                                   int pad) {
  ConvCol col;
  if (j >= NG) j = NG - 1;
  if (MODE == CONV_FPROP) {
    const long long pq = (long long)P * Q;
    const long long n = j / pq;
    const int rem = (int)(j - n * pq);
    col.a = (rem / Q) * stride - pad;
    col.b = (rem % Q) * stride - pad;
    col.base = (col.a + pad) * W + (col.b + pad);  // p*st*W + q*st: the -pad goes to the tap (conv_tap)
    col.origin = conv_opaque(B + n * C * H * W + col.base);
  } else if (MODE == CONV_DGRAD) {
    const long long hw = (long long)H * W;
    const long long n = j / hw;
    const int rem = (int)(j - n * hw);
    col.a = rem / W + pad;
    col.b = rem % W + pad;
    col.base = col.a * Q + col.b;
    col.origin = conv_opaque(B + n * K * P * Q + col.base);
  } else {  // WGRAD: j = (c, r, s)
    const int rs = R * S;
    const int c = (int)j / rs;
    const int rem = (int)j - c * rs;
    col.origin = B;
    col.a = rem / S - pad;
    col.b = rem % S - pad;
    // PATH CONV_TABLE: c*H*W + r*W + s (>= 0; the table's row offset holds the -pad, so that it stays
    // below the address it leads to: helper-20 found n*C*H*W + p*st*W + q*st passing 2^31)
    col.base = (PATH == CONV_TABLE) ? c * H * W + (col.a + pad) * W + col.b + pad : c * H * W + col.a * W + col.b;
  }
  col.mask = 0;
  if (PATH == CONV_TABLE)
    col.mask = conv_opaque(MODE == CONV_FPROP   ? conv_tap_mask(col.a, col.b, 1, R, S, H, W)
                           : MODE == CONV_DGRAD ? conv_tap_mask(col.a, col.b, -1, R, S, P, Q)
                                                : 1u << ((col.a + pad) * S + col.b + pad));
  return col;
}

// What the B loads of one slab row share: the row's reduction index kk as (kh, kw, off) of
// conv_decode_col; for WGRAD the row's origin in x (its image n and its offset off) instead of off.
struct ConvTap {
  const float* origin;  // WGRAD: x + n*C*H*W + off; FPROP, DGRAD: unused (each column has its origin)
  int kh, kw, off;
  unsigned bit;         // PATH CONV_TABLE: the bits of the row's table entry, 0 for a row past the range
};

// kk = digits d: FPROP (c, r, s), DGRAD (k, r, s), WGRAD (n, p, q)
template <int MODE>
__device__ __forceinline__ ConvTap conv_tap(const float* __restrict__ B, const Digits& d, int C, int H, int W,
                                            int P, int Q, int stride, int pad) {
  ConvTap t;
  t.origin = B;
  t.bit = 0;
  if (MODE == CONV_FPROP) {  // x[n][c][a + r][b + s]
    t.kh = d.mid;
    t.kw = d.lo;
    t.off = (int)(((unsigned)d.hi * H + d.mid - pad) * W + d.lo - pad);  // [-pad*W - pad, C*H*W) when in bounds
  } else if (MODE == CONV_DGRAD) {  // unit stride: dy[n][k][a - r][b - s]
    t.kh = -d.mid;
    t.kw = -d.lo;
    t.off = (int)(((unsigned)d.hi * P - d.mid) * Q - d.lo);
  } else {  // WGRAD: x[n][c][p*st + a][q*st + b]
    t.kh = d.mid * stride;
    t.kw = d.lo * stride;
    t.off = t.kh * W + t.kw;
    t.origin = conv_opaque(B + (long long)d.hi * (C * H * W) + t.off);
  }
  return t;
}

// B[kk][j] for column col and slab row tap (kk in range: ok) is *src when the returned predicate holds,
// else a zero of the padding; src is only dereferenced when it holds. The bounds test is two unsigned
// compares (a negative coordinate wraps to a large one). Hb x Wb: P x Q for DGRAD, else H x W.
template <int MODE, int PATH>
__device__ __forceinline__ bool conv_src_b(const ConvCol& col, const ConvTap& tap, bool ok, int Hb, int Wb,
                                           const float*& src) {
  if (PATH == CONV_TABLE && MODE == CONV_WGRAD) return src = tap.origin + col.base, (col.mask & tap.bit) != 0;
  if (PATH == CONV_TABLE) return src = col.origin + tap.off, (col.mask & tap.bit) != 0;
  const int h = col.a + tap.kh, w = col.b + tap.kw;
  src = (MODE == CONV_WGRAD) ? tap.origin + col.base : col.origin + tap.off;
  return ok && (unsigned)h < (unsigned)Hb && (unsigned)w < (unsigned)Wb;
}

// DGRAD with stride > 1: dy[n][k][p][q] where p*stride = h + pad - r (and likewise q) must divide
// exactly; the integer divisions cost about twenty instructions each, so the unit-stride kernels
// (the common case) are a separate instantiation that never runs this. As conv_src_b.
__device__ __forceinline__ bool conv_src_b_strided(const ConvCol& col, const Digits& d, bool ok, int P, int Q,
                                                   int stride, const float*& src) {
  const int hp = col.a - d.mid, wp = col.b - d.lo;  // p * stride, q * stride when tap (r, s) reaches (p, q)
  const int p = hp / stride, q = wp / stride;
  src = col.origin - col.base + (int)(((unsigned)d.hi * P + p) * Q + q);  // (rows past the range: wraps, unread)
  return ok && hp >= 0 && wp >= 0 && p * stride == hp && q * stride == wp && p < P && q < Q;
}

// A shared-memory address as cp.async takes it: 32 bits on the GPU, a plain pointer elsewhere (the CPU
// harness). Plus a byte offset is an address; conv_shared converts a pointer once, outside the loops.
#ifdef __CUDA_ARCH__
typedef unsigned ConvShared;
__device__ __forceinline__ ConvShared conv_shared(void* p) { return conv_opaque((int)__cvta_generic_to_shared(p)); }
#else
typedef char* ConvShared;
inline ConvShared conv_shared(void* p) { return static_cast<char*>(p); }
#endif

// Asynchronous 4-byte copy from global src to shared dst, zero-filled (src not read) when !pred: PTX
// cp.async (sm_80+) with src-size 0 for the zero fill, so a predicated-off src may point anywhere. It
// lands once a conv_async_wait<n>() returns that covers its group (conv_async_commit closes a group).
// Without a CUDA compiler (the CPU harness, g++) CUDA's pipeline primitives, which the harness models.
__device__ __forceinline__ void conv_async_copy(ConvShared dst, const float* src, bool pred) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(pred ? 4 : 0));
#elif defined(__CUDACC__)
  (void)dst, (void)src, (void)pred;  // never runs: CONV_STAGES is 1 below sm_80 (no cp.async); nvcc's host pass
#else
  __pipeline_memcpy_async(dst, src, 4, pred ? 0 : 4);
#endif
}

__device__ __forceinline__ void conv_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#elif !defined(__CUDACC__)
  __pipeline_commit();
#endif
}

// returns once all but the n most recently committed groups of this thread's copies have landed
template <int n>
__device__ __forceinline__ void conv_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
#elif !defined(__CUDACC__)
  __pipeline_wait_prior(n);
#endif
}

// The A loads of one thread share their reduction index kk (digits d): A[m][kk] = origin[m * mstride]
// for the origin returned here:
//   FPROP: w (K, C*R*S), origin = w + kk;  DGRAD: w (K, C, R, S), m = c, origin = w + k*C*R*S + r*S + s;
//   WGRAD: dy (N, K, P, Q), origin = dy + n*K*P*Q + p*Q + q.
template <int MODE>
__device__ __forceinline__ const float* conv_origin_a(const float* __restrict__ A, const Digits& d, int kk,
                                                      int C, int K, int R, int S, int P, int Q) {
  if (MODE == CONV_FPROP) return conv_opaque(A + kk);
  if (MODE == CONV_DGRAD) return conv_opaque(A + (int)((unsigned)d.hi * (C * R * S) + d.mid * S + d.lo));
  return conv_opaque(A + (long long)d.hi * (K * P * Q) + (d.mid * Q + d.lo));
}

// Shared memory of a conv GEMM block: CONV_STAGES K-slabs of A and of B. Declared once per kernel
// (conv_run) and passed down, so the instantiations a kernel chooses between (PATH) share it instead of
// each adding its own.
struct ConvStage {
  float As[CONV_BK][CONV_AS_PITCH];  // As[kk][m]
  float Bs[CONV_BK][CONV_BS_PITCH];  // Bs[kk][j]
};
struct ConvSmem {
  ConvStage stage[CONV_STAGES];
};

// The fused ReLU: max(v, 0), but NaN stays NaN (fmaxf(NaN, 0) would be 0 and hide a NaN from the
// non-finite check of a pushed gradient that the NumPy backend trips); -0 gives +0, as np.maximum.
__device__ __forceinline__ float conv_relu(float v) { return (v > 0.0f || v != v) ? v : 0.0f; }

// PARTIAL: write C[m][j] of split z = blockIdx.z to the workspace out[z][m][j] (no bias, no ReLU)
// instead of its NCHW place; conv2d_split_reduce adds the splits. WGRAD is always PARTIAL.
// PATH: CONV_TABLE (tab: the tap table), CONV_BOUNDS or CONV_STRIDED (tab unused), see their comments.
template <int MODE, bool PARTIAL, int PATH>
__device__ __forceinline__ void conv_gemm(ConvSmem& sm, const float* __restrict__ A, const float* __restrict__ B,
                                          float* __restrict__ out, const float* __restrict__ bias, int relu,
                                          int N, int C, int H, int W, int K, int R, int S, int P, int Q,
                                          int stride, int pad, long long chunk, const int* __restrict__ tab) {
  const int M = (MODE == CONV_DGRAD) ? C : K;
  const long long NG = (MODE == CONV_FPROP)   ? (long long)N * P * Q
                       : (MODE == CONV_DGRAD) ? (long long)N * H * W
                                              : (long long)C * R * S;
  const long long KR = (MODE == CONV_FPROP)   ? (long long)C * R * S
                       : (MODE == CONV_DGRAD) ? (long long)K * R * S
                                              : (long long)N * P * Q;
  const int mid_radix = (MODE == CONV_WGRAD) ? P : R;  // digits of kk
  const int lo_radix = (MODE == CONV_WGRAD) ? Q : S;
  const int Hb = (MODE == CONV_DGRAD) ? P : H, Wb = (MODE == CONV_DGRAD) ? Q : W;  // B's bounds (conv_load_b)
  Digits step = digits_of(CONV_BK, mid_radix, lo_radix);  // kept in registers, not recomputed per slab
  step.hi = conv_opaque(step.hi);
  step.mid = conv_opaque(step.mid);
  step.lo = conv_opaque(step.lo);
  const long long k_begin = (long long)blockIdx.z * chunk;
  // this block's reduction terms: < 2^31 (chunk is, see Planner.gemm_split), counted down by slabs
  int k_left = (int)((k_begin + chunk < KR) ? chunk : KR - k_begin);

  const int t = threadIdx.x;
  const int warp = t / 32, lane = t % 32;  // warps tile the block row by row, lanes their 8 x 4 patch
  const int tx = (warp % (CONV_TX / CONV_WARP_TX)) * CONV_WARP_TX + lane % CONV_WARP_TX;
  const int ty = (warp / (CONV_TX / CONV_WARP_TX)) * CONV_WARP_TY + lane / CONV_WARP_TX;
  const int m0 = blockIdx.y * CONV_BM;
  const long long j0 = (long long)blockIdx.x * CONV_BN;

  // loader roles: thread t loads A[a_m + i*(THREADS/BK)][a_kk] (i < A_LOADS) and
  // B[b_kk + r*B_RSTEP][b_j + c*B_ROW] (r < B_RROWS, c < B_COLS) of each slab: one kk for its A loads
  // and one per B row, so what the loads of one kk share (the digits of kk and what follows from
  // them, or its tap table entry) is found once per slab for each.
  const int a_kk = t % CONV_BK, a_m = t / CONV_BK;
  const int b_j = t % CONV_B_ROW, b_kk = t / CONV_B_ROW;  // row r of the thread: b_kk + r*B_RSTEP
  int a_row[CONV_A_LOADS];           // m * mstride of A (rows >= M read row M - 1: never stored) ...
  const float* a_ptr[CONV_A_LOADS];  // ... and A + that (PATH CONV_TABLE: an A load is a_ptr[i] + a_off)
  const int a_mstride = (MODE == CONV_FPROP) ? (int)KR : (MODE == CONV_DGRAD) ? R * S : P * Q;
#pragma unroll
  for (int i = 0; i < CONV_A_LOADS; ++i) {
    const int m = m0 + a_m + i * (CONV_THREADS / CONV_BK);
    a_row[i] = conv_opaque((m < M ? m : M - 1) * a_mstride);
    a_ptr[i] = conv_opaque(A + a_row[i]);
  }
  ConvCol col[CONV_B_COLS];
#pragma unroll
  for (int c = 0; c < CONV_B_COLS; ++c)
    col[c] = conv_decode_col<MODE, PATH>(B, j0 + b_j + c * CONV_B_ROW, NG, C, H, W, K, R, S, P, Q, stride, pad);
  // PATH CONV_BOUNDS, CONV_STRIDED: the digits of kk of the A loads and of each B row
  Digits a_d = digits_of(k_begin + a_kk, mid_radix, lo_radix);
  // kk of the A loads, FPROP's A offset (< C*R*S + BK: the last slab's rows past KR load nothing)
  int a_k = (MODE == CONV_FPROP) ? (int)(k_begin + a_kk) : 0;
  Digits b_d[CONV_B_RROWS];
#pragma unroll
  for (int r = 0; r < CONV_B_RROWS; ++r) b_d[r] = digits_of(k_begin + b_kk + r * CONV_B_RSTEP, mid_radix, lo_radix);
  // PATH CONV_TABLE: the entries of the next slab to load, fetched one slab ahead (the B loads need
  // them, so they are not waited for in the slab that uses them); te points at the next slab's.
  const int* te = (PATH == CONV_TABLE) ? tab + k_begin * CONV_TAB_INTS : tab;
  int2 e_b[CONV_B_RROWS];  // {off, bit} of the thread's B rows
  int e_a = 0;             // a_off of its A loads
  auto fetch_entries = [&]() {
#pragma unroll
    for (int r = 0; r < CONV_B_RROWS; ++r)
      e_b[r] = __ldg(reinterpret_cast<const int2*>(te + (b_kk + r * CONV_B_RSTEP) * CONV_TAB_INTS));
    e_a = __ldg(te + a_kk * CONV_TAB_INTS + 2);
    te += CONV_BK * CONV_TAB_INTS;
  };
  if (PATH == CONV_TABLE) fetch_entries();

  // Slab loads. The next slab's reduction index (PATH CONV_BOUNDS, CONV_STRIDED: its digits) ...
  auto advance = [&]() {
    if (PATH != CONV_TABLE) {
      if (MODE == CONV_FPROP) a_k += CONV_BK;
      digits_step(a_d, step, mid_radix, lo_radix);
#pragma unroll
      for (int r = 0; r < CONV_B_RROWS; ++r) digits_step(b_d[r], step, mid_radix, lo_radix);
    }
  };
  // ... and its elements: visit(i, src, pred) for each A element i < A_LOADS and B element
  // A_LOADS + r*B_COLS + c of the slab with `left` terms of the block's range to go (its rows at or past
  // `left` are past the range: zeros). Element i is *src when pred holds, else 0.
  auto slab = [&](int left, auto&& visit) {
    const bool a_ok = a_kk < left;
    if (PATH == CONV_TABLE) {
#pragma unroll
      for (int i = 0; i < CONV_A_LOADS; ++i) visit(i, a_ptr[i] + e_a, a_ok);
    } else {
      const float* a_origin = conv_origin_a<MODE>(A, a_d, a_k, C, K, R, S, P, Q);
#pragma unroll
      for (int i = 0; i < CONV_A_LOADS; ++i) visit(i, a_origin + a_row[i], a_ok);  // < K*C*R*S
    }
#pragma unroll
    for (int r = 0; r < CONV_B_RROWS; ++r) {
      const bool b_ok = b_kk + r * CONV_B_RSTEP < left;
      const float* src;
      if (PATH == CONV_STRIDED) {
#pragma unroll
        for (int c = 0; c < CONV_B_COLS; ++c) {
          const bool pred = conv_src_b_strided(col[c], b_d[r], b_ok, P, Q, stride, src);
          visit(CONV_A_LOADS + r * CONV_B_COLS + c, src, pred);
        }
      } else {
        ConvTap tb;
        if (PATH == CONV_TABLE) {
          tb.origin = (MODE == CONV_WGRAD) ? conv_opaque(B + e_b[r].x) : B;
          tb.kh = tb.kw = 0;
          tb.off = e_b[r].x;
          tb.bit = b_ok ? (unsigned)e_b[r].y : 0u;
        } else {
          tb = conv_tap<MODE>(B, b_d[r], C, H, W, P, Q, stride, pad);
        }
#pragma unroll
        for (int c = 0; c < CONV_B_COLS; ++c) {
          const bool pred = conv_src_b<MODE, PATH>(col[c], tb, b_ok, Hb, Wb, src);
          visit(CONV_A_LOADS + r * CONV_B_COLS + c, src, pred);
        }
      }
    }
    if (PATH == CONV_TABLE) fetch_entries();  // the slab after
  };
  // where element e of a slab goes in a stage of shared memory, as a byte offset in ConvStage:
  // As[a_kk][a_m + e*(THREADS/BK)] (e < A_LOADS), else Bs[b_kk + r*B_RSTEP][b_j + c*B_ROW]
  // (e = A_LOADS + r*B_COLS + c)
  const int a_soff = conv_opaque((a_kk * CONV_AS_PITCH + a_m) * 4);
  const int b_soff = conv_opaque((int)sizeof(ConvStage::As) + (b_kk * CONV_BS_PITCH + b_j) * 4);
  auto soff = [&](int e) -> int {
    if (e < CONV_A_LOADS) return a_soff + e * (CONV_THREADS / CONV_BK) * 4;
    e -= CONV_A_LOADS;
    return b_soff + ((e / CONV_B_COLS) * CONV_B_RSTEP * CONV_BS_PITCH + (e % CONV_B_COLS) * CONV_B_ROW) * 4;
  };

  float acc[CONV_TM][CONV_TN];
  for (int i = 0; i < CONV_TM; ++i)
    for (int j = 0; j < CONV_TN; ++j) acc[i][j] = 0.0f;
  // C += the slab in stage st
  auto multiply = [&](int st) {
#pragma unroll
    for (int kk = 0; kk < CONV_BK; ++kk) {
      // thread (ty, tx) owns rows g*RBAND + ty*4 .. +3 (g < TM/4) and columns g*CBAND + tx*4 .. +3
      // (g < TN/4): one 16-byte shared load per run of 4 (a warp reads 4 consecutive float4 of each
      // band of As and 8 of each band of Bs, each read by 8 or 4 threads)
      float a[CONV_TM], b[CONV_TN];
#pragma unroll
      for (int g = 0; g < CONV_TM / 4; ++g) {
        const float4 v = *reinterpret_cast<const float4*>(&sm.stage[st].As[kk][g * CONV_RBAND + ty * 4]);
        a[4 * g] = v.x, a[4 * g + 1] = v.y, a[4 * g + 2] = v.z, a[4 * g + 3] = v.w;
      }
#pragma unroll
      for (int g = 0; g < CONV_TN / 4; ++g) {
        const float4 v = *reinterpret_cast<const float4*>(&sm.stage[st].Bs[kk][g * CONV_CBAND + tx * 4]);
        b[4 * g] = v.x, b[4 * g + 1] = v.y, b[4 * g + 2] = v.z, b[4 * g + 3] = v.w;
      }
#pragma unroll
      for (int i = 0; i < CONV_TM; ++i)
#pragma unroll
        for (int j = 0; j < CONV_TN; ++j) acc[i][j] += a[i] * b[j];
    }
  };

  if (CONV_STAGES == 1) {
    // register prefetch: the next slab is loaded into registers while this one is multiplied
    float reg[CONV_A_LOADS + CONV_B_LOADS];
    auto load = [&](int left) {
      slab(left, [&](int e, const float* src, bool pred) { reg[e] = pred ? __ldg(src) : 0.0f; });
    };
    load(k_left);
    for (; k_left > 0; k_left -= CONV_BK) {
      __syncthreads();  // every thread is done reading the previous slab
#pragma unroll
      for (int e = 0; e < CONV_A_LOADS + CONV_B_LOADS; ++e)
        *reinterpret_cast<float*>(reinterpret_cast<char*>(&sm) + soff(e)) = reg[e];
      __syncthreads();  // slab complete
      if (k_left > CONV_BK) {  // prefetch the next slab while this one is multiplied
        advance();
        load(k_left - CONV_BK);
      }
      multiply(0);
    }
  } else {
    // multistage pipeline: slab i goes to stage i % STAGES by asynchronous copies, one commit group per
    // slab (empty past the range, so that the group count stays in step); STAGES - 1 slabs are in
    // flight when slab i is multiplied
    const ConvShared s0 = conv_shared(&sm);  // element e of stage st: s0 + st*sizeof(ConvStage) + soff(e)
    auto issue = [&](int left, int st) {
      const ConvShared s_st = s0 + st * (int)sizeof(ConvStage);
      slab(left, [&](int e, const float* src, bool pred) { conv_async_copy(s_st + soff(e), src, pred); });
    };
    int issue_left = k_left;  // terms left from the next slab to issue
#pragma unroll
    for (int st = 0; st < CONV_STAGES - 1; ++st) {
      if (issue_left > 0) {
        if (st > 0) advance();
        issue(issue_left, st);
      }
      conv_async_commit();
      issue_left -= CONV_BK;
    }
    int st = 0;  // the stage multiplied next; the slab STAGES - 1 ahead goes to the one before it
    for (; k_left > 0; k_left -= CONV_BK) {
      conv_async_wait<CONV_STAGES - 2>();  // this thread's copies of slab st have landed
      __syncthreads();  // everyone's have; and everyone is done reading the stage refilled below (the last slab's)
      const int st_fill = (st == 0 ? CONV_STAGES : st) - 1;
      if (issue_left > 0) {
        advance();
        issue(issue_left, st_fill);
      }
      conv_async_commit();
      issue_left -= CONV_BK;
      multiply(st);
      st = (st + 1 == CONV_STAGES) ? 0 : st + 1;
    }
    conv_async_wait<0>();  // (only empty groups are left)
  }

  // epilogue: the register block to its NCHW (or workspace) location. C[m][jj] lives at
  // base[j] + m * mstride; when a run of 4 columns is consecutive in memory (same image) and the
  // row's address is 16-byte aligned, each row of the run is one float4 store.
  long long base[CONV_TN], jj[CONV_TN];
  long long mstride = 0;
#pragma unroll
  for (int j = 0; j < CONV_TN; ++j) {
    jj[j] = j0 + (j / 4) * CONV_CBAND + tx * 4 + j % 4;
    const long long jc = jj[j] < NG ? jj[j] : NG - 1;  // clamped; columns >= NG are not stored
    if (PARTIAL) {
      mstride = NG;
      base[j] = (long long)blockIdx.z * M * NG + jc;
    } else if (MODE == CONV_FPROP) {
      long long pq = (long long)P * Q, n = jc / pq;
      mstride = pq;
      base[j] = n * K * pq + (jc - n * pq);
    } else {  // DGRAD
      long long hw = (long long)H * W, n = jc / hw;
      mstride = hw;
      base[j] = n * C * hw + (jc - n * hw);
    }
  }
  bool contiguous[CONV_TN / 4];
#pragma unroll
  for (int g = 0; g < CONV_TN / 4; ++g)
    contiguous[g] = jj[4 * g + 3] < NG && base[4 * g + 3] == base[4 * g] + 3;
#pragma unroll
  for (int i = 0; i < CONV_TM; ++i) {
    const int m = m0 + (i / 4) * CONV_RBAND + ty * 4 + i % 4;
    if (m >= M) continue;
    const float bm = (MODE == CONV_FPROP && !PARTIAL && bias != 0) ? __ldg(bias + m) : 0.0f;
    float v[CONV_TN];
#pragma unroll
    for (int j = 0; j < CONV_TN; ++j) {
      v[j] = acc[i][j];
      if (MODE == CONV_FPROP && !PARTIAL) {
        if (bias != 0) v[j] += bm;
        if (relu) v[j] = conv_relu(v[j]);
      }
    }
#pragma unroll
    for (int g = 0; g < CONV_TN / 4; ++g) {
      float* row = out + base[4 * g] + m * mstride;
      if (contiguous[g] && ((unsigned long long)row & 15) == 0) {
        float4 v4;
        v4.x = v[4 * g];
        v4.y = v[4 * g + 1];
        v4.z = v[4 * g + 2];
        v4.w = v[4 * g + 3];
        *reinterpret_cast<float4*>(row) = v4;
      } else {
#pragma unroll
        for (int j = 4 * g; j < 4 * g + 4; ++j)
          if (jj[j] < NG) out[base[j] + m * mstride] = v[j];
      }
    }
  }
}

// The kernels below run conv_gemm in the instantiation chosen once, uniformly for the whole grid:
// CONV_TABLE when the host passes a tap table (Planner.conv_tap_table: R*S <= 32, dgrad stride 1,
// offsets that fit), else CONV_BOUNDS, or for dgrad with stride > 1 CONV_STRIDED. tab: the table (see
// CONV_TABLE) or NULL; the results are the same either way.
template <int MODE, bool PARTIAL>
__device__ __forceinline__ void conv_run(const float* __restrict__ A, const float* __restrict__ B,
                                         float* __restrict__ out, const float* __restrict__ bias, int relu, int N,
                                         int C, int H, int W, int K, int R, int S, int P, int Q, int stride, int pad,
                                         long long chunk, const int* __restrict__ tab) {
  __shared__ __align__(16) ConvSmem sm;
  const bool unit = MODE != CONV_DGRAD || stride == 1;
  if (unit && tab != 0 && R * S <= CONV_TAB_MAX_TAPS)
    conv_gemm<MODE, PARTIAL, CONV_TABLE>(sm, A, B, out, bias, relu, N, C, H, W, K, R, S, P, Q, stride, pad, chunk, tab);
  else if (unit)
    conv_gemm<MODE, PARTIAL, CONV_BOUNDS>(sm, A, B, out, bias, relu, N, C, H, W, K, R, S, P, Q, stride, pad, chunk, tab);
  else  // (an instantiation that exists already for FPROP and WGRAD, which never come here)
    conv_gemm<MODE, PARTIAL, MODE == CONV_DGRAD ? CONV_STRIDED : CONV_BOUNDS>(sm, A, B, out, bias, relu, N, C, H, W,
                                                                             K, R, S, P, Q, stride, pad, chunk, tab);
}

// y = conv(x, w) (+ bias[k]) (then conv_relu, NaN-propagating max(., 0), when relu != 0). bias may be NULL.
extern "C" __global__ void __launch_bounds__(CONV_THREADS, CONV_BLOCKS_PER_SM)
conv2d_fprop(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
             float* __restrict__ y, int N, int C, int H, int W, int K, int R, int S, int P, int Q, int stride,
             int pad, int relu, const int* __restrict__ tab) {
  conv_run<CONV_FPROP, false>(w, x, y, bias, relu, N, C, H, W, K, R, S, P, Q, stride, pad, (long long)C * R * S, tab);
}

// ws[z] (K, N*P*Q) = the part of conv(x, w) summed over kk = (c, r, s) in [z*chunk, (z+1)*chunk):
// split-K fprop for layers whose output alone gives too few blocks; conv2d_split_reduce adds the
// splits, the bias and the ReLU.
extern "C" __global__ void __launch_bounds__(CONV_THREADS, CONV_BLOCKS_PER_SM)
conv2d_fprop_partial(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ ws, int N,
                     int C, int H, int W, int K, int R, int S, int P, int Q, int stride, int pad,
                     long long chunk, const int* __restrict__ tab) {
  conv_run<CONV_FPROP, true>(w, x, ws, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, chunk, tab);
}

// dx = transposed convolution of dy with w (every dx element is written; unreached ones get 0).
extern "C" __global__ void __launch_bounds__(CONV_THREADS, CONV_BLOCKS_PER_SM)
conv2d_dgrad(const float* __restrict__ dy, const float* __restrict__ w, float* __restrict__ dx, int N, int C,
             int H, int W, int K, int R, int S, int P, int Q, int stride, int pad, const int* __restrict__ tab) {
  conv_run<CONV_DGRAD, false>(w, dy, dx, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, (long long)K * R * S, tab);
}

// ws[z] (C, N*H*W) = the part of dx summed over kk = (k, r, s) in [z*chunk, (z+1)*chunk): split-K dgrad.
extern "C" __global__ void __launch_bounds__(CONV_THREADS, CONV_BLOCKS_PER_SM)
conv2d_dgrad_partial(const float* __restrict__ dy, const float* __restrict__ w, float* __restrict__ ws, int N,
                     int C, int H, int W, int K, int R, int S, int P, int Q, int stride, int pad,
                     long long chunk, const int* __restrict__ tab) {
  conv_run<CONV_DGRAD, true>(w, dy, ws, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, chunk, tab);
}

// ws[z] = partial dw over the (n, p, q) range [z*chunk, (z+1)*chunk) for z = blockIdx.z.
extern "C" __global__ void __launch_bounds__(CONV_THREADS, CONV_BLOCKS_PER_SM)
conv2d_wgrad_partial(const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ ws, int N,
                     int C, int H, int W, int K, int R, int S, int P, int Q, int stride, int pad,
                     long long chunk, const int* __restrict__ tab) {
  conv_run<CONV_WGRAD, true>(dy, x, ws, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, chunk, tab);
}

// out[n][m][l] = sum over z < splits of ws[z][m][n*L + l] (+ bias[m]) (then conv_relu when relu != 0),
// for n < N, m < M, l < L; ws is (splits, M, N*L). fprop: L = P*Q, out = y; dgrad: L = H*W, out = dx;
// wgrad: N = 1, L = C*R*S, out = dw. bias may be NULL.
// Two levels, so that a deep split (wgrad of a small layer: hundreds of ranges) is not one long
// chain of dependent loads per output: a block takes SPLIT_REDUCE_OUTS consecutive outputs (NCHW
// order: coalesced loads and stores) and blockDim.x / SPLIT_REDUCE_OUTS lanes per output; lane l
// sums z = l, l + lanes, l + 2*lanes, ... in order, then the lanes' sums are added in lane order.
// The order is fixed by (splits, blockDim), so results are bit-reproducible run to run.
// Launch: block a multiple of SPLIT_REDUCE_OUTS up to SPLIT_REDUCE_THREADS_MAX (256: 8 lanes),
// 1-D grid-stride over groups of SPLIT_REDUCE_OUTS outputs (any grid size); static shared memory
// SPLIT_REDUCE_THREADS_MAX floats. (Both in constants.cuh.)

extern "C" __global__ void __launch_bounds__(SPLIT_REDUCE_THREADS_MAX)
conv2d_split_reduce(const float* __restrict__ ws, const float* __restrict__ bias, float* __restrict__ out, int splits,
                    int N, int M, long long L, int relu) {
  __shared__ float part[SPLIT_REDUCE_THREADS_MAX];  // part[lane * OUTS + output]
  const int lanes = blockDim.x / SPLIT_REDUCE_OUTS;
  const int oi = threadIdx.x % SPLIT_REDUCE_OUTS, lane = threadIdx.x / SPLIT_REDUCE_OUTS;
  const long long ML = (long long)M * L, NL = (long long)N * L, total = (long long)N * ML;
  const long long zstride = (long long)M * NL;
  for (long long o0 = (long long)blockIdx.x * SPLIT_REDUCE_OUTS; o0 < total;
       o0 += (long long)gridDim.x * SPLIT_REDUCE_OUTS) {  // the same trip count for every thread
    const long long o = o0 + oi;
    float s = 0.0f;
    int m = 0;
    if (o < total) {
      const long long n = o / ML;
      const long long rem = o - n * ML;
      m = (int)(rem / L);
      const float* p = ws + (long long)m * NL + n * L + (rem - (long long)m * L);  // ws[0][m][n*L + l]
      for (int z = lane; z < splits; z += lanes) s += __ldg(p + z * zstride);
    }
    part[threadIdx.x] = s;
    __syncthreads();  // every lane's sum stored
    if (lane == 0 && o < total) {
      float t = part[oi];
      for (int l = 1; l < lanes; ++l) t += part[l * SPLIT_REDUCE_OUTS + oi];
      if (bias != 0) t += __ldg(bias + m);
      if (relu) t = conv_relu(t);
      out[o] = t;
    }
    __syncthreads();  // the lane sums are read before the next group overwrites them
  }
}
