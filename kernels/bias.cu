// bias.cu: bias gradient, float32.
//
//   bias_grad   dy (N, K, L) -> db (K,): db[k] = sum over n, l of dy[n][k][l]
//               (L = P*Q for a conv output (N, K, P, Q), L = 1 for a linear output (N, K))
// Launch: grid (K), block BIAS_THREADS_MAX (256) or any power of two below it; static shared memory
// BIAS_THREADS_MAX floats. Each thread sums a fixed strided subset, then a shared-memory tree
// reduction: no atomics, the result depends only on the block size (reproducible).

#include "constants.cuh"  // BIAS_THREADS_MAX

extern "C" __global__ void __launch_bounds__(BIAS_THREADS_MAX)
bias_grad(const float* __restrict__ dy, float* __restrict__ db, int N, int K, long long L) {
  __shared__ float part[BIAS_THREADS_MAX];
  const int k = blockIdx.x;
  const int t = threadIdx.x;
  float s = 0.0f;
  for (int n = 0; n < N; ++n) {
    const float* row = dy + ((long long)n * K + k) * L;
    for (long long l = t; l < L; l += blockDim.x) s += row[l];
  }
  part[t] = s;
  __syncthreads();  // all partial sums stored
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (t < half) part[t] += part[t + half];
    __syncthreads();  // this tree level done before the next one reads it
  }
  if (t == 0) db[k] = part[0];
}
