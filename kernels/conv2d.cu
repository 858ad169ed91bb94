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
// Shapes: x (N, C, H, W), w (K, C, R, S), bias (K,) or NULL, y / dy (N, K, P, Q) with
// P = (H + 2*pad - R)/stride + 1, Q likewise; ws (splits, M, NG); dw (K, C, R, S).
// Launch (GEMM kernels): block CONV_THREADS = (BM/4)*(BN/4) threads (1-D), grid (ceil(NG/BN),
// ceil(M/BM), splits), static shared memory 8*(BM+4) + 8*BN floats. The tile (BM, BN) is chosen
// at compile time (-DCONV_BM, -DCONV_BN; 64x64 by default, 32x128 for GEMMs of <= 32 rows: see
// cupy_ops.conv_tile). conv2d_fprop / conv2d_dgrad write C in place (splits = 1, chunk = KR).
// Split-K: the *_partial kernels sum kk in [z*chunk, min(KR, (z+1)*chunk)) for z = blockIdx.z
// (chunk a multiple of CONV_BK) into a workspace, and conv2d_split_reduce adds the splits in a
// fixed order, without atomics, so every result is bit-reproducible run to run. wgrad always
// splits its N*P*Q reduction; fprop and dgrad split when their output alone gives too few blocks
// to fill the GPU (cupy_ops.gemm_split).
// conv2d_split_reduce: see its comment (two-level, fixed order).
//
// Tile: each block computes a BM x BN tile of C, stepping KR in slabs of 8; thread (ty, tx) owns
// the 4x4 register block C[ty*4 + i][tx*4 + j] and reads its 4 rows of As and 4 columns of Bs as
// one float4 each per kk (a warp reads broadcast float4s of As and consecutive float4s of Bs).
// The next slab is fetched from global memory into registers while the current one is multiplied;
// the loaders step the digits of kk ((c, r, s) or (n, p, q)) from slab to slab without integer
// division. The epilogue stores a row of the block as one float4 when its 4 columns are
// consecutive in memory and 16-byte aligned, else element by element.
// Offsets: image bases and workspace offsets are 64-bit (N*C*H*W may pass 2^31); offsets within one
// image and within the filter are int (cupy_ops.conv_geometry checks that C*H*W, K*P*Q, K*C*R*S fit).

// Tile shape: production values here; CONV_BM / CONV_BN may be overridden with -D (cupy_ops compiles
// one variant per tile it launches; the CPU harness tests several). BM, BN multiples of 4 with
// THREADS dividing BM*BK and BK*BN. Everything below is derived from them.
#ifndef CONV_BM
#define CONV_BM 64  // rows of C (output channels) per block
#endif
#ifndef CONV_BN
#define CONV_BN 64  // columns of C (output pixels / filter taps) per block
#endif
#define CONV_BK 8   // reduction slab
#define CONV_TM 4   // register block: rows per thread (one float4 of As per kk)
#define CONV_TN 4   // register block: columns per thread (one float4 of Bs per kk)
#define CONV_TX (CONV_BN / CONV_TN)
#define CONV_TY (CONV_BM / CONV_TM)
#define CONV_THREADS (CONV_TX * CONV_TY)              // 256
#define CONV_A_LOADS (CONV_BM * CONV_BK / CONV_THREADS)  // A slab elements per thread (2)
#define CONV_B_LOADS (CONV_BK * CONV_BN / CONV_THREADS)  // B slab elements per thread (2)
// B loader: load i of a thread is B[b_kk + i*KSTEP][b_j + i*JSTEP]. With 2 loads per thread (64x64) a
// thread keeps one column and steps the digits of kk between its loads; with 4 or more (32x128) it
// keeps one row kk and decodes its columns once, before the loop (fewer instructions per load there,
// more registers: the choice that gave the shorter main loop for each tile, see bench/sass_mix.py).
#if CONV_B_LOADS >= 4
#define CONV_B_KSTEP 0
#define CONV_B_JSTEP (CONV_THREADS / CONV_BK)
#define CONV_B_ROW (CONV_THREADS / CONV_BK)  // threads sharing one row kk of the slab
#else
#define CONV_B_KSTEP (CONV_THREADS / CONV_BN)
#define CONV_B_JSTEP 0
#define CONV_B_ROW CONV_BN
#endif
#define CONV_B_COLS (CONV_B_JSTEP ? CONV_B_LOADS : 1)  // columns decoded per thread
// Row pitch of As: 4 floats of padding put the 8 kk rows that one warp's A stores touch in
// different banks, and keep every row 16-byte aligned for the float4 reads.
#define CONV_AS_PITCH (CONV_BM + 4)

