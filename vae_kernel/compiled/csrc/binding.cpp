// Thin torch binding of the decoder kernels: validates tensors, converts them to the plain argument structs of
// decode_kernels.h and launches on the current stream. Destination passing: every op writes into `out`.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
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
                              c10::cuda::getCurrentCUDAStream().stream()));
}

// Two [..., C] bf16 tensors of one shape as Slabs with one common decomposition: rows = the longest run of trailing
// dims packed in both, then at most two outer dims (merged where both allow) with free strides.
std::pair<wan22::Slab, wan22::Slab> to_slabs(const at::Tensor& x, const at::Tensor& out) {
  const int64_t c = x.size(-1);
  TORCH_CHECK(x.dim() >= 2 && x.stride(-1) == 1 && out.stride(-1) == 1,
              "x and out must be [..., C] with unit channel stride; got strides ", x.strides(), " and ", out.strides());
  int64_t rows = 1, expect_x = c, expect_o = c;
  int d = x.dim() - 2;
  for (; d >= 0 && (x.size(d) == 1 || (x.stride(d) == expect_x && out.stride(d) == expect_o)); --d) {
    rows *= x.size(d);
    expect_x *= x.size(d);
    expect_o *= x.size(d);
  }
  struct Dim { int64_t size, sx, so; };
  std::vector<Dim> outer;  // outermost first
  for (int i = 0; i <= d; ++i) {
    if (x.size(i) == 1) continue;
    if (!outer.empty() && outer.back().sx == x.stride(i) * x.size(i) && outer.back().so == out.stride(i) * x.size(i)) {
      outer.back() = {outer.back().size * x.size(i), x.stride(i), out.stride(i)};
    } else {
      outer.push_back({x.size(i), x.stride(i), out.stride(i)});
    }
  }
  TORCH_CHECK(outer.size() <= 2, "x and out have too many strided dims: sizes ", x.sizes(), ", strides ",
              x.strides(), " and ", out.strides());
  wan22::Slab xs, os;
  xs.data = x.data_ptr();
  os.data = out.data_ptr();
  xs.rows = os.rows = rows;
  if (!outer.empty()) {
    const Dim& inner = outer.back();
    xs.outer1 = os.outer1 = inner.size;
    xs.stride1 = inner.sx;
    os.stride1 = inner.so;
  }
  if (outer.size() == 2) {
    xs.outer0 = os.outer0 = outer[0].size;
    xs.stride0 = outer[0].sx;
    os.stride0 = outer[0].so;
  }
  return {xs, os};
}

// out = silu?(x / max(||x||_C, eps) * gamma), statistics in fp32; x, out: [..., C] bf16, trailing dims packed.
void rms_norm_silu(const at::Tensor& x, const at::Tensor& gamma, at::Tensor& out, bool silu, double eps) {
  check_bf16_cuda(x, "x");
  check_bf16_cuda(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must be ", x.sizes(), "; got ", out.sizes());
  const int64_t c = x.size(-1);
  TORCH_CHECK(gamma.is_cuda() && gamma.scalar_type() == at::kFloat && gamma.numel() == c && gamma.is_contiguous(),
              "gamma must be a contiguous float32 CUDA tensor of ", c, " elements; got ", gamma.scalar_type(), " ",
              gamma.sizes());
  const auto [xs, os] = to_slabs(x, out);
  const c10::cuda::CUDAGuard guard(x.device());
  raise_if(wan22::rms_norm_silu_bf16(xs, gamma.data_ptr<float>(), os, static_cast<int>(c), silu,
                                     static_cast<float>(eps), c10::cuda::getCurrentCUDAStream().stream()));
}

// out[m, 2i + a, 2j + c] = y[m, i + a, j + c, 2a + c]: interleave the four sub-pixel phases.
void subpixel_scatter(const at::Tensor& y, at::Tensor& out) {
  check_bf16_cuda(y, "y");
  check_bf16_cuda(out, "out");
  TORCH_CHECK(y.dim() == 5 && y.size(3) == 4 && y.is_contiguous(), "y must be a contiguous [M, Hi - 1, W + 1, 4, Co] "
              "tensor; got ", y.sizes());
  const int64_t m = y.size(0), hi = y.size(1) + 1, w = y.size(2) - 1, co = y.size(4);
  const std::array<int64_t, 4> expected{m, 2 * (hi - 2), 2 * w, co};
  TORCH_CHECK(out.dim() == 4 && out.sizes() == at::IntArrayRef(expected), "out must be ", at::IntArrayRef(expected),
              "; got ", out.sizes());
  TORCH_CHECK(out.stride(3) == 1 && out.stride(2) == co && out.stride(1) == 2 * w * co,
              "out's rows, width and channels must be packed; got strides ", out.strides());
  const c10::cuda::CUDAGuard guard(y.device());
  raise_if(wan22::subpixel_scatter_bf16(y.data_ptr(), out.data_ptr(), m, static_cast<int>(hi), static_cast<int>(w),
                                        static_cast<int>(co), m > 1 ? out.stride(0) : 0,
                                        c10::cuda::getCurrentCUDAStream().stream()));
}

// A [frames, rows, width, channels] bf16 CUDA tensor with unit channel stride as Pixels (other strides free).
wan22::Pixels to_pixels(const at::Tensor& t, const char* name) {
  check_bf16_cuda(t, name);
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, name, " must be a [frames, rows, width, channels] tensor with unit "
              "channel stride; got sizes ", t.sizes(), " strides ", t.strides());
  wan22::Pixels p;
  p.data = t.data_ptr();
  p.frames = t.size(0); p.rows = t.size(1); p.width = t.size(2); p.channels = t.size(3);
  for (int i = 0; i < 3; ++i) p.stride[i] = t.stride(i);
  return p;
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* names) {
  TORCH_CHECK(a.get_device() == b.get_device(), names, " must be on one device; got ", a.device(), " and ",
              b.device());
}

