// pool.cu: max pooling, float32, NCHW, no padding, floor output size; windows may overlap.
//
//   maxpool_fprop_u8, maxpool_fprop_i32
//       x (N, C, H, W) -> y (N, C, P, Q) float, argmax (N, C, P, Q) uint8 / int32: offset i*kernel + j
//       of the window maximum, the first one on ties (uint8 when kernel*kernel <= 256, as numpy_ops).
//       NaN propagates (as np.max): a window holding a NaN gives y = NaN and argmax = its first NaN in
//       row-major scan order (np.argmax's rule), so the backward routes the gradient to that NaN;
//       +inf and -inf are ordinary values (a window of -inf only: offset 0)
//   maxpool_bprop_u8, maxpool_bprop_i32
//       dy (N, C, P, Q), argmax -> dx (N, C, H, W): every dx element gathers the dy of the windows
//       whose maximum it is (no atomics, fixed order), so overlapping windows (kernel > stride) sum
//       reproducibly
// P = (H - kernel)/stride + 1, Q likewise. Launch: 1-D, any block size, grid-stride loop over the
// outputs (fprop: N*C*P*Q, bprop: N*C*H*W elements, 64-bit indices); no shared memory.

template <class IDX>
__device__ __forceinline__ void maxpool_fprop_body(const float* __restrict__ x, float* __restrict__ y,
                                                   IDX* __restrict__ argmax, long long NC, int H, int W,
                                                   int P, int Q, int kernel, int stride) {
  const long long total = NC * P * Q;
  for (long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x; o < total;
       o += (long long)gridDim.x * blockDim.x) {
    const long long nc = o / ((long long)P * Q);
    const int pq = (int)(o - nc * P * Q);
    const int h0 = (pq / Q) * stride, w0 = (pq % Q) * stride;
    const float* win = x + nc * H * W + (long long)h0 * W + w0;
    float best = win[0];
    int best_at = 0;
    for (int i = 0; i < kernel; ++i)
      for (int j = 0; j < kernel; ++j) {
        const float v = win[(long long)i * W + j];
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
                                                   int Q, int kernel, int stride) {
  const long long total = NC * H * W;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    const long long nc = e / ((long long)H * W);
    const int hw = (int)(e - nc * H * W);
    const int h = hw / W, w = hw % W;
    // windows p with p*stride <= h < p*stride + kernel
    const int p_lo = (h - kernel + stride) / stride > 0 ? (h - kernel + stride) / stride : 0;
    const int q_lo = (w - kernel + stride) / stride > 0 ? (w - kernel + stride) / stride : 0;
    const int p_hi = h / stride < P - 1 ? h / stride : P - 1;
    const int q_hi = w / stride < Q - 1 ? w / stride : Q - 1;
    float s = 0.0f;
    for (int p = p_lo; p <= p_hi; ++p)
      for (int q = q_lo; q <= q_hi; ++q) {
        const long long o = (nc * P + p) * Q + q;
        if ((int)argmax[o] == (h - p * stride) * kernel + (w - q * stride)) s += dy[o];
      }
    dx[e] = s;
  }
}

extern "C" __global__ void maxpool_fprop_u8(const float* __restrict__ x, float* __restrict__ y,
                                            unsigned char* __restrict__ argmax, long long NC, int H, int W, int P,
                                            int Q, int kernel, int stride) {
  maxpool_fprop_body<unsigned char>(x, y, argmax, NC, H, W, P, Q, kernel, stride);
}

extern "C" __global__ void maxpool_fprop_i32(const float* __restrict__ x, float* __restrict__ y,
                                             int* __restrict__ argmax, long long NC, int H, int W, int P, int Q,
                                             int kernel, int stride) {
  maxpool_fprop_body<int>(x, y, argmax, NC, H, W, P, Q, kernel, stride);
}

extern "C" __global__ void maxpool_bprop_u8(const float* __restrict__ dy, const unsigned char* __restrict__ argmax,
                                            float* __restrict__ dx, long long NC, int H, int W, int P, int Q,
                                            int kernel, int stride) {
  maxpool_bprop_body<unsigned char>(dy, argmax, dx, NC, H, W, P, Q, kernel, stride);
}

extern "C" __global__ void maxpool_bprop_i32(const float* __restrict__ dy, const int* __restrict__ argmax,
                                             float* __restrict__ dx, long long NC, int H, int W, int P, int Q,
                                             int kernel, int stride) {
  maxpool_bprop_body<int>(dy, argmax, dx, NC, H, W, P, Q, kernel, stride);
}
