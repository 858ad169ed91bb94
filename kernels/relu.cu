// relu.cu: rectified linear unit, float32, any shape (flat n elements).
//
//   relu_fprop   y[i] = max(x[i], 0)
//   relu_bprop   dx[i] = y[i] > 0 ? dy[i] : 0   (y the forward output)
// Launch: 1-D, any block size, grid-stride loop over n (64-bit); no shared memory.

extern "C" __global__ void relu_fprop(const float* __restrict__ x, float* __restrict__ y, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    y[i] = fmaxf(x[i], 0.0f);
}

extern "C" __global__ void relu_bprop(const float* __restrict__ dy, const float* __restrict__ y,
                                      float* __restrict__ dx, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}
