// Thin torch binding of the decoder kernels: validates tensors, converts them to the plain argument structs of
// decode_kernels.h and launches on the current stream. Destination passing: every op writes into `out`.
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "decode_kernels.h"

namespace {

void check_bf16_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor; got device ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16; got ", t.scalar_type());
}

void raise_if(const char* error) { TORCH_CHECK(error == nullptr, error ? error : ""); }

// out = conv3d(x, w) + b (+ residual), with explicit lower/upper zero padding per (time, rows, width).
void conv3d(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& out,
            const std::optional<at::Tensor>& residual, std::vector<int64_t> pad_lo, std::vector<int64_t> pad_hi) {
  check_bf16_cuda(x, "x");
  check_bf16_cuda(w, "w");
  check_bf16_cuda(out, "out");
  TORCH_CHECK(x.dim() == 5 && x.is_contiguous(), "x must be a contiguous [N, T, H, W, C] tensor; got sizes ",
              x.sizes(), " strides ", x.strides());
  TORCH_CHECK(w.dim() == 5 && w.is_contiguous(), "w must be a contiguous [Co, kt, kh, kw, Ci] tensor; got ", w.sizes());
  TORCH_CHECK(b.is_cuda() && b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == w.size(0) &&
                  b.is_contiguous(),
              "b must be a contiguous float32 [", w.size(0), "] CUDA tensor; got ", b.scalar_type(), " ", b.sizes());
  TORCH_CHECK(w.size(4) == x.size(4), "w has ", w.size(4), " input channels but x has ", x.size(4));
  TORCH_CHECK(pad_lo.size() == 3 && pad_hi.size() == 3, "pad_lo and pad_hi must have 3 entries (t, h, w)");
  TORCH_CHECK(x.get_device() == w.get_device() && x.get_device() == out.get_device() &&
                  x.get_device() == b.get_device(), "x, w, b and out must be on one device");

  wan22::Conv3dArgs a;
  a.n = x.size(0); a.d = x.size(1); a.h = x.size(2); a.w = x.size(3); a.c = x.size(4);
  a.k = w.size(0); a.t = w.size(1); a.r = w.size(2); a.s = w.size(3);
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(pad_lo[i] >= 0 && pad_hi[i] >= 0, "padding must be non-negative");
    a.pad_lo[i] = pad_lo[i];
    a.pad_hi[i] = pad_hi[i];
  }
  const std::array<int64_t, 5> expected{a.n, a.z(), a.p(), a.q(), a.k};
  TORCH_CHECK(out.dim() == 5 && out.sizes() == at::IntArrayRef(expected), "out must be ", at::IntArrayRef(expected),
              " for x ", x.sizes(), " and w ", w.sizes(), "; got ", out.sizes());
  TORCH_CHECK(out.stride(4) == 1, "out must have unit channel stride; got strides ", out.strides());
  for (int i = 0; i < 4; ++i) a.out_stride[i] = out.stride(i);
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    check_bf16_cuda(r, "residual");
    TORCH_CHECK(r.sizes() == out.sizes() && r.stride(4) == 1, "residual must be ", out.sizes(),
                " with unit channel stride; got ", r.sizes(), " strides ", r.strides());
    for (int i = 0; i < 4; ++i) a.residual_stride[i] = r.stride(i);
    a.residual = r.data_ptr();
  }
  a.x = x.data_ptr();
  a.wgt = w.data_ptr();
  a.bias = b.data_ptr<float>();
  a.out = out.data_ptr();

  const c10::cuda::CUDAGuard guard(x.device());
  const size_t workspace_bytes = wan22::conv3d_workspace_size(a);
  at::Tensor workspace;
  if (workspace_bytes > 0) workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, x.options().dtype(at::kByte));
  raise_if(wan22::conv3d_bf16(a, workspace_bytes ? workspace.data_ptr() : nullptr,
                              at::cuda::getCurrentCUDAStream()));
}

// out = silu?(x / max(||x||_C, eps) * gamma), statistics in fp32; x, out: [..., C] bf16 contiguous.
void rms_norm_silu(const at::Tensor& x, const at::Tensor& gamma, at::Tensor& out, bool silu, double eps) {
  check_bf16_cuda(x, "x");
  check_bf16_cuda(out, "out");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "x and out must be contiguous (channels last)");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must be ", x.sizes(), "; got ", out.sizes());
  const int64_t c = x.size(-1);
  TORCH_CHECK(gamma.is_cuda() && gamma.scalar_type() == at::kFloat && gamma.numel() == c && gamma.is_contiguous(),
              "gamma must be a contiguous float32 CUDA tensor of ", c, " elements; got ", gamma.scalar_type(), " ",
              gamma.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  raise_if(wan22::rms_norm_silu_bf16(x.data_ptr(), gamma.data_ptr<float>(), out.data_ptr(), x.numel() / c,
                                     static_cast<int>(c), silu, static_cast<float>(eps),
                                     at::cuda::getCurrentCUDAStream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Wan2.2 VAE decoder kernels (CUTLASS implicit-GEMM conv3d, fused RMS-norm + SiLU)";
  m.def("conv3d", &conv3d, "out = conv3d(x, w) + b (+ residual); NDHWC bf16, fp32 accumulation", py::arg("x"),
        py::arg("w"), py::arg("b"), py::arg("out"), py::arg("residual") = py::none(), py::arg("pad_lo"),
        py::arg("pad_hi"));
  m.def("rms_norm_silu", &rms_norm_silu, "fused RMS-norm (fp32 statistics) + optional SiLU, bf16 out", py::arg("x"),
        py::arg("gamma"), py::arg("out"), py::arg("silu") = true, py::arg("eps") = 1e-12);
  m.def("arch", []() { return std::string(wan22::compiled_arch()); }, "the GPU architecture this build targets");
}
