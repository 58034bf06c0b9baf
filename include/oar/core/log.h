// Host-side logging for oar (spdlog behind a narrow interface, so no spdlog/fmt header leaks into
// users' or LibTorch translation units; docs/design.md, "spdlog stays behind oar/core/log.h").
// Never call from kernels or op bodies: the planners and the C++ engine log their decisions, once per call.
//
// Messages go to stderr as "[oar D] ..." (level letter). The level starts at warn, or at the value of the
// environment variable OAR_LOG_LEVEL read once when the logger is first used (oar._C reads it at import);
// set_level changes it (Python: oar.set_log_level, which also sets Python's "oar" logger).
#pragma once

#include <optional>
#include <string>

namespace oar::core::log {

enum class Level : int { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4, kOff = 6 };

/// "trace" | "debug" | "info" | "warn" | "error" | "off".
const char* to_string(Level level);
/// The Level named `name` (the names of to_string), or nullopt for any other string.
std::optional<Level> parse_level(const std::string& name);
/// "trace, debug, info, warn, error, off": the accepted names, for messages.
const char* level_names();

/// Sets the level of the "oar" logger.
void set_level(Level level);
Level level();
/// True when a message at `level` would be written: callers test it before building a costly message.
bool enabled(Level level);
void debug(const std::string& msg);
void info(const std::string& msg);
void warn(const std::string& msg);
/// Logs `msg` at warning level only the first time `key` is seen in this process.
void warn_once(const std::string& key, const std::string& msg);

}  // namespace oar::core::log
