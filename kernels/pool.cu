// pool.cu: pooling, float32, NCHW: max and average pooling with zero padding and PyTorch's output size
// (floor or ceil_mode: the caller computes P, Q; contract.pool_output_size), and global average pooling.
//
// Window (p, q) covers rows h0 = p*stride - pad .. h0 + kernel - 1 and columns w0 = q*stride - pad ..
// w0 + kernel - 1 of the image, clipped to it (every window holds at least one image pixel: the
// caller's pad <= kernel//2 and output size guarantee it).
//
//   maxpool_fprop_u8, maxpool_fprop_i32
//       x (N, C, H, W) -> y (N, C, P, Q) float, argmax (N, C, P, Q) uint8 / int32: offset i*kernel + j
//       of the window maximum in the unclipped window (origin (h0, w0)), the first one on ties (uint8
//       when kernel*kernel <= 256, as numpy_ops). Padding never wins: the scan starts at the window's
//       first image pixel, so a window of -inf pixels points there. NaN propagates (as np.max): a
//       window holding a NaN gives y = NaN and argmax = its first NaN in row-major scan order
//       (np.argmax's rule), so the backward routes the gradient to that NaN; +inf and -inf are
//       ordinary values
//   maxpool_bprop_u8, maxpool_bprop_i32
//       dy (N, C, P, Q), argmax -> dx (N, C, H, W): every dx element gathers the dy of the windows
//       whose maximum it is (no atomics, fixed order), so overlapping windows (kernel > stride) sum
//       reproducibly; an argmax that names no image pixel of its window is dropped
//   avgpool_fprop
//       x (N, C, H, W) -> y (N, C, P, Q) = (sum of the window's image pixels, row-major) / divisor;
//       divisor = the window's positions inside [-pad, H + pad) x [-pad, W + pad) when
//       count_include_pad, else inside the image (torch.nn.AvgPool2d)
//   avgpool_bprop
//       dy (N, C, P, Q) -> dx (N, C, H, W): every dx element gathers dy / divisor of the windows that
//       hold it (p, then q ascending; no atomics)
//   global_avgpool_fprop
//       x (N*C rows of L = H*W) -> y (N*C,) = (sum of the row, in order) / L; one thread per row
//   global_avgpool_bprop
//       dy (N*C,) -> dx (N*C rows of L): dx = dy[row] / L
// Launch (every kernel): 1-D, any block size, grid-stride loop over the outputs (maxpool/avgpool
// fprop: N*C*P*Q, bprop: N*C*H*W, global fprop: N*C rows, global bprop: N*C*H*W elements; 64-bit
// indices; ints within one (n, c) plane); no shared memory.

// the windows p (q likewise) that hold padded row hp = h + pad: p*stride <= hp < p*stride + kernel,
// 0 <= p < P, as [*lo, *hi] (empty when *lo > *hi); lo = ceil((hp - kernel + 1) / stride), written so
// that no intermediate passes hp (any stride fits)
__device__ __forceinline__ void pool_windows_of(int hp, int kernel, int stride, int P, int* lo, int* hi) {
  *lo = hp >= kernel ? (hp - kernel) / stride + 1 : 0;
  *hi = hp / stride < P - 1 ? hp / stride : P - 1;
}

template <class IDX>
__device__ __forceinline__ void maxpool_fprop_body(const float* __restrict__ x, float* __restrict__ y,
                                                   IDX* __restrict__ argmax, long long NC, int H, int W,
                                                   int P, int Q, int kernel, int stride, int pad) {
  const long long total = NC * P * Q;
  for (long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x; o < total;
       o += (long long)gridDim.x * blockDim.x) {
    const long long nc = o / ((long long)P * Q);
    const int pq = (int)(o - nc * P * Q);
    const int h0 = (pq / Q) * stride - pad, w0 = (pq % Q) * stride - pad;  // window origin (may be < 0)
    const int i0 = h0 < 0 ? -h0 : 0, j0 = w0 < 0 ? -w0 : 0;                // first image row / column
    const int i1 = H - h0 < kernel ? H - h0 : kernel, j1 = W - w0 < kernel ? W - w0 : kernel;  // ends
    const float* plane = x + nc * H * W;
    float best = plane[(long long)(h0 + i0) * W + w0 + j0];  // the first image pixel: padding never wins
    int best_at = i0 * kernel + j0;
    for (int i = i0; i < i1; ++i)
      for (int j = j0; j < j1; ++j) {
        const float v = plane[(long long)(h0 + i) * W + w0 + j];
        // strict: the first maximum wins ties; a NaN beats any number (best == best: no NaN yet) and
        // then nothing beats it (v > NaN is false), so the first NaN wins
        if (v > best || (v != v && best == best)) {
          best = v;
          best_at = i * kernel + j;
        }
      }
    y[o] = best;
    argmax[o] = (IDX)best_at;
  }
}

template <class IDX>
__device__ __forceinline__ void maxpool_bprop_body(const float* __restrict__ dy, const IDX* __restrict__ argmax,
                                                   float* __restrict__ dx, long long NC, int H, int W, int P,
                                                   int Q, int kernel, int stride, int pad) {
  const long long total = NC * H * W;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    const long long nc = e / ((long long)H * W);
    const int hw = (int)(e - nc * H * W);
    const int hp = hw / W + pad, wp = hw % W + pad;  // padded coordinates
    int p_lo, p_hi, q_lo, q_hi;
    pool_windows_of(hp, kernel, stride, P, &p_lo, &p_hi);
    pool_windows_of(wp, kernel, stride, Q, &q_lo, &q_hi);
    float s = 0.0f;
    for (int p = p_lo; p <= p_hi; ++p)
      for (int q = q_lo; q <= q_hi; ++q) {
        const long long o = (nc * P + p) * Q + q;
        if ((int)argmax[o] == (hp - p * stride) * kernel + (wp - q * stride)) s += dy[o];
      }
    dx[e] = s;
  }
}

