// relu.cu: rectified linear unit, float32, any shape (flat n elements).
//
//   relu_fprop   y[i] = max(x[i], 0), NaN where x[i] is NaN (np.maximum's NaN propagation)
//   relu_bprop   dx[i] = dy[i] * (y[i] > 0 ? 1 : 0)   (y the forward output; numpy_ops' dy * (y > 0):
//                0 where y <= 0 or y is NaN, except NaN where dy is NaN or +-inf there)
// Launch: 1-D, any block size, grid-stride loop over n (64-bit); no shared memory.
// fmaxf(NaN, 0) is 0 (IEEE maxNum) and a select on `y > 0` drops a NaN dy: neither is used, so that a
// non-finite activation or gradient reaches the pushed gradient and trips the non-finite check as
// it does on the NumPy backend.

extern "C" __global__ void relu_fprop(const float* __restrict__ x, float* __restrict__ y, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float v = x[i];
    y[i] = (v > 0.0f || v != v) ? v : 0.0f;  // v != v: NaN passes through
  }
}

extern "C" __global__ void relu_bprop(const float* __restrict__ dy, const float* __restrict__ y,
                                      float* __restrict__ dx, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    dx[i] = dy[i] * (y[i] > 0.0f ? 1.0f : 0.0f);  // a multiply, not a select: 0 * NaN and 0 * inf are NaN
}
