// dropout.cu: inverted dropout with a mask recomputed from its key (never stored), float32, any shape.
//
//   dropout   y[i] = x[i] * (keep_i ? scale : 0), flat n elements: the forward (x the input) and the
//             backward (x = dy) are the same kernel with the same key, so they draw the same mask.
//             keep_i = (r_i >= threshold), r_i word i % 4 of Philox4x32-10 (philox.cuh) at counter
//             (i / 4, layer, minibatch_lo, minibatch_hi) and key (seed_lo, seed_hi); threshold =
//             min(round(p * 2^32), 2^32 - 1) and scale = 1/(1 - p) rounded to float32, computed by the
//             caller (contract.dropout_key: the numpy backend draws the same bits). A dropped element
//             is multiplied by 0 (a dropped inf or NaN gives NaN, as numpy_ops and PyTorch)
// Launch: 1-D, any block size, grid-stride loop over the n/4 (rounded up) counters, one Philox call
// each for 4 consecutive elements (64-bit indices; n <= 2^34, so i / 4 fits word 0); no shared memory.

#include "philox.cuh"

extern "C" __global__ void dropout(const float* __restrict__ x, float* __restrict__ y, long long n,
                                   unsigned int threshold, float scale, unsigned int layer,
                                   unsigned int minibatch_lo, unsigned int minibatch_hi, unsigned int seed_lo,
                                   unsigned int seed_hi) {
  const long long counters = (n + 3) / 4;
  for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < counters;
       g += (long long)gridDim.x * blockDim.x) {
    unsigned int r[4] = {(unsigned int)g, layer, minibatch_lo, minibatch_hi};
    philox4x32_10(r, seed_lo, seed_hi);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long i = 4 * g + j;
      if (i < n) y[i] = x[i] * (r[j] >= threshold ? scale : 0.0f);  // a multiply: 0 * NaN is NaN
    }
  }
}
