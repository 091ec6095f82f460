#!/usr/bin/env bash
# Build, on a CPU machine with network, the wheel bundle that a GPU machine without network
# needs to run benchmarks/gpu_report.py, and print the one command line to run there.
#
#   bash benchmarks/gpu/prepare_lease.sh            # -> .lease/whl/*.whl (git-ignored)
#
# The GPU image brings its own torch, Triton, numpy, pandas, pyarrow, transformers,
# sentencepiece, safetensors, tensorboard, einops, msgpack, ninja, psutil, py-cpuinfo. It lacks
# DeepSpeed (sdist only on PyPI: built here as a pure-Python wheel, no compiled ops), pydantic
# and hjson (DeepSpeed's), datasets with dill and multiprocess, and zstandard; typing-extensions
# goes too, at the version pydantic needs (the image's may be older). Everything is
# fetched with --no-deps for CPython 3.12 / manylinux x86-64 and installed there with
# --no-deps --no-index; this project goes as a wheel too (its own dependency pins are not
# installed: the image's torch and Triton are the ones measured).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# The project's venv (`make install`) by default: DeepSpeed's setup.py imports torch, and the
# project's wheel needs a setuptools that reads pyproject.toml's SPDX license (>= 77).
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"
else PY=python3
fi
OUT_DIR="${LEASE_DIR:-$ROOT/.lease}"
WHL="$OUT_DIR/whl"
LIMIT_MIB=64  # the device tool's limit for the whole carried working tree

# One pinned version each (two versions of one package stop the install there).
BINARY=(
  "pydantic==2.13.4" "pydantic-core==2.46.4" "annotated-types==0.7.0" "typing-inspection==0.4.2"
  "typing-extensions==4.16.0" "hjson==3.1.0" "datasets==5.2.0" "dill==0.4.1"
  "multiprocess==0.70.19" "zstandard==0.25.0"
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

rm -rf "$WHL"
mkdir -p "$WHL"
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done

echo "prepare_lease: downloading ${#BINARY[@]} wheels for CPython 3.12"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platform_args[@]}" -d "$WHL" "${BINARY[@]}"

echo "prepare_lease: building deepspeed==0.19.8 as a pure-Python wheel (DS_BUILD_OPS=0)"
# DeepSpeed's setup.py imports torch: build in this environment, not an isolated one.
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WHL" \
  "deepspeed==0.19.8"

echo "prepare_lease: building this project's wheel"
had_build=0; [[ -e "$ROOT/build" ]] && had_build=1
had_egg=0; compgen -G "$ROOT/*.egg-info" >/dev/null && had_egg=1
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WHL" "$ROOT"
# setuptools' scratch in the source tree
(( had_build )) || rm -rf "$ROOT/build"
(( had_egg )) || rm -rf "$ROOT"/*.egg-info

ls -1 "$WHL"
size_kib=$(du -sk "$OUT_DIR" | cut -f1)
tree_kib=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
echo "prepare_lease: bundle $((size_kib / 1024)) MiB ($size_kib KiB); tracked+untracked tree $((tree_kib / 1024)) MiB; limit $LIMIT_MIB MiB together"
if (( size_kib + tree_kib > LIMIT_MIB * 1024 )); then
  echo "prepare_lease: bundle + working tree exceed $LIMIT_MIB MiB; the device tool would refuse it" >&2
  exit 1
fi
echo
echo "Device runs, one per line (each: carry [\".lease\"], timeout_s 600; copy \$OUT after each;"
echo "the second only on a warm machine with >= 4 minutes of device time left):"
cat "$ROOT/benchmarks/gpu/lease_command.txt"
