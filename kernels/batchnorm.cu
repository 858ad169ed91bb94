// batchnorm.cu: batch normalisation (Ioffe and Szegedy 2015, arXiv 1502.03167, Algorithm 1), float32, NCHW.
//
//   batchnorm_stats
//       x (N, C, H, W) -> mean (C,), var (C,) (biased: divisor M = N*H*W), in two passes over the
//       channel: a first mean mu0, then the sums of d = x - mu0 and d^2, giving mean = mu0 + sum d/M and
//       var = (sum d^2 - (sum d)^2/M)/M: the corrected two-pass algorithm (Chan, Golub and LeVeque 1983,
//       "Algorithms for computing the sample variance", eq. 1.7), which takes mu0's rounding error out
//       of both (a channel of large mean, x = 1e4 + 0.01 N(0,1), keeps float32's accuracy) and has no
//       E[x^2] - E[x]^2 cancellation.
//       When running_mean / running_var are not NULL, thread 0 also updates them in place as
//       torch.nn.BatchNorm2d: r <- (1 - momentum)*r + momentum*stat, the variance times `unbias`
//       (M/(M - 1), or 1 for M = 1)
//   batchnorm_fprop
//       y = (x - mean[c]) * a + beta[c], a = gamma[c] / sqrt(var[c] + eps), elementwise
//   batchnorm_bprop
//       dy, x (N, C, H, W) -> dbeta[c] = sum dy, dgamma[c] = invstd * sum dy*(x - mean[c]), and, when
//       dx is not NULL, dx = a*dy - b - (x - mean[c])*e with a = gamma*invstd, b = a*dbeta/M,
//       e = a*invstd*dgamma/M (invstd = 1/sqrt(var + eps)): the block that reduced channel c writes
//       its dx in a second pass over the channel
// Reductions (stats, bprop): grid (C) (one block per channel), block BATCHNORM_THREADS_MAX (512) or
// any power of two below it; static shared memory BATCHNORM_THREADS_MAX floats. Thread t sums the
// channel's elements m = t, t + blockDim, ... (m = n*H*W + l) in that order, then a shared-memory tree
// adds the partial sums: no atomics, the bits depend on the input and the block size only.
// fprop: 1-D, any block size, grid-stride loop over N*C*H*W (64-bit); no shared memory.
// Ints: N, C, H*W (the caller checks they fit); element offsets are 64-bit.

#include "constants.cuh"  // BATCHNORM_THREADS_MAX

// f(i) for each element i of channel c that thread threadIdx.x owns: m = t, t + blockDim, ... < N*HW,
// i = (n*C + c)*HW + l for m = n*HW + l; (n, l) are carried from one m to the next (one carry at most:
// blockDim = step_n*HW + step_l with step_l < HW), no division per element; 64-bit, so that n + step_n
// and l + step_l cannot overflow for any N and HW that fit an int
template <class F>
__device__ __forceinline__ void bn_channel_elements(int N, int C, int HW, int c, F f) {
  const long long step_n = blockDim.x / HW, step_l = blockDim.x % HW;
  long long n = threadIdx.x / HW, l = threadIdx.x % HW;
  while (n < N) {
    f((n * C + c) * HW + l);
    n += step_n;
    l += step_l;
    if (l >= HW) {
      l -= HW;
      ++n;
    }
  }
}

// the sum over the block of every thread's `s`, by a tree over part[0..blockDim) (blockDim a power of
// two), returned to every thread; part is free again on return
__device__ __forceinline__ float bn_block_sum(float* part, float s) {
  const int t = threadIdx.x;
  part[t] = s;
  __syncthreads();  // all partial sums stored
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (t < half) part[t] += part[t + half];
    __syncthreads();  // this tree level done before the next one reads it
  }
  const float total = part[0];
  __syncthreads();  // everyone has read the total before part is reused
  return total;
}