// What the loaders, the float4 reads and the bank layout rely on (a tile choice that breaks one
// fails to compile instead of computing garbage or serialising the shared-memory stores).
static_assert(CONV_BM % CONV_TM == 0 && CONV_BN % CONV_TN == 0, "BM, BN: multiples of the 4x4 register block");
static_assert(CONV_THREADS % CONV_BK == 0 && CONV_THREADS % CONV_B_ROW == 0 && CONV_BN % CONV_B_ROW == 0,
              "THREADS: a multiple of BK, and of the B loader's row (BN or THREADS/BK)");
static_assert((CONV_BM * CONV_BK) % CONV_THREADS == 0 && (CONV_BK * CONV_BN) % CONV_THREADS == 0,
              "every thread loads the same number of A and of B slab elements");
static_assert(CONV_AS_PITCH % 32 != 0, "As pitch: not a multiple of 32 banks (8-way store conflicts)");
static_assert(CONV_THREADS <= 1024, "at most 1,024 threads per block");

#define CONV_FPROP 0
#define CONV_DGRAD 1
#define CONV_WGRAD 2

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

// Column coordinates of one B column j, decoded once per thread (j is fixed over the KR loop).
struct ConvCol {
  const float* img;  // FPROP: x + n*C*H*W (its image); DGRAD: dy + n*K*P*Q; WGRAD: x + c*H*W (plane c of image 0)
  int a, b;          // FPROP: p*st-pad, q*st-pad; DGRAD: h+pad, w+pad; WGRAD: r-pad, s-pad
  bool valid;        // j < NG
};

template <int MODE>
__device__ __forceinline__ ConvCol conv_decode_col(const float* __restrict__ B, long long j, long long NG, int C,
                                                   int H, int W, int K, int R, int S, int P, int Q, int stride,
                                                   int pad) {
  ConvCol col;
  col.valid = j < NG;
  if (!col.valid) j = 0;
  if (MODE == CONV_FPROP) {
    long long pq = (long long)P * Q;
    long long n = j / pq;
    int rem = (int)(j - n * pq);
    col.img = B + n * C * H * W;
    col.a = (rem / Q) * stride - pad;
    col.b = (rem % Q) * stride - pad;
  } else if (MODE == CONV_DGRAD) {
    long long hw = (long long)H * W;
    long long n = j / hw;
    int rem = (int)(j - n * hw);
    col.img = B + n * K * P * Q;
    col.a = rem / W + pad;
    col.b = rem % W + pad;
  } else {  // WGRAD: j = (c, r, s)
    int rs = R * S;
    int c = (int)j / rs;
    int rem = (int)j - c * rs;
    col.img = B + (long long)c * H * W;
    col.a = rem / S - pad;
    col.b = rem % S - pad;
  }
  return col;
}

// B[kk][j] for the column decoded in `col`, kk given by its digits d; zero outside the (padded)
// input or the KR range.
template <int MODE>
__device__ __forceinline__ float conv_load_b(const ConvCol& col, const Digits& d, long long kk, long long k_end,
                                             int C, int H, int W, int P, int Q, int stride) {
  if (!col.valid || kk >= k_end) return 0.0f;
  if (MODE == CONV_FPROP) {  // d = (c, r, s); B = x
    const int h = col.a + d.mid, w = col.b + d.lo;
    if (h < 0 || h >= H || w < 0 || w >= W) return 0.0f;
    return __ldg(col.img + (d.hi * H + h) * W + w);  // < C*H*W: an int
  } else if (MODE == CONV_DGRAD) {  // d = (k, r, s); B = dy
    int p = col.a - d.mid;  // = p * stride when the tap r reaches output row p
    int q = col.b - d.lo;
    if (p < 0 || q < 0) return 0.0f;
    if (stride != 1) {  // uniform branch: unit stride (the common case) divides nothing
      const int hp = p, wp = q;
      p = hp / stride;
      q = wp / stride;
      if (p * stride != hp || q * stride != wp) return 0.0f;
    }
    if (p >= P || q >= Q) return 0.0f;
    return __ldg(col.img + (d.hi * P + p) * Q + q);  // < K*P*Q: an int
  } else {  // WGRAD: d = (n, p, q); B = x
    const int h = d.mid * stride + col.a, w = d.lo * stride + col.b;
    if (h < 0 || h >= H || w < 0 || w >= W) return 0.0f;
    return __ldg(col.img + (long long)d.hi * (C * H * W) + (h * W + w));
  }
}

