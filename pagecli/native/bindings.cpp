// The Python module of pagecli's CPU kernels: every entry point of the files beside this one, bound
// once (built by pagecli.native as one extension, one build per instruction-set level).

#include <torch/extension.h>

#include "float_panels.h"
#include "cpu_ops.h"
#include "decode_step.h"
#include "gemm_bf16.h"
#include "lora_add.h"
#include "quant_int4.h"
#include "quant_int8.h"
#include "read_probe.h"
#include "simd.h"
#include "weight_memory.h"
#include "work_share.h"

#include <memory>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &pagecli::paged_decode_attention, "Paged decode attention, one query token per sequence");
  m.def("paged_decode_bf16_supported", &pagecli::paged_decode_bf16_supported,
        "Whether paged_decode_attention runs such query and cache on AVX512-BF16 dot products");
  m.def("decode_task_split", &pagecli::decode_task_split, "How paged_decode_attention splits a step: (h0, s_begin, s_end, shared) per task");
  m.def("store_kv_quantized", &pagecli::store_kv_quantized,
        "K or V rows into the slots of an int8/fp8 cache, as kv_format.quantize_rows writes them");
  m.def("paged_prefill_attention", &pagecli::paged_prefill_attention, "Causal paged attention for prefilling sequences (AMX, bf16)");
  m.def("paged_prefill_supported", &pagecli::paged_prefill_supported, "Whether paged_prefill_attention takes such query and cache");
  m.def("linear_bf16_rows", &pagecli::linear_bf16_rows, "bf16 linear for a few rows (AVX512-BF16)");
  m.def("add_rms_norm", &pagecli::add_rms_norm, "h += delta (optional), then weight * rms_norm(h)");
  m.def("rotary_", &pagecli::rotary_, "Rotary embedding in place (rotate-half layout)");
  m.def("silu_mul", &pagecli::silu_mul, "silu(gate) * up from a fused gate_up output");
  m.def("weight_zeros", [](std::vector<int64_t> sizes, at::ScalarType dtype) { return pagecli::weight_zeros(sizes, dtype); },
        "A zero-filled tensor in the packed weights' memory (2 MB pages where Linux gives them)");
  m.def("weight_copy", &pagecli::weight_copy, "A contiguous copy of a CPU tensor in the packed weights' memory");
  m.def("greedy_tokens", &pagecli::greedy_tokens, "Each row's first index of its largest logit (torch.max's)");
  m.def("sample_rows", &pagecli::sample_rows,
        "One token per row drawn after temperature, top-k, top-p and min-p, without a sort (-1: none possible)");
  m.def("has_bf16_linear", &pagecli::has_bf16_linear, "Whether linear_bf16_rows was built");
  m.def("linear", &pagecli::native_linear, "x @ w^T (+ bias): AMX tiles, the bf16 rows kernel or at::linear, by shape");
  m.def("has_amx", &pagecli::has_amx, "Whether linear_bf16_amx was built and the OS grants AMX tiles");
  m.def("pack_bf16_weights", &pagecli::pack_bf16_weights, "w [N, K] bf16 -> the panels linear_bf16_packed reads");
  m.def("linear_bf16_packed", &pagecli::linear_bf16_packed, "x @ w^T (+ bias) over pack_bf16_weights(w), any rows");
  m.def("has_packed_linear", &pagecli::has_packed_linear, "Whether pack_bf16_weights/linear_bf16_packed were built");
  m.def("gather_packed_rows", &pagecli::gather_packed_rows, "w[ids] read back from pack_bf16_weights(w)");
  // module_local (here and for DecodeStep): each level's build is a separate module in one process
  // (tests load several), and pybind11 would otherwise register the same C++ types twice.
  pybind11::class_<pagecli::PackedProduct, std::shared_ptr<pagecli::PackedProduct>>(m, "PackedProduct",
                                                                                  pybind11::module_local())
      .def("forward", &pagecli::PackedProduct::forward, "x [..., K] -> x @ w^T (+ bias) [..., N]")
      .def("forward_choosing", &pagecli::PackedProduct::forward_choosing,
           "x [M, K] -> (forward(x) [M, N], each row's greedy choice int64 [M] taken as the tiles are stored, or "
           "None where the kernel does not take them)");
  pybind11::class_<pagecli::PackedLinear, pagecli::PackedProduct, std::shared_ptr<pagecli::PackedLinear>>(
      m, "PackedLinear", pybind11::module_local())
      .def(pybind11::init<const torch::Tensor&, const c10::optional<torch::Tensor>&>(), pybind11::arg("weight"),
           pybind11::arg("bias") = pybind11::none())
      .def("rows", &pagecli::PackedLinear::rows, "w[ids] [..., K], read from the panels")
      .def_property_readonly("panels", &pagecli::PackedLinear::panels)
      .def_property_readonly("out_features", &pagecli::PackedLinear::out_features)
      .def_property_readonly("in_features", &pagecli::PackedLinear::in_features);
  pybind11::class_<pagecli::F32PanelLinear, pagecli::PackedProduct, std::shared_ptr<pagecli::F32PanelLinear>>(
      m, "F32PanelLinear", pybind11::module_local())
      .def(pybind11::init<const torch::Tensor&, const c10::optional<torch::Tensor>&>(), pybind11::arg("weight"),
           pybind11::arg("bias") = pybind11::none())
      .def("rows", &pagecli::F32PanelLinear::rows, "w[ids] [..., K] float32, read from the panels")
      .def_property_readonly("panels", &pagecli::F32PanelLinear::panels)
      .def_property_readonly("out_features", &pagecli::F32PanelLinear::out_features)
      .def_property_readonly("in_features", &pagecli::F32PanelLinear::in_features);
  m.def("bf16_exact", &pagecli::bf16_exact, "Whether every value of a float32 tensor is a bfloat16");
  m.def("has_bf16_weight_linear", &pagecli::has_bf16_weight_linear,
        "Whether F32PanelLinear was built (AVX2 and FMA)");
  pybind11::class_<pagecli::PackedLinearInt8, pagecli::PackedProduct, std::shared_ptr<pagecli::PackedLinearInt8>>(
      m, "PackedLinearInt8", pybind11::module_local())
      .def(pybind11::init<const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&, bool>(),
           pybind11::arg("q"), pybind11::arg("scale"), pybind11::arg("bias") = pybind11::none(),
           pybind11::arg("int16_activations") = false)
      .def_property_readonly("weights", &pagecli::PackedLinearInt8::weights)
      .def_property_readonly("scales", &pagecli::PackedLinearInt8::scales)
      .def_property_readonly("kind", &pagecli::PackedLinearInt8::kind)
      .def_property_readonly("out_features", &pagecli::PackedLinearInt8::out_features)
      .def_property_readonly("in_features", &pagecli::PackedLinearInt8::in_features);
  pybind11::class_<pagecli::PackedLinearInt4, pagecli::PackedProduct, std::shared_ptr<pagecli::PackedLinearInt4>>(
      m, "PackedLinearInt4", pybind11::module_local())
      .def(pybind11::init<const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          const c10::optional<torch::Tensor>&, bool>(),
           pybind11::arg("q"), pybind11::arg("scale"), pybind11::arg("min"), pybind11::arg("bias") = pybind11::none(),
           pybind11::arg("int16_activations") = false)
      .def_property_readonly("weights", &pagecli::PackedLinearInt4::weights)
      .def_property_readonly("kind", &pagecli::PackedLinearInt4::kind)
      .def_property_readonly("scales", &pagecli::PackedLinearInt4::scales)
      .def_property_readonly("out_features", &pagecli::PackedLinearInt4::out_features)
      .def_property_readonly("in_features", &pagecli::PackedLinearInt4::in_features);
  m.def("int4_linear_kind", &pagecli::int4_linear_kind, "Which int4 kernel this build runs: avx512_vnni, avx2 or ''");
  m.def("read_probe", &pagecli::read_probe,
        "Reads a buffer once on every thread (the read bandwidth's probe); returns the XOR of its 64-bit words");
  m.def("shared_work_takers", &pagecli::shared_work_takers,
        "Which thread's share took each unit when the owner of one share starts late (tests of work_share.h)");
  m.def("team_work_takers", &pagecli::team_work_takers,
        "Which team member took each unit of several regions in one run_team; a member may fail (tests of work_share.h)");
  m.def("int8_linear_kind", &pagecli::int8_linear_kind, "Which int8 kernel this build runs: avx512_vnni, avx2 or ''");
