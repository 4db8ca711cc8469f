// The Python module peagle_ext._C. Importing it loads this shared library, which registers
// every op with the dispatcher (static initialisers in the TORCH_LIBRARY* blocks). The module
// itself answers build_info(), the COD attention kernel choice (attention_dispatch.h) and the
// no-kernel-image check (common/cuda_archs.h), both plain C++ so a CPU build can check them; ops
// are called through torch.ops.peagle.*.
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "attention/attention_dispatch.h"
#include "common/cuda_archs.h"

namespace py = pybind11;

namespace {

// choose_attn_kernel for explicit inputs: the CUDA glue asks the same function with the current
// device's compute capability, this build's sm_90a flag and PEAGLE_ATTN_KERNEL.
py::dict attention_kernel_choice(int cc_major, int cc_minor, int head_dim, bool build_has_sm90a,
                                 const std::string& override_value) {
  using namespace peagle::attention;
  AttnKernelOverride choice = AttnKernelOverride::kAuto;
  if (!parse_attn_kernel_override(override_value.c_str(), choice))
    throw std::invalid_argument(std::string(kAttnKernelEnv) + "=" + override_value +
                                " is not a kernel choice; use auto (or unset) or portable");
  const AttnKernelConfig c = choose_attn_kernel(cc_major, cc_minor, head_dim, build_has_sm90a, choice);
  py::dict d;
  d["family"] = std::string(attn_kernel_family_name(c.family));
  d["fwd_block_q"] = c.fwd_block_q;
  d["dq_block_q"] = c.dq_block_q;
  d["dkv_block_k"] = c.dkv_block_k;
  d["dkv_block_q"] = c.dkv_block_q;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "peagle_ext native ops (registered under torch.ops.peagle)";
  m.def("build_info", []() {
    py::dict d;
    d["backends"] = std::string(PEAGLE_BACKENDS);
    d["cuda_archs"] = std::string(PEAGLE_CUDA_ARCHS);
    d["cuda_sass_archs"] = std::string(PEAGLE_CUDA_SASS_ARCHS);
    d["cuda_ptx_archs"] = std::string(PEAGLE_CUDA_PTX_ARCHS);
    d["hopper_kernels"] = PEAGLE_HOPPER_KERNELS != 0;
    d["torch_version"] = std::string(PEAGLE_TORCH_VERSION);
    d["cuda_version"] = std::string(PEAGLE_CUDA_VERSION);
#if defined(__clang__)
    d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    d["compiler"] = std::string("gcc ") + __VERSION__;
#endif
    return d;
  });
  m.def("attention_kernel_choice", &attention_kernel_choice, py::arg("cc_major"), py::arg("cc_minor"),
        py::arg("head_dim"), py::arg("build_has_sm90a"), py::arg("override") = "",
        "The COD attention kernel family and tile shapes for a device / build / PEAGLE_ATTN_KERNEL value");
  m.def(
      "missing_kernel_image_message",
      [](int cc_major, int cc_minor, const std::string& sass, const std::string& ptx) {
        return peagle::missing_kernel_image_message("peagle_ext", cc_major, cc_minor, sass.c_str(), ptx.c_str());
      },
      py::arg("cc_major"), py::arg("cc_minor"), py::arg("sass") = std::string(PEAGLE_CUDA_SASS_ARCHS),
      py::arg("ptx") = std::string(PEAGLE_CUDA_PTX_ARCHS),
      "The CUDA ops' error for a GPU without a kernel image in a build of these archs ('' if it has one)");
}
