#!/usr/bin/env bash
# Downloads the Debian packages of oar's C++ dependencies (Eigen, spdlog + fmt, nlohmann-json, GoogleTest) into
# .gpu-debs/ (ignored by git), for a GPU machine that has no network: run_gpu_checks.sh unpacks them under /tmp
# (no installation, no root needed). Run on a Debian/Ubuntu machine with apt (no root needed either); the
# packages must come from a release no newer than the GPU machine's (glibc), e.g. Debian 12 for Ubuntu 24.04.
# Usage: benchmarks/gpu/fetch_debs.sh [DIR]     (about 4 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.gpu-debs}
mkdir -p "$DIR"
# The -dev packages and the shared libraries they link to (spdlog and fmt are not header-only on Debian).
PKGS=(libeigen3-dev nlohmann-json3-dev libspdlog-dev libfmt-dev libgtest-dev)
libs=$(apt-cache depends "${PKGS[@]}" 2>/dev/null | awk '/Depends: lib(spdlog|fmt)[0-9]/ {print $2}' | sort -u)
cd "$DIR"
# shellcheck disable=SC2086
apt-get download "${PKGS[@]}" $libs
ls -la
