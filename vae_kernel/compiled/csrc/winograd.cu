// Winograd F(2x2, 3x3) for the causal (kt, 3, 3) convs, mirroring vae_kernel/portable/winograd.py rounding point for rounding
// point: V = B^T d B and Y = A^T M A are fp32 adds in the portable definition's order (no FMA can form: there are no
// products), V is rounded to bf16 once, the component products are bf16 GEMMs with fp32 accumulation (taps added in
// fp32 through the epilogue's C operand), and Y + bias + residual is rounded to bf16 once, on store.
//
// Layouts (component c = 4 * row + column of the 4x4 transform; P = tiles per frame, row-major over the tile grid):
//   V [16, Ti, P, Ci] bf16,  U [kt, 16, Co, Ci] bf16 (K-major: the TN GEMM's B),  M [16, To, P, Co] fp32.
// Per tap t the 16 GEMMs M[c] (+)= V[c, t : t + To] @ U[t, c]^T are one batched GEMM (L = 16, uniform batch
// strides): the (frame, tile) rows of frames t .. t + To - 1 are contiguous, so the time shift is a pointer offset.
// The caller passes one sample (and one band of tile rows) at a time, so frames of different samples never mix.
//
// The transforms' per-thread work is in winograd_tiles.cuh (host-callable: checked on CPU by the tests).
//
// GEMM schedules (one architecture per build, as conv3d_cutlass.cu):
//   sm_90a:          persistent TMA warp-specialized cooperative WGMMA kernel, 128x256x64 tiles (two consumer
//                    warpgroups of 64x256: 128 accumulator registers per thread), TMA cooperative epilogue.
//   sm_100a/sm_103a: persistent TMA warp-specialized UMMA kernel (1 SM), 128x256x64 tiles, accumulators in tensor
//                    memory, TMA epilogue.
#include "decode_kernels.h"
#include "winograd_tiles.cuh"

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"

