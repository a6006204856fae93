#!/usr/bin/env bash
# Provides libtorch for aarch64 to build edgemoe against, and prints its directory (LIBTORCH):
#   - the PyTorch 2.13.0 wheel for manylinux_2_28_aarch64 (tch 0.26 requires exactly 2.13.0)
#     and the CUDA runtime wheels its libtorch_cpu.so needs to link and to load, downloaded with
#     `pip download` into CACHE/wheels;
#   - unpacked into CACHE/aarch64/site (torch/ beside nvidia/, as in site-packages);
#   - CACHE/aarch64/libtorch-cpu: the CPU view of it that the build links against (see
#     make_cpu_view).
# Every step is skipped when its result is already there.
#
#   deploy/fetch-libtorch-aarch64.sh [CACHE]   CACHE defaults to deploy/.cache (ignored by git);
#                                              deploy/build-aarch64.sh and package.sh run it so
#   ./fetch-libtorch-aarch64.sh TARGET_TRIPLE  as cross-rs's pre-build script (cross.toml), which
#                                              runs it as root while building the image: CACHE is
#                                              /opt/edgemoe, and Python's pip is installed first
# deploy/common.sh sources it for the versions and needed_closure. It needs python3 with pip,
# readelf, and the aarch64 sysroot of a cross toolchain (/usr/aarch64-linux-gnu).
set -euo pipefail

# tch 0.26 links exactly PyTorch 2.13.0.
torch_version=2.13.0
# The aarch64 wheel of torch 2.13.0 on PyPI is a CUDA 13 build: its libtorch_cpu.so itself needs
# libcudart.so.13 and libcupti.so.13 to link and to load (no GPU needed to run on the CPU). These
# are the versions torch 2.13.0 asks for (`cuda-toolkit[cudart,cupti]==13.0.3`).
cuda_wheels=(nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85)
sysroot="${EDGEMOE_AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}"

# needed_closure FILE DIR...: prints, one per line, the absolute paths of the shared libraries
# that FILE loads from the DIRs, searched in order, following DT_NEEDED recursively. Libraries
# found in none of them are the system's (glibc, libstdc++, libgcc_s) and must exist in the
# aarch64 sysroot (or, without one, be among those names); anything else is an error.
needed_closure() {
  local -a queue=("$1")
  local -a dirs=("${@:2}")
  local -A seen=()
  local file name dir found
  while [ "${#queue[@]}" -gt 0 ]; do
    file="${queue[0]}"
    queue=("${queue[@]:1}")
    while read -r name; do
      [ -n "${seen[$name]:-}" ] && continue
      seen[$name]=1
      found=""
      for dir in "${dirs[@]}"; do
        if [ -e "$dir/$name" ]; then
          found="$dir/$name"
          break
        fi
      done
      if [ -n "$found" ]; then
        echo "$found"
        queue+=("$found")
      elif { [ -d "$sysroot/lib" ] && [ ! -e "$sysroot/lib/$name" ]; } ||
        { [ ! -d "$sysroot/lib" ] && ! [[ "$name" =~ ^(lib(c|m|dl|rt|pthread|util|stdc\+\+|gcc_s)\.so\.[0-9]+|ld-linux-aarch64\.so\.1)$ ]]; }; then
        echo "error: $name (needed by $(basename "$file")) is neither in ${dirs[*]} nor a system library" >&2
        return 1
      fi
    done < <(readelf -d "$file" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  done
}

# The wheel is a CUDA build, and linking against its lib/ as it is fails: torch-sys links
# libtorch_cuda.so when it sees it, and libtorch.so depends on it; either way the linker then
# wants libtorch_cuda.so's own dependencies (cuDNN, cuBLAS, NCCL... about 3 GB of wheels) even
# though the engine calls none of them. So LIBTORCH is a CPU view of the wheel, as a CPU libtorch
# would be laid out: the wheel's headers, and in lib/ hard links to libtorch_cpu.so, libc10.so
# and, following DT_NEEDED, every library they load (from torch/lib, then the CUDA runtime, whose
# libcudart.so.13 and libcupti.so.13 libtorch_cpu.so needs even on a CPU). The wheel's libtorch.so
# is a shim that depends on libtorch_cuda.so, and the linker would keep it: it is the first
# library on the command line to define std::ios_base_library_init(), a GCC 13 libstdc++ symbol
# that libtorch_cpu.so names without calling and that Debian 12's libstdc++ lacks (libc10.so
# defines it too). Here a linker script stands in for it, naming libtorch_cpu.so as a CPU
# libtorch.so would. The binary then needs libtorch_cpu.so and libc10.so (and the system's
# libraries), as the x86_64 build does.
make_cpu_view() { # make_cpu_view SITE VIEW
  local site="$1" view="$2" lib closure
  mkdir -p "$view/lib"
  ln -sfn ../site/torch/include "$view/include"
  closure="$(
    for lib in libtorch_cpu.so libc10.so; do
      echo "$site/torch/lib/$lib"
      needed_closure "$site/torch/lib/$lib" "$site/torch/lib" "$site/nvidia/cu13/lib"
    done | sort -u
  )"
  while read -r lib; do
    ln -f "$lib" "$view/lib/" 2>/dev/null || cp "$lib" "$view/lib/"
  done <<<"$closure"
  cat >"$view/lib/libtorch.so" <<'EOF'
/* Link-time stand-in for the CUDA wheel's libtorch.so (see deploy/fetch-libtorch-aarch64.sh). */
INPUT(AS_NEEDED(libtorch_cpu.so))
EOF
  # torch-sys checks this file against the version tch expects.
  echo "$torch_version" >"$view/build-version"
}

