// Shared types of the Wan2.2 decoder kernels. Plain C++ (no torch): the binding converts tensors to these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

namespace wan22 {

// One 3D cross-correlation (PyTorch conv3d semantics, stride 1, no dilation) on channels-last bf16 tensors:
//   x   [n, d, h, w, c]     contiguous
//   wgt [k, t, r, s, c]     contiguous (KTRSC)
//   out [n, z, p, q, k]     channel stride 1; the other strides are free multiples of 8 elements (a decoder conv
//                           writes into the interior of a haloed window; the residual has its own strides)
//   z = d + pad_lo[0] + pad_hi[0] - t + 1, and likewise p (rows) and q (width).
// out = conv(x, wgt) + bias (fp32, [k]) (+ residual, out's shape), fp32 accumulation. Every pointer is 16-byte aligned.
struct Conv3dArgs {
  const void* x = nullptr;
  const void* wgt = nullptr;
  const float* bias = nullptr;
  const void* residual = nullptr;  // may be null
  void* out = nullptr;
  int n = 0, d = 0, h = 0, w = 0, c = 0;
  int k = 0, t = 0, r = 0, s = 0;
  int pad_lo[3] = {0, 0, 0};  // (d, h, w)
  int pad_hi[3] = {0, 0, 0};
  int64_t out_stride[4] = {0, 0, 0, 0};       // (n, z, p, q) in elements; channel stride is 1
  int64_t residual_stride[4] = {0, 0, 0, 0};  // (n, z, p, q); used when residual != null

  int z() const { return d + pad_lo[0] + pad_hi[0] - t + 1; }
  int p() const { return h + pad_lo[1] + pad_hi[1] - r + 1; }
  int q() const { return w + pad_lo[2] + pad_hi[2] - s + 1; }
};

// Each returns nullptr on success, else a static message saying what failed (no exceptions cross the boundary).
// Channel counts (c, k) must be multiples of 8 (16-byte TMA alignment of bf16 rows).
size_t conv3d_workspace_size(const Conv3dArgs& args);
const char* conv3d_bf16(const Conv3dArgs& args, void* workspace, cudaStream_t stream);
// Host only (no pointer is read, no CUDA call): the checks of conv3d_bf16 on the problem's shape and CUTLASS's
// can_implement of it, out_stride / residual_stride included.
const char* conv3d_can_implement(const Conv3dArgs& args);

// A channels-last activation viewed as [outer0, outer1, rows, c]: the (rows, c) slab is packed (row stride c), the
// two outer dims (batch, frames) have free strides in elements, so a norm can write into the interior of a haloed
// window without a copy.
struct Slab {
  void* data = nullptr;
  int64_t outer0 = 1, outer1 = 1, rows = 0;
  int64_t stride0 = 0, stride1 = 0;
};

// out = silu?(x / max(||x||_2 over c, eps) * gamma), statistics in fp32, stored as bf16. x and out have the same
// outer0/outer1/rows; gamma: [c] fp32 (already multiplied by sqrt(c), as Wan's RMS_norm scale does).
const char* rms_norm_silu_bf16(const Slab& x, const float* gamma, const Slab& out, int c, bool silu, float eps,
                               cudaStream_t stream);

// Sub-pixel upsample, second half: y [m, hi - 1, w + 1, 4, co] (the 2x2 conv of all four phases, bias included)
// -> out [m, 2 (hi - 2), 2 w, co] with out[m, 2i + a, 2j + c] = y[m, i + a, j + c, 2a + c]. out's frame stride is
// free (out_frame_stride elements); its (rows, width, channels) slab is packed.
const char* subpixel_scatter_bf16(const void* y, void* out, int64_t m, int hi, int w, int co,
                                  int64_t out_frame_stride, cudaStream_t stream);

// Winograd F(2x2, 3x3) for a (kt, 3, 3) conv, valid in time and rows, zero padding 1 in width (winograd.cu; the
// definition and its rounding points: vae_kernel/portable/winograd.py). Three steps per sample (and band of tile rows):
//   input transform   x [ti, hi, w, ci] -> V [16, ti, P, ci] bf16, P = ceil((hi - 2) / 2) * ceil(w / 2) tiles
//   products          M [16, to, P, co] fp32 = sum over taps t of V[:, t : t + to] @ U[t]^T, to = ti - kt + 1
//   output transform  M -> out [to, ho, w, co] bf16 (+ bias, + residual), P = ceil(ho / 2) * ceil(w / 2)
// U = G g G^T [kt, 16, co, ci] bf16 (transformed once per layer by the caller). Channels are multiples of 8; every
// pointer and stride is 16-byte aligned.

// A channels-last [frames, rows, width, channels] bf16 tensor: unit channel stride, the other strides free (elements).
struct Pixels {
  void* data = nullptr;  // null: absent (an optional residual)
  int frames = 0, rows = 0, width = 0, channels = 0;
  int64_t stride[3] = {0, 0, 0};  // (frames, rows, width)
};

// V = B^T d B per frame and tile in fp32, rounded to bf16 once; x's rows include the halo rows, its width is
// zero-padded here (and the tile grid's extent past the last row and column).
const char* winograd_input_transform_bf16(const Pixels& x, void* v, cudaStream_t stream);

struct WinogradProductsArgs {
  const void* v = nullptr;  // [16, ti, tiles, ci] bf16
  const void* u = nullptr;  // [kt, 16, co, ci] bf16
  float* m = nullptr;       // [16, ti - kt + 1, tiles, co] fp32
  int ti = 0, kt = 0, tiles = 0, ci = 0, co = 0;
};

size_t winograd_products_workspace_size(const WinogradProductsArgs& args);
const char* winograd_products_bf16(const WinogradProductsArgs& args, void* workspace, cudaStream_t stream);
// Host only (no pointer is read, no CUDA call): the checks of winograd_products_bf16 on the shape and CUTLASS's
// can_implement of every tap's batched GEMM.
const char* winograd_products_can_implement(const WinogradProductsArgs& args);

// Y = A^T M A per tile in fp32, + bias [co] fp32, + residual (bf16, out's shape, own strides; data null: none),
// rounded to bf16 once; rows and columns of the tile grid past out's are not stored. m: [16, frames, tiles, co].
const char* winograd_output_transform_bf16(const float* m, const float* bias, const Pixels& out,
                                           const Pixels& residual, cudaStream_t stream);

// The architecture this translation unit set was compiled for ("sm_90a", "sm_100a", ...).
const char* compiled_arch();

}  // namespace wan22
