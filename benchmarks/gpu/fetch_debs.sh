#!/usr/bin/env bash
# Downloads the Debian packages of oar's C++ build dependencies (Eigen, spdlog + fmt, nlohmann-json) into .gpu-debs/
# (ignored by git), for a GPU machine that has no network: run_gpu_checks.sh unpacks them under /tmp (no
# installation, no root needed there). Run on a Debian/Ubuntu machine with apt, after `apt-get update` (no root
# needed for the download itself); benchmarks/gpu/prepare_carry.sh does both. The packages must come from a release
# no newer than the GPU machine's (glibc, libstdc++): e.g. Debian 12 (glibc 2.36) for the device's Ubuntu 24.04.
# GoogleTest is not fetched: the GPU check builds no C++ tests (tests/cpp has no CUDA code; CI runs them).
# Usage: benchmarks/gpu/fetch_debs.sh [DIR]     (about 2 MB)
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.gpu-debs}
mkdir -p "$DIR"
rm -f "$DIR"/*.deb  # one version of each package: run_gpu_checks.sh unpacks every .deb it finds
# The -dev packages and the shared libraries they link to (spdlog and fmt are not header-only on Debian).
PKGS=(libeigen3-dev nlohmann-json3-dev libspdlog-dev libfmt-dev)
libs=$(apt-cache depends "${PKGS[@]}" 2>/dev/null | awk '/Depends: lib(spdlog|fmt)[0-9]/ {print $2}' | sort -u)
[ -n "$libs" ] || { echo "fetch_debs.sh: apt-cache knows no libspdlog*/libfmt* package: run apt-get update first" >&2; exit 1; }
cd "$DIR"
# shellcheck disable=SC2086
apt-get download "${PKGS[@]}" $libs
# apt writes an epoch's colon as %3a: plain names travel and unpack the same (dpkg-deb reads the contents only).
for f in *%3a*.deb; do [ -e "$f" ] && mv "$f" "${f//%3a/_}"; done
ls -la