// Winograd F(2x2, 3x3), step 1: v = B^T d B of every tile of x (rows include the halo rows; width zero-padded).
void winograd_input_transform(const at::Tensor& x, at::Tensor& v) {
  const wan22::Pixels xs = to_pixels(x, "x");
  check_bf16_cuda(v, "v");
  check_same_device(x, v, "x and v");
  TORCH_CHECK(xs.rows >= 3, "x needs at least 3 rows (one output row and its halo rows); got ", x.sizes());
  const int64_t tiles = static_cast<int64_t>((xs.rows - 1) / 2) * ((xs.width + 1) / 2);
  const std::array<int64_t, 4> expected{16, xs.frames, tiles, xs.channels};
  TORCH_CHECK(v.is_contiguous() && v.sizes() == at::IntArrayRef(expected), "v must be a contiguous ",
              at::IntArrayRef(expected), " tensor for x ", x.sizes(), "; got ", v.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  raise_if(wan22::winograd_input_transform_bf16(xs, v.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()));
}

// Step 2: m = sum over taps t of v[:, t : t + to] @ u[t]^T per component, bf16 operands, fp32 accumulation.
void winograd_products(const at::Tensor& v, const at::Tensor& u, at::Tensor& m) {
  check_bf16_cuda(v, "v");
  check_bf16_cuda(u, "u");
  TORCH_CHECK(m.is_cuda() && m.scalar_type() == at::kFloat, "m must be a float32 CUDA tensor; got ",
              m.scalar_type(), " on ", m.device());
  check_same_device(v, u, "v and u");
  check_same_device(v, m, "v and m");
  TORCH_CHECK(v.dim() == 4 && v.size(0) == 16 && v.is_contiguous(), "v must be a contiguous [16, Ti, tiles, Ci] "
              "tensor; got ", v.sizes());
  TORCH_CHECK(u.dim() == 4 && u.size(1) == 16 && u.size(3) == v.size(3) && u.is_contiguous(), "u must be a "
              "contiguous [kt, 16, Co, ", v.size(3), "] tensor; got ", u.sizes());
  TORCH_CHECK(u.size(0) <= v.size(1), "u has ", u.size(0), " time taps but v only ", v.size(1), " frames");
  const std::array<int64_t, 4> expected{16, v.size(1) - u.size(0) + 1, v.size(2), u.size(2)};
  TORCH_CHECK(m.is_contiguous() && m.sizes() == at::IntArrayRef(expected), "m must be a contiguous ",
              at::IntArrayRef(expected), " tensor for v ", v.sizes(), " and u ", u.sizes(), "; got ", m.sizes());
  wan22::WinogradProductsArgs a;
  a.v = v.data_ptr();
  a.u = u.data_ptr();
  a.m = m.data_ptr<float>();
  a.ti = v.size(1); a.kt = u.size(0); a.tiles = v.size(2); a.ci = v.size(3); a.co = u.size(2);
  const c10::cuda::CUDAGuard guard(v.device());
  const size_t workspace_bytes = wan22::winograd_products_workspace_size(a);
  at::Tensor workspace;
  if (workspace_bytes > 0) workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, v.options().dtype(at::kByte));
  raise_if(wan22::winograd_products_bf16(a, workspace_bytes ? workspace.data_ptr() : nullptr,
                                         c10::cuda::getCurrentCUDAStream().stream()));
}

