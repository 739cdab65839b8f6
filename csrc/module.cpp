// Python bindings of kforcing_kernels._C.
#include <torch/extension.h>

#include "kf_kernels.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kforcing_kernels C++ extension: CPU prefix-window attention and the fused inverse-CDF sampler";
  namespace py = pybind11;
  m.def("attention_forward", &kf::attention_forward,
        "Prefix-window attention forward: (out [B, H, Lq, D], lse [B, H, Lq] natural log)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("row_intervals"), py::arg("row_order"),
        py::arg("tile_begin"), py::arg("n_ctx"), py::arg("num_windows"),
        py::arg("window_size"), py::arg("last_window_size"), py::arg("n_streams"), py::arg("queries_all"),
        py::arg("scale"), py::arg("n_rows") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("attention_backward", &kf::attention_backward, "Prefix-window attention backward: (dq, dk, dv)",
        py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
        py::arg("row_intervals"), py::arg("row_order"), py::arg("tile_begin"), py::arg("n_ctx"),
        py::arg("num_windows"), py::arg("window_size"),
        py::arg("last_window_size"), py::arg("n_streams"), py::arg("queries_all"), py::arg("scale"),
        py::arg("n_rows") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention_forward", &kf::paged_attention_forward,
        "Decode attention over a paged KV cache [num_pages, page_size, Hkv, D]: out [B, H, W, D]", py::arg("q"),
        py::arg("k_new"), py::arg("v_new"), py::arg("k_pages"), py::arg("v_pages"), py::arg("block_table"),
        py::arg("context_lens"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("inverse_cdf_sample", &kf::inverse_cdf_sample,
        "min{v : F(v) > z} of softmax(logits / temperature) per row (int64), float64 math, one pass per row",
        py::arg("logits"), py::arg("z"), py::arg("temperature"), py::call_guard<py::gil_scoped_release>());
  m.def("noise_inversion", &kf::noise_inversion,
        "float32 z at fraction u of each token's CDF bin, so that inverse_cdf_sample gives the token back",
        py::arg("logits"), py::arg("tokens"), py::arg("temperature"), py::arg("u"),
        py::call_guard<py::gil_scoped_release>());
  m.def("isa", [] { return std::string(kf::active_kernels().name); }, "Instruction set of the kernels in use");
  m.def("available_isas", [] { return std::string(kf::cpu_isa_list()); },
        "Comma-separated instruction sets this CPU and build support");
  m.def(
      "set_isa",
      [](const std::string& name) {
        const char* err = kf::select_isa(name.c_str());
        if (*err) throw py::value_error(std::string(err) + ", got " + name);
      },
      "Use the kernels built for `name` (generic, avx2, avx512)", py::arg("name"));
}
