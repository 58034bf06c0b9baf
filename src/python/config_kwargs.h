// oar.OARConfig(**kwargs): keyword arguments -> the JSON object that OARConfig.from_json reads -> the one C++
// parser (oar::core::parse_oar_config). Both constructors therefore accept the same keys (the flat names of
// OARConfig().to_json(), plus "preset") and raise the same ValueError messages. Included by module.cpp only.
#pragma once

#include <pybind11/pybind11.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "oar/core/common.h"
#include "oar/core/config.h"

namespace oar::python {

namespace py = pybind11;

/// The JSON value that from_json would read for `value` given as keyword `key`: None -> null, bool -> true/false,
/// str -> string, integers (anything with __index__: int, numpy integers, integer 0-d tensors) -> JSON integer
/// (read from its decimal text, so that a value beyond int64 gets from_json's message), other numbers (anything
/// with __float__) -> JSON number, list/tuple/dict -> array/object. Throws InvalidArgument ("oar.<key> ...") for
/// non-finite floats and other types.
inline nlohmann::json kwarg_to_json(const std::string& key, py::handle value) {
  if (value.is_none()) return nullptr;
  if (py::isinstance<py::bool_>(value)) return value.cast<bool>();
  if (py::isinstance<py::str>(value)) return value.cast<std::string>();
  if (py::hasattr(value, "__index__")) {
    try {
      const std::string text = py::str(py::module_::import("operator").attr("index")(value));
      return nlohmann::json::parse(text);
    } catch (const py::error_already_set&) {
      // e.g. a float 0-d tensor defines __index__ but refuses it: read it as a float below.
    }
  }
  if (py::isinstance<py::float_>(value) || py::hasattr(value, "__float__")) {
    double d = 0;
    try {
      d = py::float_(py::reinterpret_borrow<py::object>(value)).cast<double>();
    } catch (const py::error_already_set&) {
      throw oar::core::InvalidArgument("oar." + key + " must be a number, got " +
                                       std::string(py::repr(value).cast<std::string>()));
    }
    if (!std::isfinite(d))
      throw oar::core::InvalidArgument("oar." + key + " must be finite, got " + py::repr(value).cast<std::string>());
    return d;
  }
  // Containers keep their JSON shape so that the parser reports them as from_json would ("got array [1]").
  if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    nlohmann::json arr = nlohmann::json::array();
    for (auto item : value) arr.push_back(kwarg_to_json(key, item));
    return arr;
  }
  if (py::isinstance<py::dict>(value)) {
    nlohmann::json obj = nlohmann::json::object();
    for (auto item : py::reinterpret_borrow<py::dict>(value))
      obj[py::str(item.first).cast<std::string>()] = kwarg_to_json(key, item.second);
    return obj;
  }
  throw oar::core::InvalidArgument("oar." + key + " must be a number, a string, a bool or None, got " +
                                   py::str(py::type::of(value).attr("__name__")).cast<std::string>() + " " +
                                   py::repr(value).cast<std::string>());
}

/// OARConfig from keyword arguments, validated by parse_oar_config (unknown keys, wrong types and out-of-range
/// values raise ValueError naming the key). Positional arguments raise TypeError.
inline oar::core::OARConfig config_from_kwargs(const py::args& args, const py::kwargs& kwargs) {
  if (!args.empty())
    throw py::type_error("OARConfig() takes keyword arguments only (the keys of OARConfig().to_json(), e.g. "
                         "OARConfig(method=\"oar_g\", q=0.25)), got " + std::to_string(args.size()) +
                         " positional argument(s)");
  nlohmann::json obj = nlohmann::json::object();
  for (const auto& item : kwargs) {
    const std::string key = py::str(item.first);
    obj[key] = kwarg_to_json(key, item.second);
  }
  return oar::core::parse_oar_config(obj.dump());
}

/// The constructor's docstring: every key with its default, from to_json(OARConfig{}).
inline const char* config_init_doc() {
  static const std::string doc = [] {
    std::string s =
        "OARConfig(**kwargs): every key optional, with the flat names of OARConfig().to_json() (the `oar:` "
        "section of a YAML config), validated by the same C++ parser as OARConfig.from_json: an unknown keyword, "
        "a wrong type or an out-of-range value raises ValueError naming the key (\"oar.q must be in (0, 1), got "
        "1.5\"); positional arguments raise TypeError. \"preset\" (default | trl | verl | openrlhf) picks a "
        "trainer's group-advantage defaults.\n\nKeywords and defaults:\n";
    const auto defaults = nlohmann::json::parse(oar::core::to_json(oar::core::OARConfig{}));
    for (const auto& item : defaults.items()) {
      const auto& v = item.value();
      s += "    " + item.key() + "=" + (v.is_boolean() ? (v.get<bool>() ? "True" : "False") : v.dump()) + "\n";
    }
    return s;
  }();
  return doc.c_str();
}

}  // namespace oar::python
