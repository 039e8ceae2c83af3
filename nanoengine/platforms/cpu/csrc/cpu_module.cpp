// The extension's Python module: every kernel of csrc/, and which vector section (cpu_vec.h) the build took.
#include <torch/extension.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto release = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, release);
  m.def("prefill_attention", &prefill_attention, release);
  m.def("rms_norm", &rms_norm, release);
  m.def("add_rms_norm", &add_rms_norm, release);
  m.def("silu_and_mul", &silu_and_mul, release);
  m.def("rotary", &rotary, release);
  m.def("store_kv", &store_kv, release);
  m.def("argmax", &argmax, release);
  m.def("linear_dtypes", &linear_dtypes);
  m.def("linear", &linear, release);
  m.def("decoder_layers", &decoder_layers, release);
  m.def("vector_isa", [] { return std::string(kVectorIsa); });
}
