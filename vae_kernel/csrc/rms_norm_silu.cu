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
__global__ void rms_norm_silu_kernel(const uint4* __restrict__ x, const float* __restrict__ gamma,
                                     uint4* __restrict__ out, int64_t rows, int vecs_per_row, bool apply_silu,
                                     float eps) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const uint4* xrow = x + row * vecs_per_row;
  uint4* orow = out + row * vecs_per_row;

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
void launch(const void* x, const float* gamma, void* out, int64_t rows, int vecs, bool silu_on, float eps,
            cudaStream_t stream) {
  constexpr int kWarps = 8;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  rms_norm_silu_kernel<VecsPerLane><<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(
      static_cast<const uint4*>(x), gamma, static_cast<uint4*>(out), rows, vecs, silu_on, eps);
}

}  // namespace

const char* rms_norm_silu_bf16(const void* x, const float* gamma, void* out, int64_t rows, int c, bool silu_on,
                               float eps, cudaStream_t stream) {
  if (c % kVec != 0) return "rms_norm_silu: channels must be a multiple of 8";
  if (c > 32 * kVec * kMaxVecsPerLane) return "rms_norm_silu: at most 2048 channels";
  if ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(gamma)) % 16)
    return "rms_norm_silu: tensors must be 16-byte aligned";
  if (rows == 0) return nullptr;
  if (rows > static_cast<int64_t>(8) * 0x7fffffff) return "rms_norm_silu: too many rows";
  const int vecs = c / kVec;
  const int per_lane = (vecs + 31) / 32;
  if (per_lane <= 1) launch<1>(x, gamma, out, rows, vecs, silu_on, eps, stream);
  else if (per_lane <= 2) launch<2>(x, gamma, out, rows, vecs, silu_on, eps, stream);
  else if (per_lane <= 4) launch<4>(x, gamma, out, rows, vecs, silu_on, eps, stream);
  else launch<8>(x, gamma, out, rows, vecs, silu_on, eps, stream);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace wan22
