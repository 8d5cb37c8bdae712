// Winograd F(2x2, 3x3): the work of one thread of the input and output transforms (winograd.cu launches them).
// __host__ __device__ so a host program can run them over the whole grid and check them against the portable
// definition on a machine without a GPU (tests/vae_kernel/compiled/test_winograd_kernels.py). Rounding points as vae_kernel/portable/winograd.py:
// the transforms are fp32 two-operand adds in the portable code's order (no products, so nothing to contract into
// an FMA), V and Y are rounded to bf16 once each.
#pragma once

#include <cuda_bf16.h>

#include "decode_kernels.h"

namespace wan22 {
namespace winograd {

// One 16-byte vector of 8 bf16 channels as four pairs.
union Vec8 {
  uint4 raw;
  __nv_bfloat162 pair[4];
};

union Vec4 {
  uint2 raw;
  __nv_bfloat162 pair[2];
};

// B^T = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]] applied to 4 values (portable: -d1 + d2, which
// equals d2 - d1 bit for bit).
__host__ __device__ inline void bt_combine(const float2 (&in)[4], float2 (&out)[4]) {
  out[0] = make_float2(in[0].x - in[2].x, in[0].y - in[2].y);
  out[1] = make_float2(in[1].x + in[2].x, in[1].y + in[2].y);
  out[2] = make_float2(in[2].x - in[1].x, in[2].y - in[1].y);
  out[3] = make_float2(in[1].x - in[3].x, in[1].y - in[3].y);
}

// V = B^T d B of tile p of `frame`, 8 channels from vector cv: 16 loads and 16 stores of 16 bytes. x's rows include
// the halo rows; column -1 (the 'same' padding) and the tile grid's extent right of and below x read as zeros.
// v: [16, x.frames, tiles, vecs] in 16-byte vectors.
__host__ __device__ inline void input_transform_vec(const Pixels& x, uint4* __restrict__ v, int frame, int p, int cv,
                                                    int tiles_w, int tiles, int vecs) {
  const int row0 = 2 * (p / tiles_w), col0 = 2 * (p % tiles_w) - 1;
  const __nv_bfloat16* base = static_cast<const __nv_bfloat16*>(x.data) + frame * x.stride[0] + cv * 8;
  Vec8 d[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = row0 + i, col = col0 + j;
      d[i][j].raw = (row < x.rows && col >= 0 && col < x.width)
                        ? *reinterpret_cast<const uint4*>(base + row * x.stride[1] + col * x.stride[2])
                        : make_uint4(0, 0, 0, 0);
    }
  }
  const int64_t component_stride = static_cast<int64_t>(x.frames) * tiles * vecs;
  uint4* dst = v + (static_cast<int64_t>(frame) * tiles + p) * vecs + cv;
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // one row of V (4 components) at a time bounds the live registers
    Vec8 row[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // channel pairs
      float2 t[4], out[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // B^T across rows first (the portable code's dim 0), row i of it only
        float2 col[4], combined[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) col[r] = __bfloat1622float2(d[r][j].pair[k]);
        bt_combine(col, combined);
        t[j] = combined[i];
      }
      bt_combine(t, out);  // then B across columns
#pragma unroll
      for (int j = 0; j < 4; ++j) row[j].pair[k] = __floats2bfloat162_rn(out[j].x, out[j].y);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) dst[(4 * i + j) * component_stride] = row[j].raw;
  }
}

__host__ __device__ inline float4 add(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

__host__ __device__ inline float4 sub(float4 a, float4 b) {
  return make_float4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w);
}

// A^T = [[1, 1, 1, 0], [0, 1, -1, -1]]: (m0 + m1) + m2 and (m1 - m2) - m3, the portable code's order.
__host__ __device__ inline void at_combine(float4 m0, float4 m1, float4 m2, float4 m3, float4& y0, float4& y1) {
  y0 = add(add(m0, m1), m2);
  y1 = sub(sub(m1, m2), m3);
}

// Y = A^T M A of tile p of `frame`, 4 channels from vector cv (of 4), + bias (+ residual), rounded to bf16 once:
// 16 loads of 16 bytes, up to 4 stores of 8 bytes (pixels past out's rows or width are not stored).
// m: [16, out.frames, tiles, vecs] in float4; residual.data null: none.
__host__ __device__ inline void output_transform_vec(const float4* __restrict__ m, const float* __restrict__ bias,
                                                     const Pixels& out, const Pixels& residual, int frame, int p,
                                                     int cv, int tiles_w, int tiles, int vecs) {
  const int row0 = 2 * (p / tiles_w), col0 = 2 * (p % tiles_w);
  const int64_t component_stride = static_cast<int64_t>(out.frames) * tiles * vecs;
  const float4* src = m + (static_cast<int64_t>(frame) * tiles + p) * vecs + cv;
  float4 t[2][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // A^T across rows first (component 4 i + j is row i, column j)
    at_combine(src[j * component_stride], src[(4 + j) * component_stride], src[(8 + j) * component_stride],
               src[(12 + j) * component_stride], t[0][j], t[1][j]);
  }
  const float4 b = make_float4(bias[4 * cv], bias[4 * cv + 1], bias[4 * cv + 2], bias[4 * cv + 3]);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float4 y[2];
    at_combine(t[r][0], t[r][1], t[r][2], t[r][3], y[0], y[1]);  // then A across columns
    const int row = row0 + r;
    if (row >= out.rows) continue;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int col = col0 + s;
      if (col >= out.width) continue;
      float4 value = add(y[s], b);
      if (residual.data != nullptr) {
        Vec4 r16;
        r16.raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(residual.data) +
                                                  frame * residual.stride[0] + row * residual.stride[1] +
                                                  col * residual.stride[2] + 4 * cv);
        const float2 lo = __bfloat1622float2(r16.pair[0]), hi = __bfloat1622float2(r16.pair[1]);
        value = add(value, make_float4(lo.x, lo.y, hi.x, hi.y));
      }
      Vec4 o;
      o.pair[0] = __floats2bfloat162_rn(value.x, value.y);
      o.pair[1] = __floats2bfloat162_rn(value.z, value.w);
      *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(out.data) + frame * out.stride[0] + row * out.stride[1] +
                                col * out.stride[2] + 4 * cv) = o.raw;
    }
  }
}

}  // namespace winograd
}  // namespace wan22
