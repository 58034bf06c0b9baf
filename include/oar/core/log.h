// Host-side logging for oar (spdlog behind a narrow interface, so no spdlog/fmt header leaks into
// users' or LibTorch translation units). Never call from kernels or op bodies on the hot path.
#pragma once

#include <string>

namespace oar::core::log {

enum class Level : int { kTrace = 0, kDebug = 1, kInfo = 2, kWarn = 3, kError = 4, kOff = 6 };

/// Sets the level of the "oar" logger. Initial level comes from the OAR_LOG_LEVEL environment variable
/// (trace|debug|info|warn|error|off), default warn.
void set_level(Level level);
Level level();
void debug(const std::string& msg);
void info(const std::string& msg);
void warn(const std::string& msg);
/// Logs `msg` at warning level only the first time `key` is seen in this process.
void warn_once(const std::string& key, const std::string& msg);

}  // namespace oar::core::log
