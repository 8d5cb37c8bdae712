// Fused RMS-norm (fp32 statistics) + SiLU + bf16 cast over the channel dimension of a channels-last tensor:
// one read of the activation, one write of the next conv's input (diffusers does ~4 fp32 passes here).
#include "decode_kernels.h"

#include <cuda_bf16.h>

namespace wan22 {
namespace {

constexpr int kVec = 8;          // bf16 per 16-byte access; c is a multiple of 8
constexpr int kMaxVecsPerLane = 8;  // registers hold a row of up to 32 * 8 * 8 = 2048 channels

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// One warp per row; the row stays in registers between the reduction and the write.
template <int VecsPerLane>
__global__ void rms_norm_silu_kernel(Slab x, const float* __restrict__ gamma, Slab out, int64_t total_rows,
                                     int vecs_per_row, bool apply_silu, float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (row >= total_rows) return;
  const int64_t r = row % x.rows;
  const int64_t i1 = (row / x.rows) % x.outer1;
  const int64_t i0 = row / (x.rows * x.outer1);
  const int c = vecs_per_row * kVec;
  const uint4* xrow = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(x.data) + i0 * x.stride0 +
                                                     i1 * x.stride1 + r * c);
  uint4* orow = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(out.data) + i0 * out.stride0 +
                                         i1 * out.stride1 + r * c);

  uint4 held[VecsPerLane];
  float sumsq = 0.f;
#pragma unroll
  for (int i = 0; i < VecsPerLane; ++i) {
    const int v = lane + 32 * i;
    if (v < vecs_per_row) {
      held[i] = xrow[v];
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&held[i]);
#pragma unroll
      for (int j = 0; j < kVec / 2; ++j) {
        const float2 f = __bfloat1622float2(pairs[j]);
        sumsq += f.x * f.x + f.y * f.y;
      }
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sumsq += __shfl_xor_sync(0xffffffffu, sumsq, offset);
  // F.normalize: x / max(||x||, eps)
  const float inv = 1.0f / fmaxf(sqrtf(sumsq), eps);

#pragma unroll
  for (int i = 0; i < VecsPerLane; ++i) {
    const int v = lane + 32 * i;
    if (v < vecs_per_row) {
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&held[i]);
      const float4 g0 = reinterpret_cast<const float4*>(gamma)[2 * v];
      const float4 g1 = reinterpret_cast<const float4*>(gamma)[2 * v + 1];
      const float g[kVec] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      uint4 result;
      __nv_bfloat162* res = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
      for (int j = 0; j < kVec / 2; ++j) {
        const float2 f = __bfloat1622float2(pairs[j]);
        float a = f.x * inv * g[2 * j];
        float b = f.y * inv * g[2 * j + 1];
        if (apply_silu) {
          a = silu(a);
          b = silu(b);
        }
        res[j] = __floats2bfloat162_rn(a, b);
      }
      orow[v] = result;
    }
  }
}

template <int VecsPerLane>
void launch(const Slab& x, const float* gamma, const Slab& out, int64_t total_rows, int vecs, bool silu_on, float eps,
            cudaStream_t stream) {
  constexpr int kWarps = 8;
  const int64_t blocks = (total_rows + kWarps - 1) / kWarps;
  rms_norm_silu_kernel<VecsPerLane><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(
      x, gamma, out, total_rows, vecs, silu_on, eps);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

const char* rms_norm_silu_bf16(const Slab& x, const float* gamma, const Slab& out, int c, bool silu_on, float eps,
                               cudaStream_t stream) {
  if (c % kVec != 0) return "rms_norm_silu: channels must be a multiple of 8";
  if (c > 32 * kVec * kMaxVecsPerLane) return "rms_norm_silu: at most 2048 channels";
  if (!aligned16(x.data) || !aligned16(out.data) || !aligned16(gamma) || x.stride0 % kVec || x.stride1 % kVec ||
      out.stride0 % kVec || out.stride1 % kVec)
    return "rms_norm_silu: tensors and their strides must be 16-byte aligned";
  const int64_t total_rows = x.outer0 * x.outer1 * x.rows;
  if (total_rows == 0) return nullptr;
  if ((total_rows + 7) / 8 > 0x7fffffff) return "rms_norm_silu: too many rows";
  const int vecs = c / kVec;
  const int per_lane = (vecs + 31) / 32;
  if (per_lane <= 1) launch<1>(x, gamma, out, total_rows, vecs, silu_on, eps, stream);
  else if (per_lane <= 2) launch<2>(x, gamma, out, total_rows, vecs, silu_on, eps, stream);
  else if (per_lane <= 4) launch<4>(x, gamma, out, total_rows, vecs, silu_on, eps, stream);
  else launch<8>(x, gamma, out, total_rows, vecs, silu_on, eps, stream);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace wan22
