// lrn.cu: cross-map local response normalisation (Krizhevsky et al. 2012 section 3.3; cuda-convnet's
// cmrnorm; torch.nn.LocalResponseNorm's formula), float32, NCHW.
//
//   lrn_fprop   x (N, C, H, W) -> scale, y (N, C, H, W):
//               scale[c] = k + alpha_over_size * sum of x[c']^2 over c' in [c - size/2, c + (size-1)/2]
//               (channels outside [0, C) count 0), y[c] = x[c] * scale[c]^neg_beta (neg_beta = -beta)
//   lrn_bprop   dy, x, y, scale -> dx (N, C, H, W):
//               dx[c] = x[c] * coef * (sum of dy[c']*y[c']/scale[c'] over c' in [c - (size-1)/2,
//               c + size/2], the channels whose window holds c) + dy[c] * scale[c]^neg_beta,
//               coef = -2*alpha*beta/size
// Each output sums its own window again (size terms, ascending c'): no running sum whose
// subtractions would cancel when a large x leaves the window, and every output is independent.
// Launch: 1-D, any block size, grid-stride loop over N*C*H*W outputs (64-bit indices); no shared memory.
// Ints: C, H*W, size (the caller checks they fit).

// the channel window [*lo, *hi] of channel c: c - before .. c + after clipped to [0, C) (no int overflow
// for any size)
__device__ __forceinline__ void lrn_window(int c, int C, int before, int after, int* lo, int* hi) {
  *lo = c > before ? c - before : 0;
  *hi = after < C - 1 - c ? c + after : C - 1;
}

extern "C" __global__ void lrn_fprop(const float* __restrict__ x, float* __restrict__ y, float* __restrict__ scale,
                                     long long n, int C, int HW, int size, float alpha_over_size, float k,
                                     float neg_beta) {
  for (long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x; o < n;
       o += (long long)gridDim.x * blockDim.x) {
    const long long nc = o / HW;
    const int c = (int)(nc % C);
    const long long pixel = o - (long long)c * HW;  // channel 0 of this (n, h, w)
    int lo, hi;
    lrn_window(c, C, size / 2, (size - 1) / 2, &lo, &hi);
    float s = 0.0f;
    for (int cc = lo; cc <= hi; ++cc) {
      const float v = x[pixel + (long long)cc * HW];
      s += v * v;
    }
    const float sc = s * alpha_over_size + k;
    scale[o] = sc;
    y[o] = x[o] * powf(sc, neg_beta);
  }
}

extern "C" __global__ void lrn_bprop(const float* __restrict__ dy, const float* __restrict__ x,
                                     const float* __restrict__ y, const float* __restrict__ scale,
                                     float* __restrict__ dx, long long n, int C, int HW, int size, float coef,
                                     float neg_beta) {
  for (long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x; o < n;
       o += (long long)gridDim.x * blockDim.x) {
    const long long nc = o / HW;
    const int c = (int)(nc % C);
    const long long pixel = o - (long long)c * HW;
    int lo, hi;
    lrn_window(c, C, (size - 1) / 2, size / 2, &lo, &hi);
    float s = 0.0f;
    for (int cc = lo; cc <= hi; ++cc) {
      const long long j = pixel + (long long)cc * HW;
      s += dy[j] * y[j] / scale[j];
    }
    dx[o] = s * x[o] * coef + dy[o] * powf(scale[o], neg_beta);
  }
}