// A[m][kk], kk given by its digits d (FPROP: by kk itself); zero outside M x [.., k_end).
template <int MODE>
__device__ __forceinline__ float conv_load_a(const float* __restrict__ A, int m, const Digits& d, long long kk,
                                             int M, long long KR, long long k_end, int C, int K, int R, int S,
                                             int P, int Q) {
  if (m >= M || kk >= k_end) return 0.0f;
  if (MODE == CONV_FPROP) {  // w (K, C*R*S); offsets < K*C*R*S: ints
    return __ldg(A + (m * (int)KR + (int)kk));
  } else if (MODE == CONV_DGRAD) {  // w (K, C, R, S), m = c, d = (k, r, s)
    return __ldg(A + (((d.hi * C + m) * R + d.mid) * S + d.lo));
  } else {  // WGRAD: dy (N, K, P, Q), d = (n, p, q); image n at a 64-bit offset, within it an int
    return __ldg(A + (long long)d.hi * (K * P * Q) + ((m * P + d.mid) * Q + d.lo));
  }
}

// PARTIAL: write C[m][j] of split z = blockIdx.z to the workspace out[z][m][j] (no bias, no ReLU)
// instead of its NCHW place; conv2d_split_reduce adds the splits. WGRAD is always PARTIAL.
template <int MODE, bool PARTIAL>
__device__ __forceinline__ void conv_gemm(const float* __restrict__ A, const float* __restrict__ B,
                                          float* __restrict__ out, const float* __restrict__ bias, int relu,
                                          int N, int C, int H, int W, int K, int R, int S, int P, int Q,
                                          int stride, int pad, long long chunk) {
  __shared__ __align__(16) float As[CONV_BK][CONV_AS_PITCH];  // As[kk][m]
  __shared__ __align__(16) float Bs[CONV_BK][CONV_BN];        // Bs[kk][j]

  const int M = (MODE == CONV_DGRAD) ? C : K;
  const long long NG = (MODE == CONV_FPROP)   ? (long long)N * P * Q
                       : (MODE == CONV_DGRAD) ? (long long)N * H * W
                                              : (long long)C * R * S;
  const long long KR = (MODE == CONV_FPROP)   ? (long long)C * R * S
                       : (MODE == CONV_DGRAD) ? (long long)K * R * S
                                              : (long long)N * P * Q;
  const int mid_radix = (MODE == CONV_WGRAD) ? P : R;  // digits of kk
  const int lo_radix = (MODE == CONV_WGRAD) ? Q : S;
  const Digits step = digits_of(CONV_BK, mid_radix, lo_radix);
  const long long k_begin = (long long)blockIdx.z * chunk;
  const long long k_end = (k_begin + chunk < KR) ? k_begin + chunk : KR;

  const int t = threadIdx.x;
  const int tx = t % CONV_TX, ty = t / CONV_TX;
  const int m0 = blockIdx.y * CONV_BM;
  const long long j0 = (long long)blockIdx.x * CONV_BN;

  // loader roles: A slab BM x BK (kk fastest), B slab BK x BN (j fastest, see CONV_B_KSTEP). All A
  // loads of a thread share one kk; the digits of a later B load's kk are stepped from load 0's.
  const int a_kk = t % CONV_BK, a_m = t / CONV_BK;  // m = a_m + i * (THREADS / BK)
  const int b_j = t % CONV_B_ROW, b_kk = t / CONV_B_ROW;  // load i: B[b_kk + i*KSTEP][b_j + i*JSTEP]
  ConvCol col[CONV_B_COLS];
#pragma unroll
  for (int c = 0; c < CONV_B_COLS; ++c)
    col[c] = conv_decode_col<MODE>(B, j0 + b_j + c * CONV_B_JSTEP, NG, C, H, W, K, R, S, P, Q, stride, pad);
  const Digits b_step = digits_of(CONV_B_KSTEP, mid_radix, lo_radix);  // load i -> i + 1
  long long a_k = k_begin + a_kk, b_k = k_begin + b_kk;  // kk of the A loads, of B load 0
  Digits a_d = digits_of(a_k, mid_radix, lo_radix);
  Digits b_d = digits_of(b_k, mid_radix, lo_radix);
  // one slab of B into b_reg, load i at kk = b_k + i*KSTEP (digits from b_d) of column i*JSTEP
  auto load_b = [&](float* b_reg) {
    Digits d = b_d;
#pragma unroll
    for (int i = 0; i < CONV_B_LOADS; ++i) {
      if (CONV_B_KSTEP && i > 0) digits_step(d, b_step, mid_radix, lo_radix);
      b_reg[i] = conv_load_b<MODE>(col[CONV_B_JSTEP ? i : 0], d, b_k + i * CONV_B_KSTEP, k_end, C, H, W, P, Q,
                                   stride);
    }
  };

  float acc[CONV_TM][CONV_TN];
  for (int i = 0; i < CONV_TM; ++i)
    for (int j = 0; j < CONV_TN; ++j) acc[i][j] = 0.0f;

  float a_reg[CONV_A_LOADS], b_reg[CONV_B_LOADS];
#pragma unroll
  for (int i = 0; i < CONV_A_LOADS; ++i)
    a_reg[i] = conv_load_a<MODE>(A, m0 + a_m + i * (CONV_THREADS / CONV_BK), a_d, a_k, M, KR, k_end, C, K, R, S,
                                 P, Q);
  load_b(b_reg);

  for (long long k0 = k_begin; k0 < k_end; k0 += CONV_BK) {
    __syncthreads();  // every thread is done reading the previous slab
#pragma unroll
    for (int i = 0; i < CONV_A_LOADS; ++i) As[a_kk][a_m + i * (CONV_THREADS / CONV_BK)] = a_reg[i];
#pragma unroll
    for (int i = 0; i < CONV_B_LOADS; ++i) Bs[b_kk + i * CONV_B_KSTEP][b_j + i * CONV_B_JSTEP] = b_reg[i];
    __syncthreads();  // slab complete
    if (k0 + CONV_BK < k_end) {  // prefetch the next slab while this one is multiplied
      a_k += CONV_BK;
      b_k += CONV_BK;
      digits_step(a_d, step, mid_radix, lo_radix);
#pragma unroll
      for (int i = 0; i < CONV_A_LOADS; ++i)
        a_reg[i] = conv_load_a<MODE>(A, m0 + a_m + i * (CONV_THREADS / CONV_BK), a_d, a_k, M, KR, k_end, C, K, R,
                                     S, P, Q);
      digits_step(b_d, step, mid_radix, lo_radix);
      load_b(b_reg);
    }
#pragma unroll
    for (int kk = 0; kk < CONV_BK; ++kk) {
      // thread (ty, tx) owns rows ty*4 .. ty*4+3 and columns tx*4 .. tx*4+3: one 16-byte shared
      // load each (a warp reads two broadcast float4 of As and 16 consecutive float4 of Bs)
      const float4 a4 = *reinterpret_cast<const float4*>(&As[kk][ty * CONV_TM]);
      const float4 b4 = *reinterpret_cast<const float4*>(&Bs[kk][tx * CONV_TN]);
      const float a[CONV_TM] = {a4.x, a4.y, a4.z, a4.w};
      const float b[CONV_TN] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
      for (int i = 0; i < CONV_TM; ++i)
#pragma unroll
        for (int j = 0; j < CONV_TN; ++j) acc[i][j] += a[i] * b[j];
    }
  }

  // epilogue: the 4x4 register block to its NCHW (or workspace) location. C[m][jj] lives at
  // base[j] + m * mstride; when the thread's 4 columns are consecutive in memory (same image) and
  // the row's address is 16-byte aligned, each row is one float4 store.
  long long base[CONV_TN];
  long long mstride = 0;
  const long long jj0 = j0 + tx * CONV_TN;
#pragma unroll
  for (int j = 0; j < CONV_TN; ++j) {
    const long long jj = jj0 + j < NG ? jj0 + j : NG - 1;  // clamped; columns >= NG are not stored
    if (PARTIAL) {
      mstride = NG;
      base[j] = (long long)blockIdx.z * M * NG + jj;
    } else if (MODE == CONV_FPROP) {
      long long pq = (long long)P * Q, n = jj / pq;
      mstride = pq;
      base[j] = n * K * pq + (jj - n * pq);
    } else {  // DGRAD
      long long hw = (long long)H * W, n = jj / hw;
      mstride = hw;
      base[j] = n * C * hw + (jj - n * hw);
    }
  }
  const bool contiguous = jj0 + CONV_TN <= NG && base[CONV_TN - 1] == base[0] + (CONV_TN - 1);
#pragma unroll
  for (int i = 0; i < CONV_TM; ++i) {
    const int m = m0 + ty * CONV_TM + i;
    if (m >= M) continue;
    float v[CONV_TN];
#pragma unroll
    for (int j = 0; j < CONV_TN; ++j) {
      v[j] = acc[i][j];
      if (MODE == CONV_FPROP && !PARTIAL) {
        if (bias != 0) v[j] += __ldg(bias + m);
        if (relu) v[j] = fmaxf(v[j], 0.0f);
      }
    }
    float* row = out + base[0] + m * mstride;
    if (contiguous && ((unsigned long long)row & 15) == 0) {
      float4 v4;
      v4.x = v[0];
      v4.y = v[1];
      v4.z = v[2];
      v4.w = v[3];
      *reinterpret_cast<float4*>(row) = v4;
    } else {
#pragma unroll
      for (int j = 0; j < CONV_TN; ++j)
        if (jj0 + j < NG) out[base[j] + m * mstride] = v[j];
    }
  }
}

