// kernels/constants.cuh: constants shared by the kernels and their Python side.
// GENERATED from the table in mpiasgd/ops/cuda/constants.py: edit that table, then run
//     python -m mpiasgd.ops.cuda.constants
// (a test fails while this file differs from what that writes).
#ifndef MPIASGD_KERNELS_CONSTANTS_CUH
#define MPIASGD_KERNELS_CONSTANTS_CUH

#ifndef CONV_BM
#define CONV_BM 64  // rows of C (output channels) per block (default; -DCONV_BM=...)
#endif
#ifndef CONV_BN
#define CONV_BN 64  // columns of C (output pixels / filter taps) per block (default; -DCONV_BN=...)
#endif
#ifndef CONV_BK
#define CONV_BK 16  // reduction slab (split-K ranges are multiples of it) (default; -DCONV_BK=...)
#endif
#ifndef CONV_TM
#define CONV_TM 4  // register block: rows per thread, 4 or 8 (default; -DCONV_TM=...)
#endif
#ifndef CONV_TN
#define CONV_TN 4  // register block: columns per thread, 4 or 8 (default; -DCONV_TN=...)
#endif
#ifndef CONV_STAGES
#define CONV_STAGES 3  // shared-memory stages of the main loop (1 below sm_80) (default; -DCONV_STAGES=...)
#endif
#define CONV_BLOCKS_PER_SM 2  // conv GEMM blocks per SM asked of the compiler (launch bounds)
#define CONV_TAB_INTS 4  // ints per tap table entry {off, bits, a_off, 0}
#define CONV_TAB_PAD 128  // zero entries after a tap table's last (>= 2 slabs)
#define CONV_TAB_MAX_TAPS 32  // filters of at most this many taps take the tap table
#define SPLIT_REDUCE_OUTS 32  // conv2d_split_reduce: consecutive outputs per block
#define SPLIT_REDUCE_THREADS_MAX 256  // conv2d_split_reduce: most threads per block
#define BIAS_THREADS_MAX 256  // bias_grad: most threads per block (a power of two)
#define SOFTMAX_THREADS_MAX 256  // softmax_xent: most threads per block (a power of two)
#define BATCHNORM_THREADS_MAX 512  // batchnorm_stats, batchnorm_bprop: most threads per block (a power of two)
#define MAX_BLOCK_THREADS 1024  // CUDA: threads per block
#define MAX_STATIC_SHARED 49152  // CUDA: bytes of static shared memory per block

#endif  // MPIASGD_KERNELS_CONSTANTS_CUH
