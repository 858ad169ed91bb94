// kernels/philox.cuh: Philox4x32-10, the counter-based generator of Salmon, Moraes, Dror and Shaw,
// "Parallel random numbers: as easy as 1, 2, 3" (SC'11), as Random123's philox4x32_R(10, ctr, key)
// computes it (and cuRAND's curand_Philox4x32_10, PyTorch's CUDA dropout): 10 rounds, each multiplying
// words 0 and 2 by M0, M1 into 64-bit products and mixing their halves with words 1, 3 and the key; the
// key is bumped by W0, W1 before every round but the first. No state: the 4 words are a pure function
// of (counter, key), so a mask is recomputed from its key instead of stored (dropout.cu).
// Known answers (Random123 kat_vectors): counter 0, key 0 -> 6627e8d5 e169c58d bc57ac4c 9b00dbd8
// (tests/kernels_cpu check these and two more through the harness).
#ifndef MPIASGD_KERNELS_PHILOX_CUH
#define MPIASGD_KERNELS_PHILOX_CUH

#define PHILOX_M0 0xD2511F53u  // multipliers
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u  // key schedule (the golden ratio, sqrt(3) - 1)
#define PHILOX_W1 0xBB67AE85u

// ctr (4 words) <- Philox4x32-10(ctr, key (k0, k1)), in place
__device__ __forceinline__ void philox4x32_10(unsigned int ctr[4], unsigned int k0, unsigned int k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += PHILOX_W0;
      k1 += PHILOX_W1;
    }
    const unsigned long long p0 = (unsigned long long)PHILOX_M0 * ctr[0];  // 32 x 32 -> 64 bits: exact
    const unsigned long long p1 = (unsigned long long)PHILOX_M1 * ctr[2];
    const unsigned int c1 = ctr[1], c3 = ctr[3];
    ctr[0] = (unsigned int)(p1 >> 32) ^ c1 ^ k0;
    ctr[1] = (unsigned int)p1;
    ctr[2] = (unsigned int)(p0 >> 32) ^ c3 ^ k1;
    ctr[3] = (unsigned int)p0;
  }
}

#endif  // MPIASGD_KERNELS_PHILOX_CUH
