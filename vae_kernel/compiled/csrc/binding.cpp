// Thin torch binding of the decoder kernels: validates tensors, converts them to the plain argument structs of
// decode_kernels.h and launches on the current stream. Destination passing: every op writes into `out`.
//
// Every entry point checks all it takes before any CUDA call, in this order: dtypes and shapes, then the layout rules
// of the kernels (every pointer 16-byte aligned, unit channel stride, every other stride a whole number of 16-byte
// vectors, packed where a kernel assumes it), then that the tensors are CUDA tensors of one device. So a wrong call
// raises with the tensor, its sizes and strides and the rule, never launches a kernel (or encodes a TMA descriptor)
// on it, and a CPU tensor shows the layout checks without a GPU.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "decode_kernels.h"

namespace {

void check_dtype(const at::Tensor& t, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.scalar_type() == type, name, " must be ", type, "; got ", t.scalar_type());
}

void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must start at a 16-byte aligned address "
              "(the kernels move 16-byte vectors and TMA tiles); got sizes ", t.sizes(), ", strides ", t.strides(),
              ", storage offset ", t.storage_offset(), " (", t.element_size(), "-byte elements)");
}

int64_t per_16_bytes(const at::Tensor& t) { return 16 / static_cast<int64_t>(t.element_size()); }

// Aligned, unit channel stride, and every other stride (of a dim longer than 1) a multiple of 16 bytes: the rule of
// the TMA descriptors and of the 16-byte vector accesses.
void check_vector_layout(const at::Tensor& t, const char* name) {
  check_aligned(t, name);
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must have unit channel stride; got sizes ", t.sizes(),
              ", strides ", t.strides());
  for (int64_t i = 0; i + 1 < t.dim(); ++i)
    TORCH_CHECK(t.size(i) == 1 || t.stride(i) % per_16_bytes(t) == 0, name, "'s strides must be multiples of ",
                per_16_bytes(t), " elements (16 bytes) in every dim longer than 1; got sizes ", t.sizes(),
                ", strides ", t.strides());
}

void check_contiguous(const at::Tensor& t, const char* name, const char* layout) {
  TORCH_CHECK(t.is_contiguous(), name, " must be a contiguous ", layout, " tensor; got sizes ", t.sizes(),
              ", strides ", t.strides());
  check_aligned(t, name);
}

// The last check before the launch: CUDA tensors, all on one device (the first one's).
void check_cuda(std::initializer_list<std::pair<const at::Tensor*, const char*>> tensors) {
  const at::Tensor& first = *tensors.begin()->first;
  for (const auto& [t, name] : tensors) {
    TORCH_CHECK(t->is_cuda(), name, " must be a CUDA tensor; got device ", t->device());
    TORCH_CHECK(t->get_device() == first.get_device(), name, " is on ", t->device(), " but ",
                tensors.begin()->second, " on ", first.device(), ": all tensors must be on one device");
  }
}

// Strides of a channels-last tensor's outer dims for the kernels: a dim of size 1 is never stepped over, so its stride
// (free in torch) is replaced by the packed one, which the TMA rules accept.
void outer_strides(const at::Tensor& t, int64_t* strides, int outer) {
  int64_t packed = t.size(outer) * t.stride(outer);
  for (int i = outer - 1; i >= 0; --i) {
    strides[i] = t.size(i) == 1 ? packed : t.stride(i);
    packed = t.size(i) * strides[i];
  }
}

void raise_if(const char* error) { TORCH_CHECK(error == nullptr, error ? error : ""); }

