// Which GPUs a build's kernels run on (plain C++, no CUDA header: the CPU build compiles it and a
// CPU test checks it through peagle_ext._C). The archs come from CMake as comma lists: SASS
// ("80,90,90a,100,120") and PTX ("120").
//  * SASS for sm_XY runs on compute capability X.Z with Z >= Y (same major); an arch-specific
//    "XYa" image (the Hopper wgmma kernels) runs on X.Y only and never stands in for the others.
//  * PTX for compute_XY is compiled by the driver for any compute capability >= X.Y.
// A GPU that neither covers gets a sentence naming its arch and the rebuild, instead of
// cudaErrorNoKernelImageForDevice at the first launch.
#pragma once
#include <cstdlib>
#include <string>

namespace peagle {

// Calls f(arch number, arch-specific suffix present) for every entry of a comma list.
template <typename F>
void for_each_arch(const char* csv, F&& f) {
  const char* p = csv;
  while (p != nullptr && *p != '\0') {
    char* end = nullptr;
    const long v = std::strtol(p, &end, 10);
    if (end == p) break;
    const bool specific = *end == 'a' || *end == 'f';
    while (*end != '\0' && *end != ',') ++end;
    f(static_cast<int>(v), specific);
    p = *end == ',' ? end + 1 : end;
  }
}

inline bool has_kernel_image(int cc_major, int cc_minor, const char* sass_csv, const char* ptx_csv) {
  const int cc = 10 * cc_major + cc_minor;
  bool ok = false;
  for_each_arch(sass_csv, [&](int arch, bool specific) {
    if (!specific && arch / 10 == cc_major && arch % 10 <= cc_minor) ok = true;
  });
  for_each_arch(ptx_csv, [&](int arch, bool) {
    if (arch <= cc) ok = true;
  });
  return ok;
}

// "" when the build runs on this compute capability, else the sentence to raise.
inline std::string missing_kernel_image_message(const char* op, int cc_major, int cc_minor, const char* sass_csv,
                                                const char* ptx_csv) {
  if (has_kernel_image(cc_major, cc_minor, sass_csv, ptx_csv)) return "";
  const std::string arch = std::to_string(10 * cc_major + cc_minor);
  std::string sass, ptx;
  for_each_arch(sass_csv, [&](int a, bool specific) {
    sass += (sass.empty() ? "sm_" : ", sm_") + std::to_string(a) + (specific ? "a" : "");
  });
  for_each_arch(ptx_csv, [&](int a, bool) { ptx += (ptx.empty() ? "compute_" : ", compute_") + std::to_string(a); });
  return std::string(op) + ": this peagle_ext build has no CUDA kernels for this GPU (compute capability " +
         std::to_string(cc_major) + "." + std::to_string(cc_minor) + ", sm_" + arch + "); it holds SASS for " +
         (sass.empty() ? "no arch" : sass) + " and PTX for " + (ptx.empty() ? "no arch" : ptx) +
         ". Rebuild it for this GPU: PEAGLE_CUDA_ARCHS=\"" + arch + "\" pip install --no-build-isolation . (or add " +
         arch + " to the list you build for)";
}

}  // namespace peagle
