// residual.cu: the ops of a residual block's shortcut (He et al. 2016, arXiv 1512.03385), float32, NCHW.
//
//   add                   out[i] = a[i] + b[i], flat n elements; out may be a or b (in place), so no
//                         pointer here is __restrict__ (each element is read before it is written, by
//                         the one thread that writes it)
//   subsample_pad_fprop   x (N, C, H, W) -> y (N, K, P, Q), K = pad_before + C + pad_after,
//                         P = ceil(H/stride), Q = ceil(W/stride): y[n, pad_before + c, p, q] =
//                         x[n, c, p*stride, q*stride], 0 in the pad channels (the option-A shortcut)
//   subsample_pad_bprop   dy (N, K, P, Q) -> dx (N, C, H, W): dy[n, pad_before + c, h/stride, w/stride]
//                         where stride divides h and w, else 0
// Launch: 1-D, any block size, grid-stride loop over the outputs (64-bit indices; ints within one
// (n, c) plane); no shared memory.

extern "C" __global__ void add(const float* a, const float* b, float* out, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    out[i] = a[i] + b[i];
}

extern "C" __global__ void subsample_pad_fprop(const float* __restrict__ x, float* __restrict__ y, int N, int C,
                                               int H, int W, int K, int P, int Q, int stride, int pad_before) {
  const long long total = (long long)N * K * P * Q;
  for (long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x; o < total;
       o += (long long)gridDim.x * blockDim.x) {
    const long long nk = o / ((long long)P * Q);
    const int pq = (int)(o - nk * P * Q);
    const long long n = nk / K;
    const int c = (int)(nk - n * K) - pad_before;
    y[o] = (c >= 0 && c < C) ? x[((n * C + c) * H + (long long)(pq / Q) * stride) * W + (pq % Q) * stride]
                             : 0.0f;
  }
}

extern "C" __global__ void subsample_pad_bprop(const float* __restrict__ dy, float* __restrict__ dx, int N, int C,
                                               int H, int W, int K, int P, int Q, int stride, int pad_before) {
  const long long total = (long long)N * C * H * W;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    const long long nc = e / ((long long)H * W);
    const int hw = (int)(e - nc * H * W);
    const int h = hw / W, w = hw % W;
    const long long n = nc / C;
    const int c = (int)(nc - n * C);
    dx[e] = (h % stride == 0 && w % stride == 0)
                ? dy[((n * K + pad_before + c) * P + h / stride) * Q + w / stride]
                : 0.0f;
  }
}
