// Implicit-GEMM 3D convolution (fprop) in bf16 with fp32 accumulation, bias and residual in the epilogue:
// CUTLASS 3.x CollectiveBuilder -> ConvUniversal -> ConvUniversalAdapter on channels-last tensors.
// The build compiles this file for exactly one architecture (WAN22_SM90 or WAN22_SM100 is defined by the build):
//   sm_90a:          TMA + warp-specialized WGMMA mainloop (KernelImplicitTmaWarpSpecializedSm90; the persistent
//                    cooperative / ping-pong schedules do not exist for conv), TMA warp-specialized epilogue.
//   sm_100a/sm_103a: TMA + UMMA (tcgen05) mainloop with tensor-memory accumulators, auto-selected epilogue.
// GEMM view of fprop: M = output positions (q, p, z, n), N = output channels k, K = filter taps (c, s, r, t).
#include "decode_kernels.h"

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/conv/convolution.h"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/dispatch_policy.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"

namespace wan22 {
namespace {

using namespace cute;

using ElementAct = cutlass::bfloat16_t;
using ElementOut = cutlass::bfloat16_t;
using ElementAcc = float;
using ElementCompute = float;
using ElementBias = float;
using Layout = cutlass::layout::TensorNDHWC;
constexpr int kAlign = 8;  // 16 bytes of bf16
constexpr cutlass::conv::Operator kFprop = cutlass::conv::Operator::kFprop;

// out = 1 * acc + beta * residual + bias[k]; beta is 0 without a residual (the source is then not read).
using FusionOp = cutlass::epilogue::fusion::LinCombPerColBias<ElementOut, ElementCompute, ElementBias, ElementOut,
                                                              ElementCompute>;

#if defined(WAN22_SM90)
using ArchTag = cutlass::arch::Sm90;
using TileShape = Shape<_128, _128, Shape<_64>>;  // 128x256 spills registers on sm_90 (measured)
using ClusterShape = Shape<_1, _1, _1>;
using MainloopSchedule = cutlass::conv::KernelImplicitTmaWarpSpecializedSm90;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
#elif defined(WAN22_SM100)
using ArchTag = cutlass::arch::Sm100;
using TileShape = Shape<_128, _128, Shape<_64>>;
using ClusterShape = Shape<_1, _1, _1>;
using MainloopSchedule = cutlass::conv::collective::KernelScheduleAuto;
using EpilogueSchedule = cutlass::epilogue::collective::EpilogueScheduleAuto;
#else
#error "define WAN22_SM90 or WAN22_SM100 (the build does this for the target architecture)"
#endif

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    ArchTag, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementCompute,
    ElementOut, Layout, kAlign,  // source C (the residual)
    ElementOut, Layout, kAlign,  // destination D
    EpilogueSchedule, FusionOp>::CollectiveOp;

using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
    ArchTag, cutlass::arch::OpClassTensorOp, kFprop,
    ElementAct, Layout, kAlign,
    ElementAct, Layout, kAlign,
    ElementAcc, TileShape, ClusterShape,
    cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    MainloopSchedule>::CollectiveOp;

using ProblemShape = cutlass::conv::ConvProblemShape<kFprop, CollectiveMainloop::DispatchPolicy::NumSpatialDimensions>;
using ConvKernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Conv = cutlass::conv::device::ConvUniversalAdapter<ConvKernel>;
using StrideC = typename ConvKernel::StrideC;
using StrideD = typename ConvKernel::StrideD;

static_assert(ProblemShape::RankT == 5, "expected a 3D convolution");

typename Conv::Arguments make_arguments(const Conv3dArgs& a) {
  ProblemShape shape(cutlass::conv::Mode::kCrossCorrelation,
                     {a.n, a.d, a.h, a.w, a.c},                        // activation NDHWC
                     {a.k, a.t, a.r, a.s, a.c},                        // filter KTRSC
                     {a.pad_lo[0], a.pad_lo[1], a.pad_lo[2]},          // lower padding (d, h, w)
                     {a.pad_hi[0], a.pad_hi[1], a.pad_hi[2]},          // upper padding
                     {1, 1, 1},                                        // traversal stride
                     {1, 1, 1},                                        // dilation
                     1);                                               // groups
  // Mode 0 of the epilogue strides runs over (q, p, z, n), innermost first; channels (mode 1) are unit stride.
  StrideD stride_d;
  StrideC stride_c;
  cute::for_each(cute::make_seq<cute::rank<0>(StrideD{})>{}, [&](auto i) {
    cute::get<0, i>(stride_d) = a.out_stride[3 - i];
    cute::get<0, i>(stride_c) = a.residual ? a.residual_stride[3 - i] : a.out_stride[3 - i];
  });
  typename Conv::Arguments args{
      shape,
      {static_cast<const ElementAct*>(a.x), static_cast<const ElementAct*>(a.wgt)},
      {{},
       static_cast<const ElementOut*>(a.residual ? a.residual : a.out), stride_c,
       static_cast<ElementOut*>(a.out), stride_d}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = a.residual ? 1.0f : 0.0f;
  args.epilogue.thread.bias_ptr = a.bias;
  return args;
}

}  // namespace

size_t conv3d_workspace_size(const Conv3dArgs& a) { return Conv::get_workspace_size(make_arguments(a)); }

const char* conv3d_can_implement(const Conv3dArgs& a) {
  if (a.c % kAlign != 0 || a.k % kAlign != 0) return "conv3d: channel counts must be multiples of 8";
  if (a.n < 1 || a.z() <= 0 || a.p() <= 0 || a.q() <= 0) return "conv3d: empty output";
  if (Conv::can_implement(make_arguments(a)) != cutlass::Status::kSuccess)
    return "conv3d: CUTLASS cannot implement this problem";
  return nullptr;
}

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The rules of cuTensorMapEncodeIm2col / cuTensorMapEncodeTiled for the descriptors initialize() encodes (x: im2col,
// w, out, residual: tiled): 16-byte aligned addresses, strides that are multiples of 16 bytes and below 2^40 bytes.
// CUTLASS checks the encode's result only by assert(), which the release build (-DNDEBUG) removes: a violation would
// launch with a garbage descriptor and fault the context, so they are checked here instead.
const char* tma_layout_error(const Conv3dArgs& a) {
  if (!aligned16(a.x) || !aligned16(a.wgt) || !aligned16(a.bias) || !aligned16(a.out) ||
      (a.residual != nullptr && !aligned16(a.residual)))
    return "conv3d: x, w, b, out and residual must be 16-byte aligned (TMA descriptors)";
  constexpr int64_t kMaxStrideBytes = int64_t(1) << 40;
  const int64_t x_batch_bytes = int64_t(a.d) * a.h * a.w * a.c * 2;  // the largest of x's packed strides
  const int64_t w_filter_bytes = int64_t(a.t) * a.r * a.s * a.c * 2;
  if (x_batch_bytes >= kMaxStrideBytes || w_filter_bytes >= kMaxStrideBytes)
    return "conv3d: x or w too large for a TMA descriptor (a stride of 2^40 bytes or more)";
  for (int i = 0; i < 4; ++i) {
    if (a.out_stride[i] <= 0 || a.out_stride[i] % kAlign != 0 || a.out_stride[i] * 2 >= kMaxStrideBytes)
      return "conv3d: out's strides must be positive multiples of 8 elements below 2^39 (TMA descriptor)";
    if (a.residual != nullptr &&
        (a.residual_stride[i] <= 0 || a.residual_stride[i] % kAlign != 0 || a.residual_stride[i] * 2 >= kMaxStrideBytes))
      return "conv3d: residual's strides must be positive multiples of 8 elements below 2^39 (TMA descriptor)";
  }
  return nullptr;
}

}  // namespace

const char* conv3d_bf16(const Conv3dArgs& a, void* workspace, cudaStream_t stream) {
  if (const char* error = conv3d_can_implement(a)) return error;
  if (const char* error = tma_layout_error(a)) return error;
  Conv conv;
  if (conv.initialize(make_arguments(a), workspace, stream) != cutlass::Status::kSuccess)
    return "conv3d: CUTLASS initialize failed";
  if (conv.run(stream) != cutlass::Status::kSuccess) return "conv3d: CUTLASS kernel launch failed";
  return nullptr;
}

#define WAN22_STRINGIFY_(x) #x
#define WAN22_STRINGIFY(x) WAN22_STRINGIFY_(x)

const char* compiled_arch() {
  // WAN22_ARCH: the target's compute capability, major x 10 + minor, set by the build from its one table of
  // architectures (vae_kernel/compiled/extension.py, ARCHS); a number, as string macros do not survive the build
  // tool's quoting.
  return "sm_" WAN22_STRINGIFY(WAN22_ARCH) "a";
}

}  // namespace wan22
