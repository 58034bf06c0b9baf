// Every oar operator schema, in one place (docs/architecture.md, layer 2). Implementations register per
// dispatch key: cpu_*.cpp (CPU), cuda_advantages.cpp + cuda_probe.cpp (CUDA). Python wrappers, docs and fake kernels:
// python/oar/ops.py. Plain-PyTorch references: python/oar/reference.py.
#include <torch/library.h>

TORCH_LIBRARY(oar, m) {
  // method.md section 1. rewards (N,) float, offsets (G+1,) int64 CSR -> advantages (N,) float32.
  m.def("group_advantages(Tensor rewards, Tensor offsets, str estimator=\"grpo\", str std=\"unbiased\", "
        "float eps=1e-6, str singleton=\"zero\", bool skip_nan=False) -> Tensor");
  // method.md section 5. scores (B,T) float, mask (B,T) bool -> (B,T) float32 in [0,1].
  m.def("normalize_importance(Tensor scores, Tensor mask) -> Tensor");
  // method.md sections 5-6. -> (token_advantages (B,T) float32, weights (B,T) float32).
  m.def("reshape_advantages(Tensor advantages, Tensor scores, Tensor reasoning_mask, Tensor response_mask, "
        "float q=0.25, float beta=1.0, float floor=0.1, str tiers=\"both\", bool scores_are_normalized=False) "
        "-> (Tensor, Tensor)");
  // method.md section 2. logits (N,S,V) -> (N,) float32.
  m.def("probe_divergence(Tensor clean_logits, Tensor perturbed_logits, Tensor? answer_ids=None, "
        "Tensor? lengths=None, str probe=\"answer_mean\") -> Tensor");
  m.def("probe_divergence_backward(Tensor grad_out, Tensor clean_logits, Tensor perturbed_logits, "
        "Tensor? answer_ids, Tensor? lengths, str probe) -> Tensor");
  // method.md section 4. grad, input (B,L,H) -> (B,L) float32.
  m.def("grad_x_input(Tensor grad, Tensor input) -> Tensor");
  // method.md section 3. input_ids (B,T) int64, row_index (M,), positions (M,) -> (M,T) int64.
  m.def("build_masked_batch(Tensor input_ids, Tensor row_index, Tensor positions, int pad_id) -> Tensor");
  // Process state of the CUDA data checks, not tensor operators (cuda_checks.h; python/oar/cuda_checks.py).
  // No tensor arguments: CompositeExplicitAutograd kernels in cuda_checks.cpp, registered by CUDA builds only.
  // mode "lazy" | "eager" -> the previous mode.
  m.def("_set_cuda_checks(str mode) -> str");
  // -> the current mode; ValueError when OAR_CUDA_CHECKS holds another value and no mode was set.
  m.def("_get_cuda_checks() -> str");
  // -> the error recorded on `device` and not raised yet ("" when none), after the device's current stream.
  m.def("_take_cuda_error(int device) -> str");
}
