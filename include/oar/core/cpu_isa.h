// Instruction-set level of oar's CPU vector loops (the float32 hot loops of the probe divergence,
// importance normalization and reshaping). The loops are compiled once per level and one copy is chosen
// when liboar_core is loaded: the best level the CPU and the OS support, or the one the environment
// variable OAR_CPU_ISA names (avx512f | avx2 | baseline | auto). set_cpu_isa() changes it at run time
// (tests run every path that way). Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace oar::core {

/// Code path of the CPU loops. Every level computes the same function; results differ only in the
/// float32 rounding of reductions (a different number of SIMD lanes sums in a different order).
enum class CpuIsa : int32_t {
  kBaseline = 0,  ///< the compiler's target (x86-64: SSE2); the only path on other architectures
  kAvx2 = 1,      ///< x86-64 AVX2 (256-bit vectors)
  kAvx512f = 2,   ///< x86-64 AVX-512 Foundation (512-bit vectors)
};

/// "baseline" | "avx2" | "avx512f".
const char* to_string(CpuIsa isa);

/// Parses "baseline" | "avx2" | "avx512f" (case-sensitive). Throws InvalidArgument naming `arg` and the
/// accepted values.
CpuIsa parse_cpu_isa(std::string_view name, std::string_view arg = "isa");

/// True when this build holds the `isa` copy of the loops and the CPU and OS can run it (AVX state
/// enabled by the OS, as GCC's __builtin_cpu_supports checks it).
bool cpu_isa_supported(CpuIsa isa);

/// The levels cpu_isa_supported() accepts on this machine, best first (always ends with kBaseline).
std::vector<CpuIsa> supported_cpu_isas();

/// The level the loops run at now. Throws InvalidArgument when OAR_CPU_ISA named a level that was refused
/// at load time (unknown name, or not supported here) and set_cpu_isa() has not been called since.
CpuIsa cpu_isa();

/// Makes the loops run at `isa` from the next call on (thread-safe; calls in flight finish on the old
/// path). Throws InvalidArgument when cpu_isa_supported(isa) is false: the message names the level and the
/// supported ones. Logs the change at info level.
void set_cpu_isa(CpuIsa isa);

/// How the current level was chosen: "auto" (best supported), "OAR_CPU_ISA" (the environment variable) or
/// "set_cpu_isa".
std::string cpu_isa_source();

}  // namespace oar::core