// y = conv(x, w) (+ bias[k]) (then max(., 0) when relu != 0). bias may be NULL.
extern "C" __global__ void __launch_bounds__(CONV_THREADS, 2)
conv2d_fprop(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
             float* __restrict__ y, int N, int C, int H, int W, int K, int R, int S, int P, int Q, int stride,
             int pad, int relu) {
  conv_gemm<CONV_FPROP, false>(w, x, y, bias, relu, N, C, H, W, K, R, S, P, Q, stride, pad,
                               (long long)C * R * S);
}

// ws[z] (K, N*P*Q) = the part of conv(x, w) summed over kk = (c, r, s) in [z*chunk, (z+1)*chunk):
// split-K fprop for layers whose output alone gives too few blocks; conv2d_split_reduce adds the
// splits, the bias and the ReLU.
extern "C" __global__ void __launch_bounds__(CONV_THREADS, 2)
conv2d_fprop_partial(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ ws, int N,
                     int C, int H, int W, int K, int R, int S, int P, int Q, int stride, int pad,
                     long long chunk) {
  conv_gemm<CONV_FPROP, true>(w, x, ws, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, chunk);
}

// dx = transposed convolution of dy with w (every dx element is written; unreached ones get 0).
extern "C" __global__ void __launch_bounds__(CONV_THREADS, 2)
conv2d_dgrad(const float* __restrict__ dy, const float* __restrict__ w, float* __restrict__ dx, int N, int C,
             int H, int W, int K, int R, int S, int P, int Q, int stride, int pad) {
  conv_gemm<CONV_DGRAD, false>(w, dy, dx, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, (long long)K * R * S);
}