// out = conv3d(x, w) + b (+ residual), with explicit lower/upper zero padding per (time, rows, width).
void conv3d(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, at::Tensor& out,
            const std::optional<at::Tensor>& residual, std::vector<int64_t> pad_lo, std::vector<int64_t> pad_hi) {
  check_dtype(x, at::kBFloat16, "x");
  check_dtype(w, at::kBFloat16, "w");
  check_dtype(out, at::kBFloat16, "out");
  TORCH_CHECK(x.dim() == 5, "x must be a [N, T, H, W, C] tensor; got sizes ", x.sizes());
  check_contiguous(x, "x", "[N, T, H, W, C]");
  TORCH_CHECK(w.dim() == 5, "w must be a [Co, kt, kh, kw, Ci] tensor; got sizes ", w.sizes());
  check_contiguous(w, "w", "[Co, kt, kh, kw, Ci]");
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == w.size(0), "b must be a float32 [",
              w.size(0), "] tensor; got ", b.scalar_type(), " ", b.sizes());
  check_contiguous(b, "b", "float32 [Co]");
  TORCH_CHECK(w.size(4) == x.size(4), "w has ", w.size(4), " input channels but x has ", x.size(4));
  TORCH_CHECK(x.size(4) % 8 == 0 && w.size(0) % 8 == 0, "conv3d's channel counts must be multiples of 8 (16-byte "
              "rows); got x ", x.sizes(), " and w ", w.sizes());
  TORCH_CHECK(pad_lo.size() == 3 && pad_hi.size() == 3, "pad_lo and pad_hi must have 3 entries (t, h, w)");

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
  check_vector_layout(out, "out");
  outer_strides(out, a.out_stride, 4);
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    check_dtype(r, at::kBFloat16, "residual");
    TORCH_CHECK(r.sizes() == out.sizes(), "residual must be ", out.sizes(), "; got ", r.sizes());
    check_vector_layout(r, "residual");
    outer_strides(r, a.residual_stride, 4);
    a.residual = r.data_ptr();
  }
  a.x = x.data_ptr();
  a.wgt = w.data_ptr();
  a.bias = b.data_ptr<float>();
  a.out = out.data_ptr();
  if (residual.has_value()) check_cuda({{&x, "x"}, {&w, "w"}, {&b, "b"}, {&out, "out"}, {&*residual, "residual"}});
  else check_cuda({{&x, "x"}, {&w, "w"}, {&b, "b"}, {&out, "out"}});

  const c10::cuda::CUDAGuard guard(x.device());
  const size_t workspace_bytes = wan22::conv3d_workspace_size(a);
  at::Tensor workspace;
  if (workspace_bytes > 0) workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, x.options().dtype(at::kByte));
  raise_if(wan22::conv3d_bf16(a, workspace_bytes ? workspace.data_ptr() : nullptr,
                              c10::cuda::getCurrentCUDAStream().stream()));
}

int to_int(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), what, " must be in [0, 2^31); got ", v);
  return static_cast<int>(v);
}

