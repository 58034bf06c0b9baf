// See vec_math.h and oar/core/cpu_isa.h. The loop bodies live in vec_math_kernels.inc and are compiled here
// once per ISA level, each copy in its own namespace under its own __attribute__((target(...))): on x86-64
// with GCC/Clang an AVX-512F, an AVX2 and a baseline copy; elsewhere (or with OAR_NO_MULTI_ISA) the
// baseline copy only. A table of function pointers per level is picked when the library is loaded (the best
// level the CPU supports, or OAR_CPU_ISA) and can be switched with set_cpu_isa(), so tests run every copy
// on one machine. (GCC's target_clones, used before, resolves once through an ifunc that nothing can
// override, so only the machine's best path was ever tested.)
#include "vec_math.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "oar/core/common.h"
#include "oar/core/cpu_isa.h"
#include "oar/core/log.h"
#include "widen.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(OAR_NO_MULTI_ISA)
#define OAR_HAS_MULTI_ISA 1
#else
#define OAR_HAS_MULTI_ISA 0
#endif

namespace oar::core {
namespace detail {
namespace {

// The baseline copy: compiled for the build's target (x86-64: SSE2), never with AVX.
namespace isa_baseline {
#define OAR_VEC_TARGET
#include "vec_math_kernels.inc"
#undef OAR_VEC_TARGET
}  // namespace isa_baseline

#if OAR_HAS_MULTI_ISA
// The same target strings as the former target_clones("avx512f", "avx2", "default"): results unchanged.
namespace isa_avx2 {
#define OAR_VEC_TARGET __attribute__((target("avx2")))
#include "vec_math_kernels.inc"
#undef OAR_VEC_TARGET
}  // namespace isa_avx2

namespace isa_avx512f {
#define OAR_VEC_TARGET __attribute__((target("avx512f")))
#include "vec_math_kernels.inc"
#undef OAR_VEC_TARGET
}  // namespace isa_avx512f
#endif

// One entry per loop of vec_math.h (vload_f32 is a memcpy: no copies).
struct Kernels {
  CpuIsa isa;
  float (*vmax)(const float*, int64_t);
  float (*vexp_shifted_sum)(const float*, float, float*, int64_t);
  void (*vexp_shifted_scaled)(const float*, float, float, float*, int64_t);
  float (*vdot)(const float*, const float*, int64_t);
  float (*vdot_diff)(const float*, const float*, const float*, int64_t);
  void (*vlog1p)(const float*, float*, int64_t);
  bool (*vmasked_minmax)(const float*, const bool*, int64_t, float*, float*);
  void (*vdivide_clamp_masked)(float*, const bool*, float, int64_t);
  void (*vshift_scale)(const float*, float, float, float*, int64_t);
  double (*vtier_weights_masked)(const float*, const bool*, const bool*, int64_t, double, double, double, double,
                                 double, float*);
  bool (*vscale_advantages_masked)(float*, const bool*, double, float, float*, int64_t);
  void (*vadd_f32)(const float*, float*, int64_t);
  void (*vload_bf16)(const uint16_t*, float*, int64_t);
  void (*vadd_bf16)(const uint16_t*, float*, int64_t);
  void (*vload_f16)(const uint16_t*, float*, int64_t);
  void (*vadd_f16)(const uint16_t*, float*, int64_t);
};

#define OAR_VEC_TABLE(NS, ISA)                                                                                  \
  Kernels {                                                                                                     \
    ISA, &NS::vmax, &NS::vexp_shifted_sum, &NS::vexp_shifted_scaled, &NS::vdot, &NS::vdot_diff, &NS::vlog1p,    \
        &NS::vmasked_minmax, &NS::vdivide_clamp_masked, &NS::vshift_scale, &NS::vtier_weights_masked,           \
        &NS::vscale_advantages_masked, &NS::vadd_f32, &NS::vload_bf16, &NS::vadd_bf16, &NS::vload_f16,          \
        &NS::vadd_f16                                                                                           \
  }

constexpr Kernels kBaselineKernels = OAR_VEC_TABLE(isa_baseline, CpuIsa::kBaseline);
#if OAR_HAS_MULTI_ISA
constexpr Kernels kAvx2Kernels = OAR_VEC_TABLE(isa_avx2, CpuIsa::kAvx2);
constexpr Kernels kAvx512fKernels = OAR_VEC_TABLE(isa_avx512f, CpuIsa::kAvx512f);
#endif
#undef OAR_VEC_TABLE

const Kernels* kernels_of(CpuIsa isa) {
  switch (isa) {
#if OAR_HAS_MULTI_ISA
    case CpuIsa::kAvx512f:
      return &kAvx512fKernels;
    case CpuIsa::kAvx2:
      return &kAvx2Kernels;
#endif
    case CpuIsa::kBaseline:
      return &kBaselineKernels;
    default:
      return nullptr;  // not compiled in
  }
}

bool cpu_runs(CpuIsa isa) {
#if OAR_HAS_MULTI_ISA
  // libgcc's / compiler-rt's CPU model: CPUID bits and, for AVX levels, the OS's XCR0 state flags.
  __builtin_cpu_init();
  if (isa == CpuIsa::kAvx512f) return __builtin_cpu_supports("avx512f");
  if (isa == CpuIsa::kAvx2) return __builtin_cpu_supports("avx2");
#endif
  return isa == CpuIsa::kBaseline;
}

std::string supported_list() {
  std::string s;
  for (CpuIsa isa : supported_cpu_isas()) s += std::string(s.empty() ? "" : ", ") + to_string(isa);
  return s;
}

// The active table. Chosen once when the library is loaded (the static `g_loaded` below forces it), from
// OAR_CPU_ISA or the CPU; an OAR_CPU_ISA that cannot be honoured leaves no table and keeps the reason, so the
// first use of a loop (or cpu_isa()) raises it instead of silently running another path.
struct State {
  std::atomic<const Kernels*> active{nullptr};
  std::mutex mu;        // serializes set_cpu_isa (the pointer itself is read lock-free)
  std::string error;    // why OAR_CPU_ISA was refused (when `active` is null)
  std::string source;   // "auto" | "OAR_CPU_ISA" | "set_cpu_isa"

