// sgd.cu: SGD with momentum (heavy ball or Nesterov) and weight decay on one flat float32 vector, in place.
//
//   sgd_momentum   w, v, g, decay (n,), lr_scale (n,) or NULL (1 everywhere):
//                  d = g + decay * w;  v <- momentum * v + d;
//                  w <- w - (lr * s) * v                      (heavy ball, nesterov = 0)
//                  w <- w - (lr * s) * (d + momentum * v)     (nesterov = 1, with the new v)
//                  s = lr_scale[i] (lr * s: one float product, exactly lr when lr_scale is NULL);
//                  decay = weight_decay * mask, 0 on biases; the forms of mpiasgd.optim.SGD and
//                  torch.optim.SGD (dampening 0), not cuda-convnet's/Caffe's v <- m v - lr (g + wd w),
//                  w <- w + v, which differs when lr changes; g, decay and lr_scale are not modified
// Launch: 1-D, any block size, grid-stride loop over n (64-bit); no shared memory.

extern "C" __global__ void sgd_momentum(float* __restrict__ w, float* __restrict__ v, const float* __restrict__ g,
                                        const float* __restrict__ decay, const float* __restrict__ lr_scale,
                                        float momentum, float lr, int nesterov, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float wi = w[i];
    const float d = g[i] + decay[i] * wi;
    const float vi = momentum * v[i] + d;
    v[i] = vi;
    const float step = lr_scale != nullptr ? lr * lr_scale[i] : lr;
    w[i] = wi - step * (nesterov ? d + momentum * vi : vi);
  }
}
