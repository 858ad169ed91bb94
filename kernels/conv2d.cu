// conv2d.cu: 2-D convolution (cross-correlation) as implicit GEMM, float32, NCHW, zero padding.
//
// One shared-memory tiled, register-blocked GEMM body C[M][NG] = sum_kk A[M][KR] * B[KR][NG] with
// three index mappings (MODE), so no im2col matrix is ever written to memory:
//
//   kernel                 M   NG        KR        A[m][kk]              B[kk][j]                   C[m][j]
//   conv2d_fprop           K   N*P*Q     C*R*S     w[m][c,r,s]           x[n][c][p*st-pad+r][..]    y[n][m][p][q] (+bias, relu)
//   conv2d_dgrad           C   N*H*W     K*R*S     w[k][m][r][s]         dy[n][k][p][q], p*st=h+pad-r  dx[n][m][h][w]
//   conv2d_wgrad_partial   K   C*R*S     N*P*Q     dy[n][m][p][q]        x[n][c][p*st-pad+r][..]    ws[z][m][j]
//   conv2d_wgrad_reduce    dw[i] = sum over z = 0..splits-1 of ws[z][i], in that order
//
// Shapes: x (N, C, H, W), w (K, C, R, S), bias (K,) or NULL, y / dy (N, K, P, Q) with
// P = (H + 2*pad - R)/stride + 1, Q likewise; ws (splits, K, C*R*S); dw (K, C, R, S).
// Launch (GEMM kernels): block CONV_THREADS (256, 1-D), grid (ceil(NG/64), ceil(M/64), splits),
// static shared memory 2 * 8 * 64 floats = 4 KiB. conv2d_fprop / conv2d_dgrad take splits = 1
// (chunk = KR). conv2d_wgrad_partial sums kk in [z*chunk, min(KR, (z+1)*chunk)) for z = blockIdx.z
// (chunk a multiple of CONV_BK); the batch reduction is split into a workspace and summed by
// conv2d_wgrad_reduce in a fixed order, without atomics, so dw is bit-reproducible run to run.
// conv2d_wgrad_reduce: 1-D grid-stride over n = K*C*R*S elements, any block/grid size.
//
// Tile: each block computes a 64x64 tile of C, stepping KR in slabs of 8; thread (ty, tx) in a
// 16x16 layout owns the 4x4 register block C[ty + 16*i][tx + 16*j] (strided so that shared-memory
// reads are broadcasts (A) and consecutive words (B), and global stores are coalesced along j).
// The next slab is fetched from global memory into registers while the current one is multiplied.
// Element offsets are 64-bit (N*C*H*W may pass 2^31); M, KR per image and the filter are int.

// Tile shape: production values here; CONV_BM / CONV_BN may be overridden with -D (the CPU harness
// tests other shapes too; BM, BN multiples of 4 with THREADS dividing BM*BK and BK*BN). Everything
// below is derived from them.
#ifndef CONV_BM
#define CONV_BM 64  // rows of C (output channels) per block
#endif
#ifndef CONV_BN
#define CONV_BN 64  // columns of C (output pixels / filter taps) per block
#endif
#define CONV_BK 8   // reduction slab
#define CONV_TM 4   // register block: rows per thread
#define CONV_TN 4   // register block: columns per thread
#define CONV_TX (CONV_BN / CONV_TN)
#define CONV_TY (CONV_BM / CONV_TM)
#define CONV_THREADS (CONV_TX * CONV_TY)              // 256
#define CONV_A_LOADS (CONV_BM * CONV_BK / CONV_THREADS)  // A slab elements per thread (2)
#define CONV_B_LOADS (CONV_BK * CONV_BN / CONV_THREADS)  // B slab elements per thread (2)

#define CONV_FPROP 0
#define CONV_DGRAD 1
#define CONV_WGRAD 2

// Column coordinates of one B column j, decoded once per thread (j is fixed over the KR loop).
struct ConvCol {
  long long base;  // FPROP/DGRAD: image offset n*C*H*W (x) or n*K*P*Q (dy); WGRAD: c*H*W
  int a, b;        // FPROP: p*st-pad, q*st-pad; DGRAD: h+pad, w+pad; WGRAD: r-pad, s-pad
  bool valid;      // j < NG
};

