// softmax_xent.cu: softmax cross-entropy, forward and backward in one kernel, float32.
//
//   softmax_xent   logits (N, K), labels (N,) int32 ->
//                  dlogits (N, K) = (softmax(logits) - onehot(label)) * scale   (scale = 1/N for a mean)
//                  row_loss (N,)  = log(sum_k exp(logits - max)) - (logits[label] - max)
//                  row_correct (N,) int32 = 1 if the first argmax of the row equals the label else 0,
//                                   and -1 when the label is outside [0, K) (that row's other
//                                   outputs are then left unwritten; the caller raises)
// Non-finite logits as numpy_ops (np.max / np.argmax): max and argmax rank NaN above every number, so
// a row holding a NaN has max NaN and argmax its first NaN, and its dlogits and loss are NaN; a +inf
// logit makes them NaN too (inf - inf); a row of -inf only has argmax 0 (and NaN outputs).
// Launch: grid (N) (one block per row), block SOFTMAX_THREADS_MAX (256) or any power of two below
// it; static shared memory 2 * SOFTMAX_THREADS_MAX words. Tree reductions, no atomics.

#include "constants.cuh"  // SOFTMAX_THREADS_MAX

// a ranks above b in the order of np.max / np.argmax: NaN above every number, equal to another NaN
__device__ __forceinline__ bool softmax_above(float a, float b) { return a > b || (a != a && b == b); }
__device__ __forceinline__ bool softmax_same(float a, float b) { return a == b || (a != a && b != b); }

extern "C" __global__ void __launch_bounds__(SOFTMAX_THREADS_MAX)
softmax_xent(const float* __restrict__ logits, const int* __restrict__ labels, float* __restrict__ dlogits,
             float* __restrict__ row_loss, int* __restrict__ row_correct, int N, int K, float scale) {
  __shared__ float red_v[SOFTMAX_THREADS_MAX];
  __shared__ int red_i[SOFTMAX_THREADS_MAX];
  const long long row = blockIdx.x;
  const int t = threadIdx.x;
  const float* z = logits + row * K;
  const int label = labels[row];
  if (label < 0 || label >= K) {  // uniform over the block: every thread leaves before any barrier
    if (t == 0) row_correct[row] = -1;
    return;
  }

  // row max and its first index (best_at = K: this thread has none yet; its first element is taken
  // even if it is -inf, so that a row of -inf has argmax 0 as np.argmax)
  float best = __int_as_float((int)0xff800000);  // -inf (NVRTC has no INFINITY macro)
  int best_at = K;
  for (int k = t; k < K; k += blockDim.x) {
    const float v = z[k];
    if (best_at == K || softmax_above(v, best)) {  // k increases: the first maximum (or NaN) of the subset
      best = v;
      best_at = k;
    }
  }
  red_v[t] = best;
  red_i[t] = best_at;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (t < half) {
      const float v = red_v[t + half];
      const int i = red_i[t + half];
      if (softmax_above(v, red_v[t]) || (softmax_same(v, red_v[t]) && i < red_i[t])) {
        red_v[t] = v;
        red_i[t] = i;
      }
    }
    __syncthreads();
  }
  const float zmax = red_v[0];
  const int argmax = red_i[0];
  __syncthreads();  // everyone has read red_v[0] before it is reused for the sum

  float s = 0.0f;
  for (int k = t; k < K; k += blockDim.x) s += __expf(z[k] - zmax);
  red_v[t] = s;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (t < half) red_v[t] += red_v[t + half];
    __syncthreads();
  }
  const float sum = red_v[0];
  const float inv_sum = 1.0f / sum;

  float* d = dlogits + row * K;
  for (int k = t; k < K; k += blockDim.x) {
    const float p = __expf(z[k] - zmax) * inv_sum;
    d[k] = (p - (k == label ? 1.0f : 0.0f)) * scale;
  }
  if (t == 0) {
    row_loss[row] = __logf(sum) - (z[label] - zmax);
    row_correct[row] = argmax == label ? 1 : 0;
  }
}