#if PAGECLI_HAVE_AMX
  m.def("linear_bf16_amx", &pagecli::linear_bf16_amx, "bf16 linear on AMX tiles (K % 32 == 0, N % 16 == 0)");
#endif
  pybind11::class_<pagecli::MoeExperts, std::shared_ptr<pagecli::MoeExperts>>(m, "MoeExperts", pybind11::module_local())
      .def(pybind11::init<std::shared_ptr<pagecli::PackedProduct>, c10::optional<torch::Tensor>,
                          std::vector<std::shared_ptr<pagecli::PackedProduct>>,
                          std::vector<std::shared_ptr<pagecli::PackedProduct>>, int64_t, bool>(),
           "(router product or None, router weight or None, experts' gate_up products, their down products, "
           "top_k, norm_topk_prob)")
      .def("forward", &pagecli::MoeExperts::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "SparseMoE.forward: x [rows, hidden] -> [rows, hidden]");
  pybind11::class_<pagecli::DecodeStep>(m, "DecodeStep", pybind11::module_local())
      .def(pybind11::init<std::vector<pagecli::DecodeStep::Layer>, std::vector<pagecli::DecodeStep::PackedLayer>, torch::Tensor,
                          torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, double, double, bool,
                          std::vector<std::shared_ptr<pagecli::MoeExperts>>, bool>(),
           pybind11::arg("layers"), pybind11::arg("packed"), pybind11::arg("final_norm"), pybind11::arg("cos"),
           pybind11::arg("sin"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("eps"), pybind11::arg("scale"), pybind11::arg("team"),
           pybind11::arg("moe") = std::vector<std::shared_ptr<pagecli::MoeExperts>>{},
           pybind11::arg("qk_norm_whole") = false)
      .def("runs_as_team", &pagecli::DecodeStep::runs_as_team,
           "Whether a step of this many bf16 rows runs in one team (DecodeStep::forward_team)")
      .def("forward", &pagecli::DecodeStep::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "One decode step through every layer; returns the final norm's output")
      .def("forward_lora", &pagecli::DecodeStep::forward_lora, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "forward() with LoRA adapter rows: (..., LoraStacks, row_slot int64, row_scale float32)");
  pybind11::class_<pagecli::LoraStacks, std::shared_ptr<pagecli::LoraStacks>>(m, "LoraStacks", pybind11::module_local())
      .def(pybind11::init<std::vector<std::vector<c10::optional<torch::Tensor>>>>())
      .def("add", &pagecli::LoraStacks::add, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "out[rows] += the rows' adapters' low-rank product of x (layer, product 0-3, x, out, row_slot, row_scale)");
  m.def("lora_add_", [](torch::Tensor out, const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b,
                         const torch::Tensor& row_slot, const torch::Tensor& row_scale) {
          pagecli::lora_add_(out, x, a, b, row_slot, row_scale);
        }, "out[r] += row_scale[r] * (x[r] @ a[s].T) @ b[s], s = row_slot[r] >= 0 (lora_add.h)");
}
