// Which COD attention kernels run: the one place that decides (plain C++, no CUDA header, so the
// CPU build compiles it and a CPU test checks every choice through peagle_ext._C).
//
// Two kernel families compute the same function (docs/design.md section 3):
//  * kHopper: the forward, dQ and dK/dV passes on sm_90a warpgroup MMAs (wgmma), software-pipelined
//    as FlashAttention-3 does. They exist only as sm_90a code, which runs on compute capability 9.0
//    alone, and only when the build compiled them (90 among PEAGLE_CUDA_ARCHS).
//  * kPortable: the mma.sync m16n8k16 kernels, for every compute capability from 8.0 on (Ampere,
//    Ada, Hopper without sm_90a code, Blackwell and later through their SASS or the PTX).
// On an H200 the Hopper kernels are 1.9-2.1x faster forward and 1.7-2.1x backward at head dim 128
// (2.7-3.1x / 1.6-2.1x at 64); at head dim 128 both give the same bits (bench/RESULTS.md).
//
// One debug override, PEAGLE_ATTN_KERNEL: unset, "" or "auto" = the choice below; "portable" forces
// the mma.sync kernels (the GPU tests use it on an H200 to test what Blackwell runs).
#pragma once
#include <cstring>

namespace peagle::attention {

enum class AttnKernelFamily : int { kUnsupported = 0, kPortable = 1, kHopper = 2 };

enum class AttnKernelOverride : int { kAuto = 0, kPortable = 1 };

constexpr const char* kAttnKernelEnv = "PEAGLE_ATTN_KERNEL";

// nullptr, "" or "auto" -> kAuto; "portable" -> kPortable; false (out untouched) for anything else.
inline bool parse_attn_kernel_override(const char* value, AttnKernelOverride& out) {
  if (value == nullptr || value[0] == '\0' || std::strcmp(value, "auto") == 0) {
    out = AttnKernelOverride::kAuto;
    return true;
  }
  if (std::strcmp(value, "portable") == 0) {
    out = AttnKernelOverride::kPortable;
    return true;
  }
  return false;
}

// Tile shapes of the chosen kernels. The CUDA kernels take their shapes from these functions, so
// the choice reported here is the one that runs.
struct AttnKernelConfig {
  AttnKernelFamily family;
  int fwd_block_q;  // query rows per forward CTA
  int dq_block_q;   // query rows per dQ CTA
  int dkv_block_k;  // keys per dK/dV CTA
  int dkv_block_q;  // query rows per dK/dV step
};

// The mma.sync forward: 16 query rows per warp; 8 warps at head dim 64, 4 at 128 (4 measured
// 1.04-1.19x faster than 8 at 128 on an H200). Its dK/dV pass: 64 query rows per step at 64, 32 at
// 128 (64 would exceed 255 registers).
constexpr int portable_fwd_warps(int head_dim) { return head_dim == 64 ? 8 : 4; }
constexpr int portable_dkv_block_q(int head_dim) { return head_dim == 64 ? 64 : 32; }
constexpr int kPortableDqWarps = 4;
constexpr int kKeyBlock = 64;      // keys per block in every kernel
constexpr int kHopperBlockQ = 64;  // the m64 of the warpgroup MMA: every Hopper CTA's query rows

constexpr bool attn_head_dim_supported(int head_dim) { return head_dim == 64 || head_dim == 128; }

// cc_major.cc_minor: the device's compute capability; build_has_sm90a: the build compiled the
// Hopper kernels. kUnsupported: no kernel of this build can run (head dim, or a GPU before 8.0).
constexpr AttnKernelConfig choose_attn_kernel(int cc_major, int cc_minor, int head_dim, bool build_has_sm90a,
                                              AttnKernelOverride override_choice) {
  if (!attn_head_dim_supported(head_dim) || cc_major < 8) return {AttnKernelFamily::kUnsupported, 0, 0, 0, 0};
  if (override_choice == AttnKernelOverride::kAuto && cc_major == 9 && cc_minor == 0 && build_has_sm90a)
    return {AttnKernelFamily::kHopper, kHopperBlockQ, kHopperBlockQ, kKeyBlock, kHopperBlockQ};
  return {AttnKernelFamily::kPortable, 16 * portable_fwd_warps(head_dim), 16 * kPortableDqWarps, kKeyBlock,
          portable_dkv_block_q(head_dim)};
}

inline const char* attn_kernel_family_name(AttnKernelFamily f) {
  switch (f) {
    case AttnKernelFamily::kHopper:
      return "hopper";
    case AttnKernelFamily::kPortable:
      return "portable";
    default:
      return "unsupported";
  }
}

}  // namespace peagle::attention