  State() {
    const char* env = std::getenv("OAR_CPU_ISA");
    const std::string want = env ? env : "";
    if (want.empty() || want == "auto") {
      const CpuIsa best = supported_cpu_isas().front();
      active.store(kernels_of(best));
      source = "auto";
      log::info(std::string("CPU vector loops: ") + to_string(best) + " (best supported; OAR_CPU_ISA overrides)");
      return;
    }
    try {
      CpuIsa isa;
      try {
        isa = parse_cpu_isa(want, "OAR_CPU_ISA");
      } catch (const InvalidArgument&) {
        throw InvalidArgument("OAR_CPU_ISA must be one of {auto, avx512f, avx2, baseline}, got \"" + want + "\"");
      }
      if (!cpu_isa_supported(isa))
        throw InvalidArgument("OAR_CPU_ISA=" + want + ": this CPU (or this build) cannot run the " + want +
                              " loops; supported here: " + supported_list() + " (or auto)");
      active.store(kernels_of(isa));
      source = "OAR_CPU_ISA";
      log::info("CPU vector loops: " + want + " (forced by OAR_CPU_ISA)");
    } catch (const InvalidArgument& e) {
      error = e.what();
      log::warn(std::string("CPU vector loops: ") + error);
    }
  }
};

State& state() {
  static State s;
  return s;
}

[[maybe_unused]] const bool g_loaded = (state(), true);

const Kernels& active() {
  const Kernels* k = state().active.load(std::memory_order_acquire);
  if (k == nullptr) throw InvalidArgument(state().error);
  return *k;
}

}  // namespace

float vmax(const float* z, int64_t len) { return active().vmax(z, len); }
float vexp_shifted_sum(const float* z, float m, float* e, int64_t len) {
  return active().vexp_shifted_sum(z, m, e, len);
}
void vexp_shifted_scaled(const float* z, float shift, float scale, float* out, int64_t len) {
  active().vexp_shifted_scaled(z, shift, scale, out, len);
}
float vdot(const float* a, const float* b, int64_t len) { return active().vdot(a, b, len); }
float vdot_diff(const float* e, const float* zc, const float* zp, int64_t len) {
  return active().vdot_diff(e, zc, zp, len);
}
void vlog1p(const float* x, float* out, int64_t len) { active().vlog1p(x, out, len); }
bool vmasked_minmax(const float* x, const bool* mask, int64_t len, float* lo, float* hi) {
  return active().vmasked_minmax(x, mask, len, lo, hi);
}
void vdivide_clamp_masked(float* out, const bool* mask, float den, int64_t len) {
  active().vdivide_clamp_masked(out, mask, den, len);
}
void vshift_scale(const float* x, float shift, float scale, float* out, int64_t len) {
  active().vshift_scale(x, shift, scale, out, len);
}
double vtier_weights_masked(const float* s, const bool* rm, const bool* pm, int64_t len, double tau, double lo_den,
                            double hi_den, double beta, double floor, float* w) {
  return active().vtier_weights_masked(s, rm, pm, len, tau, lo_den, hi_den, beta, floor, w);
}
bool vscale_advantages_masked(float* w, const bool* rm, double scale, float a, float* ta, int64_t len) {
  return active().vscale_advantages_masked(w, rm, scale, a, ta, len);
}
void vload_f32(const float* src, float* dst, int64_t len) {
  std::memcpy(dst, src, static_cast<size_t>(len) * sizeof(float));
}
void vadd_f32(const float* src, float* dst, int64_t len) { active().vadd_f32(src, dst, len); }
void vload_bf16(const uint16_t* src, float* dst, int64_t len) { active().vload_bf16(src, dst, len); }
void vadd_bf16(const uint16_t* src, float* dst, int64_t len) { active().vadd_bf16(src, dst, len); }
void vload_f16(const uint16_t* src, float* dst, int64_t len) { active().vload_f16(src, dst, len); }
void vadd_f16(const uint16_t* src, float* dst, int64_t len) { active().vadd_f16(src, dst, len); }

const char* vec_math_isa() { return to_string(cpu_isa()); }

}  // namespace detail

const char* to_string(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline:
      return "baseline";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512f:
      return "avx512f";
  }
  return "?";
}