// Host only, no tensor and no GPU: whether the compiled conv takes the problem x [N, T, H, W, C] * w [Co, kt, kh, kw,
// C] with this padding (packed out and residual): None, else the reason. The checks of conv3d_bf16 on the shape,
// CUTLASS's can_implement included; the pointer and stride rules are the binding's (checked on every call).
std::optional<std::string> conv3d_can_implement(std::vector<int64_t> x_sizes, std::vector<int64_t> w_sizes,
                                                std::vector<int64_t> pad_lo, std::vector<int64_t> pad_hi) {
  TORCH_CHECK(x_sizes.size() == 5 && w_sizes.size() == 5 && pad_lo.size() == 3 && pad_hi.size() == 3,
              "x_sizes and w_sizes must have 5 entries, pad_lo and pad_hi 3");
  TORCH_CHECK(x_sizes[4] == w_sizes[4], "w has ", w_sizes[4], " input channels but x has ", x_sizes[4]);
  wan22::Conv3dArgs a;
  a.n = to_int(x_sizes[0], "N"); a.d = to_int(x_sizes[1], "T"); a.h = to_int(x_sizes[2], "H");
  a.w = to_int(x_sizes[3], "W"); a.c = to_int(x_sizes[4], "C");
  a.k = to_int(w_sizes[0], "Co"); a.t = to_int(w_sizes[1], "kt"); a.r = to_int(w_sizes[2], "kh");
  a.s = to_int(w_sizes[3], "kw");
  for (int i = 0; i < 3; ++i) {
    a.pad_lo[i] = to_int(pad_lo[i], "padding");
    a.pad_hi[i] = to_int(pad_hi[i], "padding");
  }
  a.out_stride[3] = a.k;  // packed [N, z, p, q, Co]
  a.out_stride[2] = a.out_stride[3] * std::max(a.q(), 1);
  a.out_stride[1] = a.out_stride[2] * std::max(a.p(), 1);
  a.out_stride[0] = a.out_stride[1] * std::max(a.z(), 1);
  const char* error = wan22::conv3d_can_implement(a);
  return error == nullptr ? std::nullopt : std::optional<std::string>(error);
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
  check_dtype(x, at::kBFloat16, "x");
  check_dtype(out, at::kBFloat16, "out");
  TORCH_CHECK(out.sizes() == x.sizes(), "out must be ", x.sizes(), "; got ", out.sizes());
  const int64_t c = x.size(-1);
  TORCH_CHECK(c % 8 == 0, "rms_norm_silu's channels must be a multiple of 8 (16-byte rows); got ", x.sizes());
  TORCH_CHECK(gamma.scalar_type() == at::kFloat && gamma.numel() == c, "gamma must be a float32 tensor of ", c,
              " elements; got ", gamma.scalar_type(), " ", gamma.sizes());
  check_contiguous(gamma, "gamma", "float32 [C]");
  check_vector_layout(x, "x");
  check_vector_layout(out, "out");
  const auto [xs, os] = to_slabs(x, out);
  TORCH_CHECK(xs.stride0 % 8 == 0 && xs.stride1 % 8 == 0 && os.stride0 % 8 == 0 && os.stride1 % 8 == 0,
              "x's and out's strides must be multiples of 8 elements (16 bytes); got ", x.strides(), " and ",
              out.strides());
  check_cuda({{&x, "x"}, {&gamma, "gamma"}, {&out, "out"}});
  const c10::cuda::CUDAGuard guard(x.device());
  raise_if(wan22::rms_norm_silu_bf16(xs, gamma.data_ptr<float>(), os, static_cast<int>(c), silu,
                                     static_cast<float>(eps), c10::cuda::getCurrentCUDAStream().stream()));
}

// out[m, 2i + a, 2j + c] = y[m, i + a, j + c, 2a + c]: interleave the four sub-pixel phases.
void subpixel_scatter(const at::Tensor& y, at::Tensor& out) {
  check_dtype(y, at::kBFloat16, "y");
  check_dtype(out, at::kBFloat16, "out");
  TORCH_CHECK(y.dim() == 5 && y.size(3) == 4, "y must be a [M, Hi - 1, W + 1, 4, Co] tensor; got ", y.sizes());
  check_contiguous(y, "y", "[M, Hi - 1, W + 1, 4, Co]");
  const int64_t m = y.size(0), hi = y.size(1) + 1, w = y.size(2) - 1, co = y.size(4);
  TORCH_CHECK(co % 8 == 0, "subpixel_scatter's channels must be a multiple of 8 (16-byte vectors); got y ", y.sizes());
  const std::array<int64_t, 4> expected{m, 2 * (hi - 2), 2 * w, co};
  TORCH_CHECK(out.dim() == 4 && out.sizes() == at::IntArrayRef(expected), "out must be ", at::IntArrayRef(expected),
              "; got ", out.sizes());
  TORCH_CHECK(out.stride(3) == 1 && out.stride(2) == co && out.stride(1) == 2 * w * co,
              "out's rows, width and channels must be packed; got strides ", out.strides());
  check_vector_layout(out, "out");
  check_cuda({{&y, "y"}, {&out, "out"}});
  const c10::cuda::CUDAGuard guard(y.device());
  raise_if(wan22::subpixel_scatter_bf16(y.data_ptr(), out.data_ptr(), m, static_cast<int>(hi), static_cast<int>(w),
                                        static_cast<int>(co), m > 1 ? out.stride(0) : 0,
                                        c10::cuda::getCurrentCUDAStream().stream()));
}

