// Nearest-2x upsample + 3x3 conv as sub-pixel convolution: the conv of all four phases (one CUTLASS 2x2 conv with
// 4 x Co output channels, bias in its epilogue) is done by conv3d_cutlass.cu; this file interleaves the phases into
// the high-resolution frame. A pure bandwidth pass, 16 bytes per thread.
#include "decode_kernels.h"

namespace wan22 {
namespace {

__global__ void subpixel_scatter_kernel(const uint4* __restrict__ y, uint4* __restrict__ out, int64_t total, int rows,
                                        int w, int vecs, int64_t out_frame_stride_vecs) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= total) return;
  // idx runs over out [m, 2 rows, 2 w, vecs]
  const int v = idx % vecs;
  int64_t rest = idx / vecs;
  const int ox = rest % (2 * w);
  rest /= 2 * w;
  const int oy = rest % (2 * rows);
  const int64_t frame = rest / (2 * rows);
  const int a = oy & 1, c = ox & 1, i = oy >> 1, j = ox >> 1;
  // y [m, rows + 1, w + 1, 4, vecs]
  const int64_t src = (((frame * (rows + 1) + i + a) * (w + 1) + j + c) * 4 + 2 * a + c) * vecs + v;
  const int64_t dst = frame * out_frame_stride_vecs + (static_cast<int64_t>(oy) * 2 * w + ox) * vecs + v;
  out[dst] = y[src];
}

}  // namespace

const char* subpixel_scatter_bf16(const void* y, void* out, int64_t m, int hi, int w, int co,
                                  int64_t out_frame_stride, cudaStream_t stream) {
  if (co % 8 != 0 || out_frame_stride % 8 != 0) return "subpixel_scatter: channels and strides must be multiples of 8";
  if (reinterpret_cast<uintptr_t>(y) % 16 || reinterpret_cast<uintptr_t>(out) % 16)
    return "subpixel_scatter: tensors must be 16-byte aligned";
  const int rows = hi - 2;
  const int vecs = co / 8;
  const int64_t total = m * 2 * rows * 2 * static_cast<int64_t>(w) * vecs;
  if (total == 0) return nullptr;
  constexpr int kThreads = 256;
  subpixel_scatter_kernel<<<static_cast<unsigned>((total + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const uint4*>(y), static_cast<uint4*>(out), total, rows, w, vecs, out_frame_stride / 8);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace wan22
