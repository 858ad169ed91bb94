// sgd.cu: heavy-ball SGD with momentum and weight decay on one flat float32 vector, in place.
//
//   sgd_momentum   w, v, g, decay (n,):  v <- momentum * v + (g + decay * w);  w <- w - lr * v
//                  (decay = weight_decay * mask, 0 on biases; the form of mpiasgd.optim.SGD and
//                  torch.optim.SGD, not cuda-convnet's/Caffe's v <- m v - lr (g + wd w), w <- w + v,
//                  which differs when lr changes); g and decay are not modified
// Launch: 1-D, any block size, grid-stride loop over n (64-bit); no shared memory.

extern "C" __global__ void sgd_momentum(float* __restrict__ w, float* __restrict__ v, const float* __restrict__ g,
                                        const float* __restrict__ decay, float momentum, float lr, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float wi = w[i];
    const float vi = momentum * v[i] + (g[i] + decay[i] * wi);
    v[i] = vi;
    w[i] = wi - lr * vi;
  }
}
