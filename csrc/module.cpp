// The Python module peagle_ext._C. Importing it loads this shared library, which registers
// every op with the dispatcher (static initialisers in the TORCH_LIBRARY* blocks). The module
// itself only answers build_info(); ops are called through torch.ops.peagle.*.
#include <pybind11/pybind11.h>

#include <string>

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "peagle_ext native ops (registered under torch.ops.peagle)";
  m.def("build_info", []() {
    py::dict d;
    d["backends"] = std::string(PEAGLE_BACKENDS);
    d["cuda_archs"] = std::string(PEAGLE_CUDA_ARCHS);
    d["torch_version"] = std::string(PEAGLE_TORCH_VERSION);
    d["cuda_version"] = std::string(PEAGLE_CUDA_VERSION);
#if defined(__clang__)
    d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
    d["compiler"] = std::string("gcc ") + __VERSION__;
#endif
    return d;
  });
}
