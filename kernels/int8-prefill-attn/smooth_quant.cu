// The int8-QK prefill attention's pre-pass on the GPU: smooth K, quantize Q and K to int8 per block.
//
// Specified to the bit by reference.py (`smooth_quant`); this file must produce the same bytes.
// Every fp32 operation is an explicit round-to-nearest intrinsic (__fadd_rn, __fsub_rn, __fdiv_rn)
// so that neither FMA contraction nor a fast-math flag can change a result, and every sum runs in
// the order the spec gives:
//
//   1. blocks of `block` consecutive tokens from each sequence's first token (the last one may be
//      short); a running fp32 sum over each block's tokens in token order from +0.0  (block_sums);
//   2. a running sum of a sequence's block sums in block order from +0.0, / float(length)  (k_mean);
//   3. per (block, head): amax = max |x| over the block's tokens x D, x = float(q) or float(k) - mean;
//      scale = max(amax, 1e-6f) / 127; x_i8 = clamp(rint(x / scale), -127, 127), rint = half to even;
//      every token carries its block's scale  (quant).
//
// quant has two paths with the same arithmetic per element: quant_vec (16-byte loads, the block held
// in registers; head_dim 64..256 at the model's block of 64) and quant_scalar (anything else).
//
// Launch shapes (rig/kernels/cubin.py): block_sums and quant run one CTA per (block of a sequence,
// head, sequence) = grid (ceil(max_seqlen / block), heads, batch) — CTAs past a sequence's end
// return at once, so no host sync is needed to know the lengths; k_mean runs one CTA per
// (kv head, sequence). Threads walk the channels, so each token's row of D values is read coalesced.
// The block sums go to a workspace row per block: row (first token of the block) / block + sequence
// is unique over the batch and below T / block + batch.
//
// Entry points are extern "C" so their names are stable for cuModuleGetFunction. Inputs must be
// finite (a NaN is dropped by fmaxf where torch's amax would keep it). The helpers live in a named
// namespace, not an anonymous one: nvcc names anonymous-namespace symbols (the shared array of
// cta_max) after a hash of the build directory, and the PTX then differs from one folder to another.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace rig_sq {

constexpr float kScaleFloor = 1e-6f;
constexpr float kInt8Max = 127.0f;
constexpr int kMaxWarps = 32;

__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }

// Row of the block-sum workspace for the block starting at token `first` of sequence `seq`.
__device__ __forceinline__ int64_t ws_row(int first, int block, int seq) {
    return static_cast<int64_t>(first / block) + seq;
}

template <typename T>
__device__ void block_sums(const T* __restrict__ k, const int* __restrict__ cu, float* __restrict__ ws,
                           int heads, int dim, int block) {
    const int seq = blockIdx.z, head = blockIdx.y;
    const int start = cu[seq], end = cu[seq + 1];
    const int first = start + blockIdx.x * block;
    if (first >= end) return;
    const int last = min(end, first + block);
    const int64_t row = ws_row(first, block, seq);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float acc = 0.0f;
        for (int t = first; t < last; ++t) {
            acc = __fadd_rn(acc, to_f32(k[(static_cast<int64_t>(t) * heads + head) * dim + c]));
        }
        ws[(row * heads + head) * dim + c] = acc;
    }
}

// Max over the CTA of each thread's value; every thread gets the result. fmaxf is exact, so the
// reduction order does not matter.
__device__ float cta_max(float v) {
    __shared__ float partial[kMaxWarps];
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = (blockDim.x + 31) / 32;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    float m = 0.0f;
    for (int w = 0; w < warps; ++w) m = fmaxf(m, partial[w]);
    return m;
}