extern "C" __global__ void maxpool_fprop_u8(const float* __restrict__ x, float* __restrict__ y,
                                            unsigned char* __restrict__ argmax, long long NC, int H, int W, int P,
                                            int Q, int kernel, int stride, int pad) {
  maxpool_fprop_body<unsigned char>(x, y, argmax, NC, H, W, P, Q, kernel, stride, pad);
}

extern "C" __global__ void maxpool_fprop_i32(const float* __restrict__ x, float* __restrict__ y,
                                             int* __restrict__ argmax, long long NC, int H, int W, int P, int Q,
                                             int kernel, int stride, int pad) {
  maxpool_fprop_body<int>(x, y, argmax, NC, H, W, P, Q, kernel, stride, pad);
}

extern "C" __global__ void maxpool_bprop_u8(const float* __restrict__ dy, const unsigned char* __restrict__ argmax,
                                            float* __restrict__ dx, long long NC, int H, int W, int P, int Q,
                                            int kernel, int stride, int pad) {
  maxpool_bprop_body<unsigned char>(dy, argmax, dx, NC, H, W, P, Q, kernel, stride, pad);
}

extern "C" __global__ void maxpool_bprop_i32(const float* __restrict__ dy, const int* __restrict__ argmax,
                                             float* __restrict__ dx, long long NC, int H, int W, int P, int Q,
                                             int kernel, int stride, int pad) {
  maxpool_bprop_body<int>(dy, argmax, dx, NC, H, W, P, Q, kernel, stride, pad);
}

// the divisor's extent along one axis of the window starting at image row (column) h0: its positions
// inside [-pad, n + pad) when count_include_pad (h0 >= -pad always), else inside [0, n)
__device__ __forceinline__ int avgpool_count(int h0, int n, int kernel, int pad, int count_include_pad) {
  if (count_include_pad) return (h0 + kernel < n + pad ? h0 + kernel : n + pad) - h0;
  return (h0 + kernel < n ? h0 + kernel : n) - (h0 > 0 ? h0 : 0);
}

extern "C" __global__ void avgpool_fprop(const float* __restrict__ x, float* __restrict__ y, long long NC, int H,
                                         int W, int P, int Q, int kernel, int stride, int pad,
                                         int count_include_pad) {
  const long long total = NC * P * Q;
  for (long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x; o < total;
       o += (long long)gridDim.x * blockDim.x) {
    const long long nc = o / ((long long)P * Q);
    const int pq = (int)(o - nc * P * Q);
    const int h0 = (pq / Q) * stride - pad, w0 = (pq % Q) * stride - pad;
    const int hs = h0 > 0 ? h0 : 0, ws = w0 > 0 ? w0 : 0;
    const int he = h0 + kernel < H ? h0 + kernel : H, we = w0 + kernel < W ? w0 + kernel : W;
    const float* plane = x + nc * H * W;
    float s = 0.0f;
    for (int h = hs; h < he; ++h)
      for (int w = ws; w < we; ++w) s += plane[(long long)h * W + w];
    const int divisor = avgpool_count(h0, H, kernel, pad, count_include_pad) *
                        avgpool_count(w0, W, kernel, pad, count_include_pad);
    y[o] = s / (float)divisor;
  }
}

extern "C" __global__ void avgpool_bprop(const float* __restrict__ dy, float* __restrict__ dx, long long NC, int H,
                                         int W, int P, int Q, int kernel, int stride, int pad,
                                         int count_include_pad) {
  const long long total = NC * H * W;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    const long long nc = e / ((long long)H * W);
    const int hw = (int)(e - nc * H * W);
    int p_lo, p_hi, q_lo, q_hi;
    pool_windows_of(hw / W + pad, kernel, stride, P, &p_lo, &p_hi);
    pool_windows_of(hw % W + pad, kernel, stride, Q, &q_lo, &q_hi);
    float s = 0.0f;
    for (int p = p_lo; p <= p_hi; ++p) {
      const int rows = avgpool_count(p * stride - pad, H, kernel, pad, count_include_pad);
      for (int q = q_lo; q <= q_hi; ++q) {
        const int divisor = rows * avgpool_count(q * stride - pad, W, kernel, pad, count_include_pad);
        s += dy[(nc * P + p) * Q + q] / (float)divisor;
      }
    }
    dx[e] = s;
  }
}

extern "C" __global__ void global_avgpool_fprop(const float* __restrict__ x, float* __restrict__ y, long long NC,
                                                int L) {
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < NC;
       r += (long long)gridDim.x * blockDim.x) {
    const float* row = x + r * L;
    float s = 0.0f;
    for (int l = 0; l < L; ++l) s += row[l];
    y[r] = s / (float)L;
  }
}

extern "C" __global__ void global_avgpool_bprop(const float* __restrict__ dy, float* __restrict__ dx, long long NC,
                                                int L) {
  const long long total = NC * L;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x)
    dx[e] = dy[e / L] / (float)L;
}
