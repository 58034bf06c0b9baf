// oar._C: the pybind11 module (docs/architecture.md, layer 3). Configuration objects, the OAR-P chunk
// planner and build information. Tensor operators are NOT exposed here: they are registered with the
// PyTorch dispatcher (torch.ops.oar.*, src/torch) so that autograd, torch.compile and opcheck see them.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "oar/core/common.h"
#include "oar/core/config.h"
#include "oar/core/cpu_isa.h"
#include "oar/core/log.h"
#include "oar/core/masked_batch.h"
#include "config_kwargs.h"

namespace py = pybind11;
using namespace oar::core;

#ifndef OAR_TORCH_VERSION
#define OAR_TORCH_VERSION ""
#endif
#ifndef OAR_TORCH_CUDA_VERSION
#define OAR_TORCH_CUDA_VERSION ""
#endif
#ifndef OAR_CUDA_ARCHS
#define OAR_CUDA_ARCHS ""
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "oar native module: configs, OAR-P chunk planner, build info (tensor ops live in torch.ops.oar)";
  py::register_exception<InvalidArgument>(m, "InvalidArgument", PyExc_ValueError);

  m.def("build_info", [] {
    py::dict d;
    d["version"] = version();
    d["cuda_kernels"] = compiled_with_cuda();
#ifdef OAR_TORCH_CUDA
    d["cuda_ops_registered"] = true;
#else
    d["cuda_ops_registered"] = false;
#endif
    d["torch_built_against"] = OAR_TORCH_VERSION;
    d["torch_cuda_built_against"] = OAR_TORCH_CUDA_VERSION;
    d["cuda_architectures"] = OAR_CUDA_ARCHS;
    d["cpu_isa"] = to_string(cpu_isa());
    py::list isas;
    for (CpuIsa isa : supported_cpu_isas()) isas.append(to_string(isa));
    d["cpu_isas_supported"] = isas;
    return d;
  }, "Build information: version, whether CUDA kernels are compiled in, torch/CUDA versions built against, the "
     "ISA level the CPU loops run at (cpu_isa) and the levels this machine supports (cpu_isas_supported).");

  // ---- ISA level of the CPU loops (oar/core/cpu_isa.h) ----
  m.def("cpu_isa", [] { return std::string(to_string(cpu_isa())); },
        "ISA level the CPU loops run at: \"avx512f\" | \"avx2\" | \"baseline\". Raises ValueError when OAR_CPU_ISA "
        "named a level this machine cannot run.");
  m.def("set_cpu_isa", [](const std::string& isa) { set_cpu_isa(parse_cpu_isa(isa, "isa")); }, py::arg("isa"),
        "Runs the CPU loops at `isa` (\"avx512f\" | \"avx2\" | \"baseline\") from the next call on. Raises "
        "ValueError for an unknown name or a level this CPU (or build) cannot run.");
  m.def("supported_cpu_isas", [] {
          std::vector<std::string> out;
          for (CpuIsa isa : supported_cpu_isas()) out.emplace_back(to_string(isa));
          return out;
        }, "ISA levels of the CPU loops this machine can run, best first (ends with \"baseline\").");
  m.def("cpu_isa_source", &cpu_isa_source,
        "How the ISA level was chosen: \"auto\", \"OAR_CPU_ISA\" or \"set_cpu_isa\".");
  // ---- end ISA level ----

  // ---- log level (oar/core/log.h; Python: oar.set_log_level sets this and the "oar" logging logger) ----
  m.def("set_log_level", [](const std::string& level) {
    const auto lvl = log::parse_level(level);
    if (!lvl) throw InvalidArgument(std::string("level must be one of ") + log::level_names() + ", got \"" + level + "\"");
    log::set_level(*lvl);
  }, py::arg("level"),
        "Sets the level of oar's C++ logger (spdlog \"oar\", stderr): trace | debug | info | warn | error | off. "
        "Raises ValueError for another name.");
  m.def("log_level", [] { return std::string(log::to_string(log::level())); },
        "Level of oar's C++ logger; the first call reads OAR_LOG_LEVEL (default \"warn\").");
  {
    py::list names;
    for (auto l : {log::Level::kTrace, log::Level::kDebug, log::Level::kInfo, log::Level::kWarn, log::Level::kError,
                   log::Level::kOff})
      names.append(log::to_string(l));
    m.attr("LOG_LEVELS") = py::tuple(names);  // most verbose first
  }
  // ---- end log level ----

  py::class_<ReshapeOptions>(m, "ReshapeOptions", "Bi-level reshaping parameters (method.md section 6).")
      .def(py::init<>())
      .def_readwrite("q", &ReshapeOptions::q)
      .def_readwrite("beta", &ReshapeOptions::beta)
      .def_readwrite("floor", &ReshapeOptions::floor)
      .def_property("tiers", [](const ReshapeOptions& o) { return std::string(to_string(o.tiers)); },
                    [](ReshapeOptions& o, const std::string& s) { o.tiers = parse_tiers(s); });

  py::class_<GroupAdvantageOptions>(m, "GroupAdvantageOptions", "Sequence-advantage options (method.md section 1).")
      .def(py::init<>())
      .def_property("estimator", [](const GroupAdvantageOptions& o) { return std::string(to_string(o.estimator)); },
                    [](GroupAdvantageOptions& o, const std::string& s) { o.estimator = parse_estimator(s); })
      .def_property("std", [](const GroupAdvantageOptions& o) { return std::string(to_string(o.std_kind)); },
                    [](GroupAdvantageOptions& o, const std::string& s) { o.std_kind = parse_std_kind(s); })
      .def_readwrite("eps", &GroupAdvantageOptions::eps)
      .def_property("singleton", [](const GroupAdvantageOptions& o) { return std::string(to_string(o.singleton)); },
                    [](GroupAdvantageOptions& o, const std::string& s) { o.singleton = parse_singleton_policy(s); })
      .def_readwrite("skip_nan", &GroupAdvantageOptions::skip_nan);

  m.def("preset_options", [](const std::string& preset, const std::string& estimator) {
          return preset_options(preset, parse_estimator(estimator));
        }, py::arg("preset"), py::arg("estimator") = "grpo",
        "GroupAdvantageOptions of a trainer preset (default | trl | verl | openrlhf), as C++ callers get them "
        "(oar::core::preset_options). Raises ValueError for an unknown preset or estimator.");
  {
    // oar::core::config_choices(): every string key's accepted values, in the schema's order (oar.schema reads them)
    py::dict choices;
    for (const auto& [key, values] : config_choices()) {
      py::tuple t(values.size());
      for (size_t i = 0; i < values.size(); ++i) t[i] = values[i];
      choices[py::str(key)] = t;
    }
    m.attr("CONFIG_CHOICES") = choices;
    m.attr("METHOD_NAMES") = choices["method"];
    m.attr("ADVANTAGE_PRESET_NAMES") = choices["preset"];
  }

  py::class_<EntropyShapingOptions>(m, "EntropyShapingOptions",
                                    "Entropy-advantage shaping (method.md section 8): A_t = A + min(alpha * H_t, "
                                    "|A| / kappa). JSON keys entropy_alpha, entropy_kappa.")
      .def(py::init<>())
      .def_readwrite("alpha", &EntropyShapingOptions::alpha)
      .def_readwrite("kappa", &EntropyShapingOptions::kappa);

  py::class_<KtaeOptions>(m, "KtaeOptions",
                          "KTAE key-token scores (method.md section 8). JSON keys ktae_alpha (Fisher weight), "
                          "ktae_beta (information-gain weight), ktae_tf (token-frequency term), ktae_scale "
                          "(scores in (-scale, scale)), ktae_threshold (correct when reward > threshold).")
      .def(py::init<>())
      .def_readwrite("alpha", &KtaeOptions::alpha)
      .def_readwrite("beta", &KtaeOptions::beta)
      .def_readwrite("tf", &KtaeOptions::tf)
      .def_readwrite("scale", &KtaeOptions::scale)
      .def_readwrite("threshold", &KtaeOptions::threshold);

  py::class_<OARConfig>(m, "OARConfig",
                        "Everything that decides per-token advantages: oar.OARConfig(method=\"oar_g\", "
                        "probe=\"answer_mean\", q=0.25, ...) with the flat keys of to_json(), or "
                        "OARConfig.from_json(text) / the `oar:` section of a config (configs/*.yaml); one C++ schema "
                        "(nlohmann_json) validates all three. Unknown keys and out-of-range values raise ValueError "
                        "naming the key.")
      .def(py::init(&oar::python::config_from_kwargs), oar::python::config_init_doc())
      .def_static("from_json", &parse_oar_config, py::arg("json_text"),
                  "OARConfig from a JSON object with the keys of to_json() (all optional); same validation and "
                  "messages as the keyword constructor.")
      .def("to_json", [](const OARConfig& c) { return to_json(c); })
      .def_property("method", [](const OARConfig& c) { return std::string(to_string(c.method)); },
                    [](OARConfig& c, const std::string& s) { c.method = parse_method(s); })
      .def_property("probe", [](const OARConfig& c) { return std::string(to_string(c.probe)); },
                    [](OARConfig& c, const std::string& s) { c.probe = parse_probe(s); })
      .def_readwrite("reshape", &OARConfig::reshape)
      .def_readwrite("advantages", &OARConfig::advantages)
      .def_readwrite("sigma", &OARConfig::sigma)
      .def_readwrite("noise_draws", &OARConfig::noise_draws)
      .def_readwrite("conclude", &OARConfig::conclude)
      .def_readwrite("answer_suffix", &OARConfig::answer_suffix)
      .def_readwrite("memory_budget_mb", &OARConfig::memory_budget_mb)
      .def_readwrite("max_variants_per_chunk", &OARConfig::max_variants_per_chunk)
      .def_readwrite("seed", &OARConfig::seed)
      .def_readwrite("screen_fraction", &OARConfig::screen_fraction)
      .def_readwrite("screen_sample", &OARConfig::screen_sample)
      .def_readwrite("screen", &OARConfig::screen)
      .def_readwrite("screen_window", &OARConfig::screen_window)
      .def_readwrite("screen_budget", &OARConfig::screen_budget)
      .def_readwrite("screen_tail", &OARConfig::screen_tail)
      .def_readwrite("mask_unit", &OARConfig::mask_unit)
      .def_readwrite("credit_rows", &OARConfig::credit_rows)
      .def_readwrite("turn_probe", &OARConfig::turn_probe)
      .def_readwrite("turn_credit", &OARConfig::turn_credit)
      .def_readwrite("entropy_shaping", &OARConfig::entropy_shaping)
      .def_readwrite("ktae", &OARConfig::ktae)
      .def("__repr__", [](const OARConfig& c) { return "OARConfig(" + to_json(c) + ")"; });

  py::class_<MaskedChunk>(m, "MaskedChunk", "Variants [begin, end) of the flattened OAR-P variant list.")
      .def_readonly("begin", &MaskedChunk::begin)
      .def_readonly("end", &MaskedChunk::end)
      .def_readonly("max_context_len", &MaskedChunk::max_context_len)
      .def("__repr__", [](const MaskedChunk& c) {
        return "MaskedChunk(begin=" + std::to_string(c.begin) + ", end=" + std::to_string(c.end) +
               ", max_context_len=" + std::to_string(c.max_context_len) + ")";
      });

  py::class_<PrefixChunk>(m, "PrefixChunk",
                          "Variants [begin, end) of the column-sorted OAR-P variants, run on the clean cache of "
                          "columns [0, prefix_len).")
      .def_readonly("begin", &PrefixChunk::begin)
      .def_readonly("end", &PrefixChunk::end)
      .def_readonly("prefix_len", &PrefixChunk::prefix_len)
      .def("__repr__", [](const PrefixChunk& c) {
        return "PrefixChunk(begin=" + std::to_string(c.begin) + ", end=" + std::to_string(c.end) +
               ", prefix_len=" + std::to_string(c.prefix_len) + ")";
      });

  m.def("plan_prefix_chunks",
        [](std::vector<int64_t> columns, int64_t width, int64_t bytes_per_token, int64_t kv_bytes_per_token,
           int64_t bytes_per_variant, int64_t memory_budget_bytes, int64_t max_variants_per_chunk,
           double max_prefix_waste) {
          PrefixPlanRequest req;
          req.columns = std::move(columns);
          req.width = width;
          req.bytes_per_token = bytes_per_token;
          req.kv_bytes_per_token = kv_bytes_per_token;
          req.bytes_per_variant = bytes_per_variant;
          req.memory_budget_bytes = memory_budget_bytes;
          req.max_variants_per_chunk = max_variants_per_chunk;
          req.max_prefix_waste = max_prefix_waste;
          return plan_prefix_chunks(req);
        },
        py::arg("columns"), py::arg("width"), py::arg("bytes_per_token"), py::arg("kv_bytes_per_token"),
        py::arg("bytes_per_variant"), py::arg("memory_budget_bytes"), py::arg("max_variants_per_chunk") = 0,
        py::arg("max_prefix_waste") = 0.1,
        "Prefix-cached OAR-P plan (issue 3): greedy chunks of column-sorted variants, each run on the clean "
        "key/value cache of its smallest column, under a memory budget. Raises ValueError on bad input.");

  m.def("plan_masked_chunks",
        [](std::vector<int64_t> context_len, std::vector<int64_t> num_variants, int64_t bytes_per_token,
           int64_t bytes_per_variant, int64_t memory_budget_bytes, int64_t max_variants_per_chunk) {
          MaskedPlanRequest req;
          req.context_len = std::move(context_len);
          req.num_variants = std::move(num_variants);
          req.bytes_per_token = bytes_per_token;
          req.bytes_per_variant = bytes_per_variant;
          req.memory_budget_bytes = memory_budget_bytes;
          req.max_variants_per_chunk = max_variants_per_chunk;
          return plan_masked_chunks(req);
        },
        py::arg("context_len"), py::arg("num_variants"), py::arg("bytes_per_token"), py::arg("bytes_per_variant"),
        py::arg("memory_budget_bytes"), py::arg("max_variants_per_chunk") = 0,
        "OAR-P chunk plan (method.md section 3): greedy chunks of the flattened (rollout, masked position) "
        "variants whose estimated memory (variants x padded width x bytes_per_token + variants x "
        "bytes_per_variant) stays under memory_budget_bytes. Raises ValueError on bad sizes.");
}
