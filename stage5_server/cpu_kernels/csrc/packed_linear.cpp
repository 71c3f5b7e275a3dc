// oneDNN's GEMM over a weight packed once at load, as an operator a compiled graph can hold.
//
// torch.ops.mkldnn._linear_pointwise multiplies by a weight torch.ops.mkldnn._reorder_linear_weight
// packed; inductor lowers it only for a weight it packed itself while freezing a graph, not for one
// the engine packed at load. This operator is the same call behind a schema of its own (the output's
// width is an argument, so a fake kernel knows the shape without reading the packed weight): inductor
// treats it as opaque and calls it between its generated loops. Registered in C++, the call costs what
// any ATen operator's does; a Python operator (torch.library.custom_op) cost tens of microseconds more
// a call, over a hundred calls a step.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  at::Tensor out = op.call(x, packed_weight, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
  TORCH_CHECK(out.size(-1) == out_features, "packed_linear: the packed weight has ", out.size(-1),
              " output features, not ", out_features);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stagedserve_cpu, m) {
  m.def("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(stagedserve_cpu, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}

TORCH_LIBRARY_IMPL(stagedserve_cpu, MkldnnCPU, m) {  // a packed float32 weight is an MKL-DNN tensor
  m.impl("packed_linear", &packed_linear);
}