# fetch_libtorch CACHE: does it all; prints the LIBTORCH directory.
fetch_libtorch() {
  local cache="$1"
  local python="${PYTHON:-python3}"
  local wheel_dir="$cache/wheels" site="$cache/aarch64/site" view="$cache/aarch64/libtorch-cpu"
  local -a specs=("torch==$torch_version" "${cuda_wheels[@]}")
  local -a wheels=()
  local spec dist ver w f
  mkdir -p "$wheel_dir"
  for spec in "${specs[@]}"; do
    dist="${spec%%==*}"
    dist="${dist//-/_}"
    ver="${spec##*==}"
    w=""
    for f in "$wheel_dir/$dist-$ver-"*.whl; do [ -e "$f" ] && w="$f"; done
    if [ -z "$w" ]; then
      echo "downloading the aarch64 wheel $spec (once; torch's is about 430 MB)" >&2
      # pip's own HTTP cache also serves repeated downloads, in fresh clones too.
      "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.11 --implementation cp --abi cp311 \
        --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64 \
        --platform manylinux_2_25_aarch64 --platform manylinux_2_17_aarch64 \
        --platform manylinux2014_aarch64 --dest "$wheel_dir" "$spec" >&2
      for f in "$wheel_dir/$dist-$ver-"*.whl; do [ -e "$f" ] && w="$f"; done
      [ -n "$w" ] || { echo "error: pip left no wheel for $spec in $wheel_dir" >&2; return 1; }
    fi
    wheels+=("$w")
  done

  local stamp="$cache/aarch64/.unpacked" want
  want="$(printf '%s\n' "${wheels[@]##*/}")"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -e "$view/lib/libtorch_cpu.so" ]; then
    echo "unpacking libtorch for aarch64 into $cache/aarch64" >&2
    rm -rf "$site" "$view" "$stamp"
    mkdir -p "$site"
    # Only what building and running need: torch's headers and libraries, the CUDA runtime.
    "$python" - "$site" "${wheels[@]}" <<'PY'
import os, stat, sys, zipfile
dest, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if name.endswith("/") or not name.startswith(("torch/lib/", "torch/include/", "nvidia/")):
                continue
            path = z.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode | stat.S_IRUSR)
PY
    make_cpu_view "$site" "$view"
    printf '%s\n' "$want" >"$stamp"
  fi
  echo "$view"
}

# As cross-rs's pre-build script, in an Ubuntu image with the cross toolchain, as root.
prepare_cross_image() {
  export DEBIAN_FRONTEND=noninteractive
  if ! python3 -m pip --version >/dev/null 2>&1 || ! command -v readelf >/dev/null 2>&1; then
    apt-get update
    apt-get install --assume-yes --no-install-recommends python3 python3-pip binutils
  fi
  # manylinux_2_28 wheels need pip 20.3 or later (Ubuntu 20.04 has 20.0).
  if ! python3 -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (20, 3))'; then
    python3 -m pip install --quiet --upgrade 'pip>=20.3,<25'
  fi
}

main() {
  local cache
  case "${1:-}" in
    *-*-linux-*)
      prepare_cross_image
      cache=/opt/edgemoe
      fetch_libtorch "$cache"
      rm -rf "$cache/wheels" # keep the image small
      ;;
    "") fetch_libtorch "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/.cache" ;;
    *) fetch_libtorch "$1" ;;
  esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