namespace wan22 {
namespace {

using namespace cute;

constexpr int kComponents = 16;
constexpr int kThreads = 256;
// The input transform holds 16 input vectors per thread (~100-150 registers): blocks of 4 warps let more warps share
// an SM than blocks of 8 at that register count, without a register cap that spills.
constexpr int kInputThreads = 128;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int tiles_along(int extent) { return (extent + 1) / 2; }

// One thread per (frame, tile, 8 channels) for the input transform, per (frame, tile, 4 channels) for the output
// transform (16 fp32 loads of 16 bytes each); consecutive threads take consecutive channel vectors (coalesced).
__global__ void __launch_bounds__(kInputThreads) winograd_input_kernel(Pixels x, uint4* __restrict__ v, int tiles_w,
                                                                       int tiles, int vecs) {
  const int q = blockIdx.x * blockDim.x + threadIdx.x;
  if (q < tiles * vecs) winograd::input_transform_vec(x, v, blockIdx.y, q / vecs, q % vecs, tiles_w, tiles, vecs);
}

__global__ void __launch_bounds__(kThreads) winograd_output_kernel(const float4* __restrict__ m,
                                                                   const float* __restrict__ bias, Pixels out,
                                                                   Pixels residual, int tiles_w, int tiles, int vecs) {
  const int q = blockIdx.x * blockDim.x + threadIdx.x;
  if (q < tiles * vecs)
    winograd::output_transform_vec(m, bias, out, residual, blockIdx.y, q / vecs, q % vecs, tiles_w, tiles, vecs);
}

bool strides_aligned(const Pixels& t) {
  return aligned16(t.data) && t.stride[0] % 8 == 0 && t.stride[1] % 8 == 0 && t.stride[2] % 8 == 0;
}

const char* launched() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// ------------------------------------------------------------------------------------------------------------------
// Component products: a batched TN GEMM, bf16 operands, fp32 accumulators, D = acc + beta * C in fp32 (C = D).
// ------------------------------------------------------------------------------------------------------------------

using ElementOperand = cutlass::bfloat16_t;
using ElementAcc = float;
using LayoutA = cutlass::layout::RowMajor;     // V rows [M, K]: K (Ci) contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // U [N, K]: K (Ci) contiguous
using LayoutD = cutlass::layout::RowMajor;     // M [M, N]: N (Co) contiguous
constexpr int kAlignOperand = 8;               // 16 bytes of bf16
constexpr int kAlignAcc = 4;                   // 16 bytes of fp32
using FusionOp = cutlass::epilogue::fusion::LinearCombination<ElementAcc, ElementAcc, ElementAcc, ElementAcc>;

#if defined(WAN22_SM90)
using ArchTag = cutlass::arch::Sm90;
using TileShape = Shape<_128, _256, _64>;
using ClusterShape = Shape<_1, _1, _1>;
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#elif defined(WAN22_SM100)
using ArchTag = cutlass::arch::Sm100;
using TileShape = Shape<_128, _256, _64>;  // the MMA tile of one SM
using ClusterShape = Shape<_1, _1, _1>;
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecialized1SmSm100;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized1Sm;
#else
#error "define WAN22_SM90 or WAN22_SM100 (the build does this for the target architecture)"
#endif

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    ArchTag, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
    ElementAcc, LayoutD, kAlignAcc,  // C: the previous taps' sum
    ElementAcc, LayoutD, kAlignAcc,  // D
    EpilogueSchedule, FusionOp>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    ArchTag, cutlass::arch::OpClassTensorOp,
    ElementOperand, LayoutA, kAlignOperand,
    ElementOperand, LayoutB, kAlignOperand,
    ElementAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

// The default tile scheduler of these kernels is the persistent one (one CTA per SM looping over output tiles).
using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                        CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

typename Gemm::Arguments gemm_arguments(const WinogradProductsArgs& a, int tap, int sm_count, int device) {
  const int64_t to = a.ti - a.kt + 1;
  const int m = static_cast<int>(to * a.tiles);
  const auto* v = static_cast<const ElementOperand*>(a.v);
  const auto* u = static_cast<const ElementOperand*>(a.u);
  typename GemmKernel::StrideA stride_a{};
  typename GemmKernel::StrideB stride_b{};
  typename GemmKernel::StrideC stride_c{};
  typename GemmKernel::StrideD stride_d{};
  // (row, unit, component) strides; the unit K (or N) stride is static
  get<0>(stride_a) = a.ci;  // V[c]: (frame, tile) rows of ci
  get<2>(stride_a) = static_cast<int64_t>(a.ti) * a.tiles * a.ci;
  get<0>(stride_b) = a.ci;  // U[t, c]: co rows of ci
  get<2>(stride_b) = static_cast<int64_t>(a.co) * a.ci;
  get<0>(stride_d) = a.co;  // M[c]: (frame, tile) rows of co
  get<2>(stride_d) = static_cast<int64_t>(m) * a.co;
  stride_c = stride_d;

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = sm_count;
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kBatched,
      {m, a.co, a.ci, kComponents},
      {v + static_cast<int64_t>(tap) * a.tiles * a.ci, stride_a,       // frames tap .. tap + To - 1
       u + static_cast<int64_t>(tap) * kComponents * a.co * a.ci, stride_b},
      {{}, a.m, stride_c, a.m, stride_d},
      hw_info};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = tap == 0 ? 0.0f : 1.0f;  // beta = 0: C is not read
  return args;
}

// The current device and its SM count: the persistent scheduler sizes its grid to it.
bool query_device(int& device, int& sm_count) {
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device) == cudaSuccess;
}

}  // namespace

const char* winograd_input_transform_bf16(const Pixels& x, void* v, cudaStream_t stream) {
  if (x.channels % 8 != 0) return "winograd_input_transform: channels must be a multiple of 8";
  if (!strides_aligned(x) || !aligned16(v))
    return "winograd_input_transform: tensors and strides must be 16-byte aligned";
  if (x.rows < 3 || x.width < 1 || x.frames < 1) return "winograd_input_transform: needs at least one output row";
  if (x.frames > 65535) return "winograd_input_transform: at most 65535 frames";
  const int tiles_w = tiles_along(x.width);
  const int64_t tiles = static_cast<int64_t>(tiles_along(x.rows - 2)) * tiles_w;
  const int vecs = x.channels / 8;
  if (tiles * vecs > 0x7fffffff - kInputThreads) return "winograd_input_transform: too many tiles per frame";
  const dim3 grid(static_cast<unsigned>((tiles * vecs + kInputThreads - 1) / kInputThreads),
                  static_cast<unsigned>(x.frames));
  winograd_input_kernel<<<grid, kInputThreads, 0, stream>>>(x, static_cast<uint4*>(v), tiles_w,
                                                            static_cast<int>(tiles), vecs);
  return launched();
}