// A [frames, rows, width, channels] bf16 CUDA tensor with unit channel stride as Pixels (other strides free).
// A [frames, rows, width, channels] bf16 tensor with unit channel stride as Pixels (other strides free, but multiples
// of 16 bytes; a dim of size 1 gets stride 0: it is never stepped over).
wan22::Pixels to_pixels(const at::Tensor& t, const char* name) {
  check_dtype(t, at::kBFloat16, name);
  TORCH_CHECK(t.dim() == 4, name, " must be a [frames, rows, width, channels] tensor; got sizes ", t.sizes());
  TORCH_CHECK(t.size(3) % 8 == 0, name, "'s channels must be a multiple of 8 (16-byte vectors); got ", t.sizes());
  check_vector_layout(t, name);
  wan22::Pixels p;
  p.data = t.data_ptr();
  p.frames = t.size(0); p.rows = t.size(1); p.width = t.size(2); p.channels = t.size(3);
  for (int i = 0; i < 3; ++i) p.stride[i] = t.size(i) == 1 ? 0 : t.stride(i);
  return p;
}

// Winograd F(2x2, 3x3), step 1: v = B^T d B of every tile of x (rows include the halo rows; width zero-padded).
void winograd_input_transform(const at::Tensor& x, at::Tensor& v) {
  const wan22::Pixels xs = to_pixels(x, "x");
  check_dtype(v, at::kBFloat16, "v");
  TORCH_CHECK(xs.rows >= 3, "x needs at least 3 rows (one output row and its halo rows); got ", x.sizes());
  const int64_t tiles = static_cast<int64_t>((xs.rows - 1) / 2) * ((xs.width + 1) / 2);
  const std::array<int64_t, 4> expected{16, xs.frames, tiles, xs.channels};
  TORCH_CHECK(v.sizes() == at::IntArrayRef(expected), "v must be a contiguous ", at::IntArrayRef(expected),
              " tensor for x ", x.sizes(), "; got ", v.sizes());
  check_contiguous(v, "v", "[16, frames, tiles, channels]");
  check_cuda({{&x, "x"}, {&v, "v"}});
  const c10::cuda::CUDAGuard guard(x.device());
  raise_if(wan22::winograd_input_transform_bf16(xs, v.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()));
}