template <int MODE>
__device__ __forceinline__ ConvCol conv_decode_col(long long j, long long NG, int C, int H, int W, int K, int R,
                                                   int S, int P, int Q, int stride, int pad) {
  ConvCol col;
  col.valid = j < NG;
  if (!col.valid) j = 0;
  if (MODE == CONV_FPROP) {
    long long pq = (long long)P * Q;
    long long n = j / pq;
    int rem = (int)(j - n * pq);
    col.base = n * C * H * W;
    col.a = (rem / Q) * stride - pad;
    col.b = (rem % Q) * stride - pad;
  } else if (MODE == CONV_DGRAD) {
    long long hw = (long long)H * W;
    long long n = j / hw;
    int rem = (int)(j - n * hw);
    col.base = n * K * P * Q;
    col.a = rem / W + pad;
    col.b = rem % W + pad;
  } else {  // WGRAD: j = (c, r, s)
    int rs = R * S;
    int c = (int)j / rs;
    int rem = (int)j - c * rs;
    col.base = (long long)c * H * W;
    col.a = rem / S - pad;
    col.b = rem % S - pad;
  }
  return col;
}

// B[kk][j] for the column decoded in `col`; zero outside the (padded) input or KR range.
template <int MODE>
__device__ __forceinline__ float conv_load_b(const float* __restrict__ B, const ConvCol& col, long long kk,
                                             long long k_end, int C, int H, int W, int K, int R, int S,
                                             int P, int Q, int stride) {
  if (!col.valid || kk >= k_end) return 0.0f;
  if (MODE == CONV_FPROP) {  // kk = (c, r, s); B = x
    int rs = R * S;
    int c = (int)kk / rs;
    int rem = (int)kk - c * rs;
    int h = col.a + rem / S;
    int w = col.b + rem % S;
    if (h < 0 || h >= H || w < 0 || w >= W) return 0.0f;
    return __ldg(B + col.base + ((long long)c * H + h) * W + w);
  } else if (MODE == CONV_DGRAD) {  // kk = (k, r, s); B = dy
    int rs = R * S;
    int k = (int)kk / rs;
    int rem = (int)kk - k * rs;
    int hp = col.a - rem / S;  // = p * stride when the tap r reaches output row p
    int wp = col.b - rem % S;
    if (hp < 0 || wp < 0) return 0.0f;
    int p = hp / stride, q = wp / stride;
    if (p * stride != hp || q * stride != wp || p >= P || q >= Q) return 0.0f;
    return __ldg(B + col.base + ((long long)k * P + p) * Q + q);
  } else {  // WGRAD: kk = (n, p, q); B = x
    long long pq = (long long)P * Q;
    long long n = kk / pq;
    int rem = (int)(kk - n * pq);
    int h = (rem / Q) * stride + col.a;
    int w = (rem % Q) * stride + col.b;
    if (h < 0 || h >= H || w < 0 || w >= W) return 0.0f;
    return __ldg(B + n * C * H * W + col.base + (long long)h * W + w);
  }
}

// A[m][kk]; zero outside M x [.., k_end).
template <int MODE>
__device__ __forceinline__ float conv_load_a(const float* __restrict__ A, int m, long long kk, int M,
                                             long long KR, long long k_end, int C, int K, int R, int S,
                                             int P, int Q) {
  if (m >= M || kk >= k_end) return 0.0f;
  if (MODE == CONV_FPROP) {  // w (K, C*R*S)
    return __ldg(A + (long long)m * KR + kk);
  } else if (MODE == CONV_DGRAD) {  // w (K, C, R, S), m = c, kk = (k, r, s)
    int rs = R * S;
    int k = (int)kk / rs;
    return __ldg(A + ((long long)k * C + m) * rs + ((int)kk - k * rs));
  } else {  // WGRAD: dy (N, K, P*Q), kk = (n, p, q)
    long long pq = (long long)P * Q;
    long long n = kk / pq;
    return __ldg(A + (n * K + m) * pq + (kk - n * pq));
  }
}