// The general path: any dim and block, any alignment. Each thread walks its channels of every token
// of the block in turn, one 2-byte load per iteration, twice (max, then quantize).
template <typename T>
__device__ void quant_scalar(const T* __restrict__ x, const float* __restrict__ m, int first, int last,
                             int8_t* __restrict__ out, float* __restrict__ scale_out, int heads, int head, int dim) {
    float amax = 0.0f;
    for (int t = first; t < last; ++t) {
        const T* row = x + (static_cast<int64_t>(t) * heads + head) * dim;
        for (int c = threadIdx.x; c < dim; c += blockDim.x) {
            const float v = m == nullptr ? to_f32(row[c]) : __fsub_rn(to_f32(row[c]), m[c]);
            amax = fmaxf(amax, fabsf(v));
        }
    }
    const float scale = __fdiv_rn(fmaxf(cta_max(amax), kScaleFloor), kInt8Max);
    for (int t = first; t < last; ++t) {
        const int64_t base = (static_cast<int64_t>(t) * heads + head) * dim;
        for (int c = threadIdx.x; c < dim; c += blockDim.x) {
            const float v = m == nullptr ? to_f32(x[base + c]) : __fsub_rn(to_f32(x[base + c]), m[c]);
            const int r = __float2int_rn(__fdiv_rn(v, scale));
            out[base + c] = static_cast<int8_t>(max(-127, min(127, r)));
        }
    }
    for (int t = first + threadIdx.x; t < last; t += blockDim.x) {
        scale_out[static_cast<int64_t>(t) * heads + head] = scale;
    }
}

// Lanes of kVec channels (16 bytes of input) per token row, rows of the block side by side.
constexpr int kVec = 8;
// Rows each thread keeps in registers between the max and the quantize pass: the fast path holds
// the whole block (rows per pass x kCacheRows >= block), so the input is read from memory once.
constexpr int kCacheRows = 8;

// Whether quant_vec can take this CTA: dim in whole lanes, the CTA in whole rows, the block in
// registers, and x / out aligned for 16- / 8-byte accesses. Uniform over the CTA.
template <typename T>
__device__ __forceinline__ bool vec_ok(const T* x, const int8_t* out, int dim, int block) {
    if (dim % kVec != 0) return false;
    const int lanes = dim / kVec;
    if (lanes > static_cast<int>(blockDim.x) || blockDim.x % lanes != 0) return false;
    const int rows = blockDim.x / lanes;
    return (block + rows - 1) / rows <= kCacheRows && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(out) % 8 == 0;
}

// The fast path, the same arithmetic per element as quant_scalar (so the same bytes): each thread
// loads 8 channels of up to kCacheRows tokens with one 16-byte load each, all issued before any is
// used, keeps them as loaded, and quantizes from registers. quant_scalar's one-load-per-iteration
// walk made the pre-pass latency-bound (162.6 us of device time for Q and K at 4k on the H200).
template <typename T>
__device__ void quant_vec(const T* __restrict__ x, const float* __restrict__ m, int first, int last,
                          int8_t* __restrict__ out, float* __restrict__ scale_out, int heads, int head, int dim) {
    const int lanes = dim / kVec, rows = blockDim.x / lanes;
    const int c0 = (threadIdx.x % lanes) * kVec, row0 = threadIdx.x / lanes;
    float mv[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) mv[j] = m == nullptr ? 0.0f : m[c0 + j];
    uint4 raw[kCacheRows];
#pragma unroll
    for (int i = 0; i < kCacheRows; ++i) {
        const int t = first + row0 + i * rows;
        if (t < last) raw[i] = *reinterpret_cast<const uint4*>(x + (static_cast<int64_t>(t) * heads + head) * dim + c0);
    }
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < kCacheRows; ++i) {
        if (first + row0 + i * rows >= last) continue;
        const T* e = reinterpret_cast<const T*>(&raw[i]);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
            const float v = m == nullptr ? to_f32(e[j]) : __fsub_rn(to_f32(e[j]), mv[j]);
            amax = fmaxf(amax, fabsf(v));
        }
    }
    const float scale = __fdiv_rn(fmaxf(cta_max(amax), kScaleFloor), kInt8Max);