// Step 3: out = A^T m A of every tile + b (+ residual), cropped to out's rows and width.
void winograd_output_transform(const at::Tensor& m, const at::Tensor& b, at::Tensor& out,
                               const std::optional<at::Tensor>& residual) {
  const wan22::Pixels os = to_pixels(out, "out");
  TORCH_CHECK(m.is_cuda() && m.scalar_type() == at::kFloat, "m must be a float32 CUDA tensor; got ",
              m.scalar_type(), " on ", m.device());
  check_same_device(m, out, "m and out");
  const int64_t tiles = static_cast<int64_t>((os.rows + 1) / 2) * ((os.width + 1) / 2);
  const std::array<int64_t, 4> expected{16, os.frames, tiles, os.channels};
  TORCH_CHECK(m.is_contiguous() && m.sizes() == at::IntArrayRef(expected), "m must be a contiguous ",
              at::IntArrayRef(expected), " tensor for out ", out.sizes(), "; got ", m.sizes());
  TORCH_CHECK(b.is_cuda() && b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == os.channels &&
                  b.is_contiguous(),
              "b must be a contiguous float32 [", os.channels, "] CUDA tensor; got ", b.scalar_type(), " ", b.sizes());
  check_same_device(b, out, "b and out");
  wan22::Pixels rs;
  if (residual.has_value()) {
    rs = to_pixels(*residual, "residual");
    check_same_device(*residual, out, "residual and out");
    TORCH_CHECK(residual->sizes() == out.sizes(), "residual must have out's shape ", out.sizes(), "; got ",
                residual->sizes());
  }
  const c10::cuda::CUDAGuard guard(out.device());
  raise_if(wan22::winograd_output_transform_bf16(m.data_ptr<float>(), b.data_ptr<float>(), os, rs,
                                                 c10::cuda::getCurrentCUDAStream().stream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Wan2.2 VAE decoder kernels (CUTLASS implicit-GEMM conv3d, Winograd F(2x2, 3x3) conv, fused RMS-norm + "
            "SiLU)";
  m.def("conv3d", &conv3d, "out = conv3d(x, w) + b (+ residual); NDHWC bf16, fp32 accumulation", py::arg("x"),
        py::arg("w"), py::arg("b"), py::arg("out"), py::arg("residual") = py::none(), py::arg("pad_lo"),
        py::arg("pad_hi"));
  m.def("rms_norm_silu", &rms_norm_silu, "fused RMS-norm (fp32 statistics) + optional SiLU, bf16 out", py::arg("x"),
        py::arg("gamma"), py::arg("out"), py::arg("silu") = true, py::arg("eps") = 1e-12);
  m.def("subpixel_scatter", &subpixel_scatter, "interleave the four sub-pixel phases of an upsample conv",
        py::arg("y"), py::arg("out"));
  m.def("winograd_input_transform", &winograd_input_transform, "Winograd F(2x2, 3x3): V = B^T d B per tile, bf16",
        py::arg("x"), py::arg("v"));
  m.def("winograd_products", &winograd_products, "Winograd F(2x2, 3x3): M = sum_t V_t U_t^T per component, fp32",
        py::arg("v"), py::arg("u"), py::arg("m"));
  m.def("winograd_output_transform", &winograd_output_transform, "Winograd F(2x2, 3x3): out = A^T M A + b "
        "(+ residual), bf16", py::arg("m"), py::arg("b"), py::arg("out"), py::arg("residual") = py::none());
  m.def("arch", []() { return std::string(wan22::compiled_arch()); }, "the GPU architecture this build targets");
}