template <int MODE>
__device__ __forceinline__ void conv_gemm(const float* __restrict__ A, const float* __restrict__ B,
                                          float* __restrict__ out, const float* __restrict__ bias, int relu,
                                          int N, int C, int H, int W, int K, int R, int S, int P, int Q,
                                          int stride, int pad, long long chunk) {
  __shared__ float As[CONV_BK][CONV_BM];  // As[kk][m]
  __shared__ float Bs[CONV_BK][CONV_BN];  // Bs[kk][j]

  const int M = (MODE == CONV_DGRAD) ? C : K;
  const long long NG = (MODE == CONV_FPROP)   ? (long long)N * P * Q
                       : (MODE == CONV_DGRAD) ? (long long)N * H * W
                                              : (long long)C * R * S;
  const long long KR = (MODE == CONV_FPROP)   ? (long long)C * R * S
                       : (MODE == CONV_DGRAD) ? (long long)K * R * S
                                              : (long long)N * P * Q;
  const long long k_begin = (long long)blockIdx.z * chunk;
  const long long k_end = (k_begin + chunk < KR) ? k_begin + chunk : KR;

  const int t = threadIdx.x;
  const int tx = t % CONV_TX, ty = t / CONV_TX;
  const int m0 = blockIdx.y * CONV_BM;
  const long long j0 = (long long)blockIdx.x * CONV_BN;

  // loader roles: A slab BM x BK (kk fastest), B slab BK x BN (j fastest)
  const int a_kk = t % CONV_BK, a_m = t / CONV_BK;  // m = a_m + i * (THREADS / BK)
  const int b_j = t % CONV_BN, b_kk = t / CONV_BN;  // kk = b_kk + i * (THREADS / BN)
  const ConvCol col = conv_decode_col<MODE>(j0 + b_j, NG, C, H, W, K, R, S, P, Q, stride, pad);

  float acc[CONV_TM][CONV_TN];
  for (int i = 0; i < CONV_TM; ++i)
    for (int j = 0; j < CONV_TN; ++j) acc[i][j] = 0.0f;

  float a_reg[CONV_A_LOADS], b_reg[CONV_B_LOADS];
#pragma unroll
  for (int i = 0; i < CONV_A_LOADS; ++i)
    a_reg[i] = conv_load_a<MODE>(A, m0 + a_m + i * (CONV_THREADS / CONV_BK), k_begin + a_kk, M, KR, k_end, C, K,
                                 R, S, P, Q);
#pragma unroll
  for (int i = 0; i < CONV_B_LOADS; ++i)
    b_reg[i] = conv_load_b<MODE>(B, col, k_begin + b_kk + i * (CONV_THREADS / CONV_BN), k_end, C, H, W, K, R, S,
                                 P, Q, stride);

  for (long long k0 = k_begin; k0 < k_end; k0 += CONV_BK) {
    __syncthreads();  // every thread is done reading the previous slab
#pragma unroll
    for (int i = 0; i < CONV_A_LOADS; ++i) As[a_kk][a_m + i * (CONV_THREADS / CONV_BK)] = a_reg[i];
#pragma unroll
    for (int i = 0; i < CONV_B_LOADS; ++i) Bs[b_kk + i * (CONV_THREADS / CONV_BN)][b_j] = b_reg[i];
    __syncthreads();  // slab complete
    const long long k1 = k0 + CONV_BK;
    if (k1 < k_end) {  // prefetch the next slab while this one is multiplied
#pragma unroll
      for (int i = 0; i < CONV_A_LOADS; ++i)
        a_reg[i] = conv_load_a<MODE>(A, m0 + a_m + i * (CONV_THREADS / CONV_BK), k1 + a_kk, M, KR, k_end, C, K, R,
                                     S, P, Q);
#pragma unroll
      for (int i = 0; i < CONV_B_LOADS; ++i)
        b_reg[i] = conv_load_b<MODE>(B, col, k1 + b_kk + i * (CONV_THREADS / CONV_BN), k_end, C, H, W, K, R, S, P,
                                     Q, stride);
    }
#pragma unroll
    for (int kk = 0; kk < CONV_BK; ++kk) {
      float a[CONV_TM], b[CONV_TN];
#pragma unroll
      for (int i = 0; i < CONV_TM; ++i) a[i] = As[kk][ty + CONV_TY * i];
#pragma unroll
      for (int j = 0; j < CONV_TN; ++j) b[j] = Bs[kk][tx + CONV_TX * j];
#pragma unroll
      for (int i = 0; i < CONV_TM; ++i)
#pragma unroll
        for (int j = 0; j < CONV_TN; ++j) acc[i][j] += a[i] * b[j];
    }
  }

  // epilogue: scatter the 4x4 register block to its NCHW (or workspace) location
  for (int j = 0; j < CONV_TN; ++j) {
    const long long jj = j0 + tx + CONV_TX * j;
    if (jj >= NG) continue;
    long long base;  // offset of C[0][jj]; C[m][jj] = base + m * mstride
    long long mstride;
    if (MODE == CONV_FPROP) {
      long long pq = (long long)P * Q, n = jj / pq;
      mstride = pq;
      base = n * K * pq + (jj - n * pq);
    } else if (MODE == CONV_DGRAD) {
      long long hw = (long long)H * W, n = jj / hw;
      mstride = hw;
      base = n * C * hw + (jj - n * hw);
    } else {
      mstride = NG;
      base = (long long)blockIdx.z * M * NG + jj;
    }
    for (int i = 0; i < CONV_TM; ++i) {
      const int m = m0 + ty + CONV_TY * i;
      if (m >= M) continue;
      float v = acc[i][j];
      if (MODE == CONV_FPROP) {
        if (bias != 0) v += __ldg(bias + m);
        if (relu) v = fmaxf(v, 0.0f);
      }
      out[base + m * mstride] = v;
    }
  }
}