// ws[z] (C, N*H*W) = the part of dx summed over kk = (k, r, s) in [z*chunk, (z+1)*chunk): split-K dgrad.
extern "C" __global__ void __launch_bounds__(CONV_THREADS, 2)
conv2d_dgrad_partial(const float* __restrict__ dy, const float* __restrict__ w, float* __restrict__ ws, int N,
                     int C, int H, int W, int K, int R, int S, int P, int Q, int stride, int pad,
                     long long chunk) {
  conv_gemm<CONV_DGRAD, true>(w, dy, ws, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, chunk);
}

// ws[z] = partial dw over the (n, p, q) range [z*chunk, (z+1)*chunk) for z = blockIdx.z.
extern "C" __global__ void __launch_bounds__(CONV_THREADS, 2)
conv2d_wgrad_partial(const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ ws, int N,
                     int C, int H, int W, int K, int R, int S, int P, int Q, int stride, int pad,
                     long long chunk) {
  conv_gemm<CONV_WGRAD, true>(dy, x, ws, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, chunk);
}

// out[n][m][l] = sum over z < splits of ws[z][m][n*L + l] (+ bias[m]) (then max(., 0) when relu != 0),
// for n < N, m < M, l < L; ws is (splits, M, N*L). fprop: L = P*Q, out = y; dgrad: L = H*W, out = dx;
// wgrad: N = 1, L = C*R*S, out = dw. bias may be NULL.
// Two levels, so that a deep split (wgrad of a small layer: hundreds of ranges) is not one long
// chain of dependent loads per output: a block takes SPLIT_REDUCE_OUTS consecutive outputs (NCHW
// order: coalesced loads and stores) and blockDim.x / SPLIT_REDUCE_OUTS lanes per output; lane l
// sums z = l, l + lanes, l + 2*lanes, ... in order, then the lanes' sums are added in lane order.
// The order is fixed by (splits, blockDim), so results are bit-reproducible run to run.
// Launch: block a multiple of SPLIT_REDUCE_OUTS up to SPLIT_REDUCE_THREADS_MAX (256: 8 lanes),
// 1-D grid-stride over groups of SPLIT_REDUCE_OUTS outputs (any grid size); static shared memory
// SPLIT_REDUCE_THREADS_MAX floats.
#define SPLIT_REDUCE_OUTS 32
#define SPLIT_REDUCE_THREADS_MAX 256

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
      if (relu) t = fmaxf(t, 0.0f);
      out[o] = t;
    }
    __syncthreads();  // the lane sums are read before the next group overwrites them
  }
}