extern "C" __global__ void __launch_bounds__(BATCHNORM_THREADS_MAX)
batchnorm_stats(const float* __restrict__ x, float* __restrict__ mean, float* __restrict__ var,
                float* __restrict__ running_mean, float* __restrict__ running_var, int N, int C, int HW,
                float momentum, float unbias) {
  __shared__ float part[BATCHNORM_THREADS_MAX];
  const int c = blockIdx.x;
  const float M = (float)((long long)N * HW);
  float s = 0.0f;
  bn_channel_elements(N, C, HW, c, [&](long long i) { s += x[i]; });
  const float mu0 = bn_block_sum(part, s) / M;  // the first pass's mean: float32 sums of large values
  float s1 = 0.0f, s2 = 0.0f;
  bn_channel_elements(N, C, HW, c, [&](long long i) {
    const float d = x[i] - mu0;  // small where mu0 is close: the deviations carry the digits the sums lost
    s1 += d;
    s2 += d * d;
  });
  const float sum_d = bn_block_sum(part, s1);
  // corrected two-pass: mu0's own rounding error comes back as sum d and is taken out of both results
  const float mu = mu0 + sum_d / M;
  const float v = fmaxf((bn_block_sum(part, s2) - sum_d * (sum_d / M)) / M, 0.0f);
  if (threadIdx.x == 0) {
    mean[c] = mu;
    var[c] = v;
    if (running_mean != nullptr) {
      running_mean[c] = (1.0f - momentum) * running_mean[c] + momentum * mu;
      running_var[c] = (1.0f - momentum) * running_var[c] + momentum * (v * unbias);
    }
  }
}

// (i / HW) % C, the channel of NCHW element i, in 32-bit arithmetic while i fits
__device__ __forceinline__ int bn_channel_of(long long i, int HW, int C) {
  if (i <= 0x7fffffffLL) return (int)((unsigned)i / (unsigned)HW % (unsigned)C);
  return (int)(i / HW % C);
}

extern "C" __global__ void batchnorm_fprop(const float* __restrict__ x, const float* __restrict__ gamma,
                                           const float* __restrict__ beta, const float* __restrict__ mean,
                                           const float* __restrict__ var, float* __restrict__ y, long long n,
                                           int C, int HW, float eps) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const int c = bn_channel_of(i, HW, C);
    const float a = gamma[c] / sqrtf(var[c] + eps);
    y[i] = (x[i] - mean[c]) * a + beta[c];
  }
}

extern "C" __global__ void __launch_bounds__(BATCHNORM_THREADS_MAX)
batchnorm_bprop(const float* __restrict__ dy, const float* __restrict__ x, const float* __restrict__ gamma,
                const float* __restrict__ mean, const float* __restrict__ var, float* __restrict__ dgamma,
                float* __restrict__ dbeta, float* __restrict__ dx, int N, int C, int HW, float eps) {
  __shared__ float part[BATCHNORM_THREADS_MAX];
  const int c = blockIdx.x;
  const float M = (float)((long long)N * HW);
  const float mu = mean[c];
  const float invstd = 1.0f / sqrtf(var[c] + eps);
  float s_dy = 0.0f, s_dyx = 0.0f;
  bn_channel_elements(N, C, HW, c, [&](long long i) {
    const float g = dy[i];
    s_dy += g;
    s_dyx += g * (x[i] - mu);
  });
  const float sum_dy = bn_block_sum(part, s_dy);
  const float sum_dy_xhat = bn_block_sum(part, s_dyx) * invstd;
  if (threadIdx.x == 0) {
    dbeta[c] = sum_dy;
    dgamma[c] = sum_dy_xhat;
  }
  if (dx == nullptr) return;
  const float a = gamma[c] * invstd;
  const float b = a * sum_dy / M, e = a * invstd * sum_dy_xhat / M;
  bn_channel_elements(N, C, HW, c, [&](long long i) { dx[i] = a * dy[i] - b - (x[i] - mu) * e; });
}