// y = conv(x, w) (+ bias[k]) (then max(., 0) when relu != 0). bias may be NULL.
extern "C" __global__ void __launch_bounds__(CONV_THREADS)
conv2d_fprop(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ bias,
             float* __restrict__ y, int N, int C, int H, int W, int K, int R, int S, int P, int Q, int stride,
             int pad, int relu) {
  conv_gemm<CONV_FPROP>(w, x, y, bias, relu, N, C, H, W, K, R, S, P, Q, stride, pad,
                        (long long)C * R * S);
}

// dx = transposed convolution of dy with w (every dx element is written; unreached ones get 0).
extern "C" __global__ void __launch_bounds__(CONV_THREADS)
conv2d_dgrad(const float* __restrict__ dy, const float* __restrict__ w, float* __restrict__ dx, int N, int C,
             int H, int W, int K, int R, int S, int P, int Q, int stride, int pad) {
  conv_gemm<CONV_DGRAD>(w, dy, dx, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, (long long)K * R * S);
}

// ws[z] = partial dw over the (n, p, q) range [z*chunk, (z+1)*chunk) for z = blockIdx.z.
extern "C" __global__ void __launch_bounds__(CONV_THREADS)
conv2d_wgrad_partial(const float* __restrict__ dy, const float* __restrict__ x, float* __restrict__ ws, int N,
                     int C, int H, int W, int K, int R, int S, int P, int Q, int stride, int pad,
                     long long chunk) {
  conv_gemm<CONV_WGRAD>(dy, x, ws, 0, 0, N, C, H, W, K, R, S, P, Q, stride, pad, chunk);
}

// dw[i] = ws[0][i] + ws[1][i] + ... + ws[splits-1][i] (fixed order: reproducible).
extern "C" __global__ void conv2d_wgrad_reduce(const float* __restrict__ ws, float* __restrict__ dw, int splits,
                                               long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    float s = 0.0f;
    for (int z = 0; z < splits; ++z) s += ws[(long long)z * n + i];
    dw[i] = s;
  }
}