size_t winograd_products_workspace_size(const WinogradProductsArgs& a) {
  int device = 0, sm_count = 0;
  if (!query_device(device, sm_count)) return 0;  // the launch reports the failure
  return Gemm::get_workspace_size(gemm_arguments(a, 0, sm_count, device));
}

const char* winograd_products_can_implement(const WinogradProductsArgs& a) {
  if (a.ci % 8 != 0 || a.co % 8 != 0) return "winograd_products: channel counts must be multiples of 8";
  if (a.kt < 1 || a.ti < a.kt || a.tiles < 1) return "winograd_products: empty problem";
  if (static_cast<int64_t>(a.ti - a.kt + 1) * a.tiles > 0x7fffffff) return "winograd_products: too many rows";
  // The largest strides of the TMA descriptors (V's and M's component strides) stay below 2^40 bytes.
  constexpr int64_t kMaxStrideBytes = int64_t(1) << 40;
  if (int64_t(a.ti) * a.tiles * a.ci * 2 >= kMaxStrideBytes ||
      int64_t(a.ti - a.kt + 1) * a.tiles * a.co * 4 >= kMaxStrideBytes)
    return "winograd_products: too large for a TMA descriptor (a stride of 2^40 bytes or more)";
  for (int tap = 0; tap < a.kt; ++tap)  // the arguments of the taps differ in pointers and beta, checked alike
    if (Gemm::can_implement(gemm_arguments(a, tap, 0, 0)) != cutlass::Status::kSuccess)
      return "winograd_products: CUTLASS cannot implement this problem";
  return nullptr;
}

const char* winograd_products_bf16(const WinogradProductsArgs& a, void* workspace, cudaStream_t stream) {
  if (const char* error = winograd_products_can_implement(a)) return error;
  // Every tap's operands (V and U offset by whole 16-byte rows) are then aligned too: the TMA descriptors' rule,
  // which CUTLASS's encode checks only by assert() (removed in the release build).
  if (!aligned16(a.v) || !aligned16(a.u) || !aligned16(a.m))
    return "winograd_products: tensors must be 16-byte aligned";
  int device = 0, sm_count = 0;
  if (!query_device(device, sm_count)) return "winograd_products: cannot query the current device";
  Gemm gemm;
  for (int tap = 0; tap < a.kt; ++tap) {  // the taps accumulate in fp32 through C = D
    if (gemm.initialize(gemm_arguments(a, tap, sm_count, device), workspace, stream) != cutlass::Status::kSuccess)
      return "winograd_products: CUTLASS initialize failed";
    if (gemm.run(stream) != cutlass::Status::kSuccess) return "winograd_products: CUTLASS kernel launch failed";
  }
  return nullptr;
}

const char* winograd_output_transform_bf16(const float* m, const float* bias, const Pixels& out,
                                           const Pixels& residual, cudaStream_t stream) {
  if (out.channels % 8 != 0) return "winograd_output_transform: channels must be a multiple of 8";
  if (!aligned16(m) || !strides_aligned(out) || (residual.data != nullptr && !strides_aligned(residual)))
    return "winograd_output_transform: tensors and strides must be 16-byte aligned";
  if (out.rows < 1 || out.width < 1 || out.frames < 1) return nullptr;
  if (out.frames > 65535) return "winograd_output_transform: at most 65535 frames";
  const int tiles_w = tiles_along(out.width);
  const int64_t tiles = static_cast<int64_t>(tiles_along(out.rows)) * tiles_w;
  const int vecs = out.channels / 4;
  if (tiles * vecs > 0x7fffffff - kThreads) return "winograd_output_transform: too many tiles per frame";
  const dim3 grid(static_cast<unsigned>((tiles * vecs + kThreads - 1) / kThreads), static_cast<unsigned>(out.frames));
  winograd_output_kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<const float4*>(m), bias, out, residual,
                                                        tiles_w, static_cast<int>(tiles), vecs);
  return launched();
}

}  // namespace wan22