CpuIsa parse_cpu_isa(std::string_view name, std::string_view arg) {
  for (CpuIsa isa : {CpuIsa::kBaseline, CpuIsa::kAvx2, CpuIsa::kAvx512f})
    if (name == to_string(isa)) return isa;
  throw InvalidArgument(std::string(arg) + " must be one of {avx512f, avx2, baseline}, got \"" + std::string(name) +
                        "\"");
}

bool cpu_isa_supported(CpuIsa isa) { return detail::kernels_of(isa) != nullptr && detail::cpu_runs(isa); }

std::vector<CpuIsa> supported_cpu_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::kAvx512f, CpuIsa::kAvx2, CpuIsa::kBaseline})
    if (cpu_isa_supported(isa)) out.push_back(isa);
  return out;
}

CpuIsa cpu_isa() { return detail::active().isa; }

void set_cpu_isa(CpuIsa isa) {
  if (!cpu_isa_supported(isa))
    throw InvalidArgument(std::string("isa: this CPU (or this build) cannot run the ") + to_string(isa) +
                          " loops; supported here: " + detail::supported_list());
  detail::State& st = detail::state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.active.store(detail::kernels_of(isa), std::memory_order_release);
  st.source = "set_cpu_isa";
  log::info(std::string("CPU vector loops: ") + to_string(isa) + " (set_cpu_isa)");
}

std::string cpu_isa_source() {
  detail::State& st = detail::state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.source;
}

}  // namespace oar::core