#pragma unroll
    for (int i = 0; i < kCacheRows; ++i) {
        const int t = first + row0 + i * rows;
        if (t >= last) continue;
        const T* e = reinterpret_cast<const T*>(&raw[i]);
        uint32_t packed[2] = {0u, 0u};
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
            const float v = m == nullptr ? to_f32(e[j]) : __fsub_rn(to_f32(e[j]), mv[j]);
            const int r = max(-127, min(127, __float2int_rn(__fdiv_rn(v, scale))));
            packed[j / 4] |= (static_cast<uint32_t>(r) & 0xffu) << (8 * (j % 4));
        }
        *reinterpret_cast<uint2*>(out + (static_cast<int64_t>(t) * heads + head) * dim + c0) =
            make_uint2(packed[0], packed[1]);
    }
    for (int t = first + threadIdx.x; t < last; t += blockDim.x) {
        scale_out[static_cast<int64_t>(t) * heads + head] = scale;
    }
}

template <typename T>
__device__ void quant(const T* __restrict__ x, const float* __restrict__ mean, const int* __restrict__ cu,
                      int8_t* __restrict__ out, float* __restrict__ scale_out, int heads, int dim, int block) {
    const int seq = blockIdx.z, head = blockIdx.y;
    const int start = cu[seq], end = cu[seq + 1];
    const int first = start + blockIdx.x * block;
    if (first >= end) return;  // uniform over the CTA: no thread reaches cta_max's barrier alone
    const int last = min(end, first + block);
    const float* m = mean == nullptr ? nullptr : mean + (static_cast<int64_t>(seq) * heads + head) * dim;
    if (vec_ok(x, out, dim, block)) {
        quant_vec(x, m, first, last, out, scale_out, heads, head, dim);
    } else {
        quant_scalar(x, m, first, last, out, scale_out, heads, head, dim);
    }
}

}  // namespace rig_sq

extern "C" {

// Per (block, kv head, channel): the fp32 sum of k over the block's tokens, in token order.
__global__ void rig_sq_block_sums_bf16(const __nv_bfloat16* k, const int* cu, float* ws, int heads, int dim,
                                       int block) {
    rig_sq::block_sums(k, cu, ws, heads, dim, block);
}

__global__ void rig_sq_block_sums_f16(const __half* k, const int* cu, float* ws, int heads, int dim, int block) {
    rig_sq::block_sums(k, cu, ws, heads, dim, block);
}

// Per (sequence, kv head, channel): the sum of the block sums in block order, / float(length).
__global__ void rig_sq_k_mean(const int* cu, const float* ws, float* mean, int heads, int dim, int block) {
    const int seq = blockIdx.y, head = blockIdx.x;
    const int start = cu[seq], end = cu[seq + 1];
    if (end <= start) return;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float total = 0.0f;
        for (int first = start; first < end; first += block) {
            total = __fadd_rn(total, ws[(rig_sq::ws_row(first, block, seq) * heads + head) * dim + c]);
        }
        mean[(static_cast<int64_t>(seq) * heads + head) * dim + c] = __fdiv_rn(total, static_cast<float>(end - start));
    }
}

// Per (block, head): int8 values and the block's scale; `mean` [batch, heads, dim] is subtracted
// first when given (K), not when null (Q).
__global__ void rig_sq_quant_bf16(const __nv_bfloat16* x, const float* mean, const int* cu, int8_t* out,
                                  float* scale, int heads, int dim, int block) {
    rig_sq::quant(x, mean, cu, out, scale, heads, dim, block);
}

__global__ void rig_sq_quant_f16(const __half* x, const float* mean, const int* cu, int8_t* out, float* scale,
                                 int heads, int dim, int block) {
    rig_sq::quant(x, mean, cu, out, scale, heads, dim, block);
}

}  // extern "C"