// Step 2: m = sum over taps t of v[:, t : t + to] @ u[t]^T per component, bf16 operands, fp32 accumulation.
void winograd_products(const at::Tensor& v, const at::Tensor& u, at::Tensor& m) {
  check_dtype(v, at::kBFloat16, "v");
  check_dtype(u, at::kBFloat16, "u");
  check_dtype(m, at::kFloat, "m");
  TORCH_CHECK(v.dim() == 4 && v.size(0) == 16, "v must be a [16, Ti, tiles, Ci] tensor; got ", v.sizes());
  TORCH_CHECK(u.dim() == 4 && u.size(1) == 16 && u.size(3) == v.size(3), "u must be a [kt, 16, Co, ", v.size(3),
              "] tensor; got ", u.sizes());
  TORCH_CHECK(v.size(3) % 8 == 0 && u.size(2) % 8 == 0, "winograd_products' channel counts must be multiples of 8 "
              "(16-byte rows); got v ", v.sizes(), " and u ", u.sizes());
  TORCH_CHECK(u.size(0) <= v.size(1), "u has ", u.size(0), " time taps but v only ", v.size(1), " frames");
  const std::array<int64_t, 4> expected{16, v.size(1) - u.size(0) + 1, v.size(2), u.size(2)};
  TORCH_CHECK(m.sizes() == at::IntArrayRef(expected), "m must be a contiguous ", at::IntArrayRef(expected),
              " tensor for v ", v.sizes(), " and u ", u.sizes(), "; got ", m.sizes());
  check_contiguous(v, "v", "[16, Ti, tiles, Ci]");
  check_contiguous(u, "u", "[kt, 16, Co, Ci]");
  check_contiguous(m, "m", "float32 [16, To, tiles, Co]");
  check_cuda({{&v, "v"}, {&u, "u"}, {&m, "m"}});
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

// Host only, no tensor and no GPU: whether the compiled batched GEMMs take the products of v [16, Ti, tiles, Ci] and
// u [kt, 16, Co, Ci] (None, else the reason): winograd_products_bf16's checks on the shape, CUTLASS's can_implement of
// every tap's GEMM included.
std::optional<std::string> winograd_products_can_implement(std::vector<int64_t> v_sizes,
                                                            std::vector<int64_t> u_sizes) {
  TORCH_CHECK(v_sizes.size() == 4 && u_sizes.size() == 4 && v_sizes[0] == 16 && u_sizes[1] == 16 &&
                  u_sizes[3] == v_sizes[3],
              "expected v_sizes [16, Ti, tiles, Ci] and u_sizes [kt, 16, Co, Ci]");
  wan22::WinogradProductsArgs a;
  a.ti = to_int(v_sizes[1], "Ti"); a.tiles = to_int(v_sizes[2], "tiles"); a.ci = to_int(v_sizes[3], "Ci");
  a.kt = to_int(u_sizes[0], "kt"); a.co = to_int(u_sizes[2], "Co");
  const char* error = wan22::winograd_products_can_implement(a);
  return error == nullptr ? std::nullopt : std::optional<std::string>(error);
}

// Step 3: out = A^T m A of every tile + b (+ residual), cropped to out's rows and width.
void winograd_output_transform(const at::Tensor& m, const at::Tensor& b, at::Tensor& out,
                               const std::optional<at::Tensor>& residual) {
  const wan22::Pixels os = to_pixels(out, "out");
  check_dtype(m, at::kFloat, "m");
  const int64_t tiles = static_cast<int64_t>((os.rows + 1) / 2) * ((os.width + 1) / 2);
  const std::array<int64_t, 4> expected{16, os.frames, tiles, os.channels};
  TORCH_CHECK(m.sizes() == at::IntArrayRef(expected), "m must be a contiguous ", at::IntArrayRef(expected),
              " tensor for out ", out.sizes(), "; got ", m.sizes());
  check_contiguous(m, "m", "float32 [16, frames, tiles, channels]");
  TORCH_CHECK(b.scalar_type() == at::kFloat && b.dim() == 1 && b.size(0) == os.channels, "b must be a float32 [",
              os.channels, "] tensor; got ", b.scalar_type(), " ", b.sizes());
  check_contiguous(b, "b", "float32 [Co]");
  wan22::Pixels rs;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == out.sizes(), "residual must have out's shape ", out.sizes(), "; got ",
                residual->sizes());
    rs = to_pixels(*residual, "residual");
    check_cuda({{&out, "out"}, {&m, "m"}, {&b, "b"}, {&*residual, "residual"}});
  } else {
    check_cuda({{&out, "out"}, {&m, "m"}, {&b, "b"}});
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
  m.def("conv3d_can_implement", &conv3d_can_implement, "host only: None if the compiled conv3d takes this problem "
        "(sizes of x and w, padding), else the reason (CUTLASS's can_implement included)", py::arg("x_sizes"),
        py::arg("w_sizes"), py::arg("pad_lo"), py::arg("pad_hi"));
  m.def("rms_norm_silu", &rms_norm_silu, "fused RMS-norm (fp32 statistics) + optional SiLU, bf16 out", py::arg("x"),
        py::arg("gamma"), py::arg("out"), py::arg("silu") = true, py::arg("eps") = 1e-12);
  m.def("subpixel_scatter", &subpixel_scatter, "interleave the four sub-pixel phases of an upsample conv",
        py::arg("y"), py::arg("out"));
  m.def("winograd_input_transform", &winograd_input_transform, "Winograd F(2x2, 3x3): V = B^T d B per tile, bf16",
        py::arg("x"), py::arg("v"));
  m.def("winograd_products", &winograd_products, "Winograd F(2x2, 3x3): M = sum_t V_t U_t^T per component, fp32",
        py::arg("v"), py::arg("u"), py::arg("m"));
  m.def("winograd_products_can_implement", &winograd_products_can_implement, "host only: None if the compiled GEMMs "
        "take the products of v and u (their sizes), else the reason (CUTLASS's can_implement included)",
        py::arg("v_sizes"), py::arg("u_sizes"));
  m.def("winograd_output_transform", &winograd_output_transform, "Winograd F(2x2, 3x3): out = A^T M A + b "
        "(+ residual), bf16", py::arg("m"), py::arg("b"), py::arg("out"), py::arg("residual") = py::none());
  m.def("arch", []() { return std::string(wan22::compiled_arch()); }, "the GPU architecture this build targets");
}
