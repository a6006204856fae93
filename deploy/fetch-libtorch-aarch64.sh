#!/usr/bin/env bash
# Provides libtorch for aarch64 to build edgemoe against, and prints its directory (LIBTORCH):
#   - the PyTorch 2.13.0 wheel for manylinux_2_28_aarch64 (tch 0.26 requires exactly 2.13.0)
#     and the CUDA runtime wheels its libtorch_cpu.so needs to link and to load, downloaded with
#     `pip download` into CACHE/wheels;
#   - unpacked into CACHE/aarch64/site (torch/ beside nvidia/, as in site-packages);
#   - Debian 12's arm64 OpenBLAS (OpenMP build) and libgfortran, downloaded from the Debian
#     mirror into CACHE/debs, and two stand-in libraries carrying the NVPL sonames that load it
#     (see fetch_blas): the wheel's own BLAS, NVIDIA's NVPL, needs ARMv8.1 (LSE atomics) and dies
#     of SIGILL on a Raspberry Pi 4's Cortex-A72;
#   - CACHE/aarch64/libtorch-cpu: the CPU view of it that the build links against (see
#     make_cpu_view);
#   - CACHE/aarch64/libtorch-run/lib: the libraries that run and that the package ships, with
#     that OpenBLAS in place of NVPL (see make_run_libs).
# Every step is skipped when its result is already there.
#
#   deploy/fetch-libtorch-aarch64.sh [CACHE]   CACHE defaults to deploy/.cache (ignored by git);
#                                              deploy/build-aarch64.sh and package.sh run it so
#   ./fetch-libtorch-aarch64.sh TARGET_TRIPLE  as cross-rs's pre-build script (cross.toml), which
#                                              runs it as root while building the image: CACHE is
#                                              /opt/edgemoe, and Python's pip is installed first
# deploy/common.sh sources it for the versions and needed_closure. It needs python3 with pip,
# readelf, dpkg-deb, the aarch64 cross compiler (aarch64-linux-gnu-gcc) and its sysroot
# (/usr/aarch64-linux-gnu).
set -euo pipefail

# tch 0.26 links exactly PyTorch 2.13.0.
torch_version=2.13.0
# The aarch64 wheel of torch 2.13.0 on PyPI is a CUDA 13 build: its libtorch_cpu.so itself needs
# libcudart.so.13 and libcupti.so.13 to link and to load (no GPU needed to run on the CPU). These
# are the versions torch 2.13.0 asks for (`cuda-toolkit[cudart,cupti]==13.0.3`).
cuda_wheels=(nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85)
sysroot="${EDGEMOE_AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}"

# The BLAS shipped instead of the wheel's NVPL: Debian 12 (bookworm) arm64 packages, from the
# Debian mirror's pool, pinned by version and SHA-256. OpenBLAS 0.3.21 is built for the ARMv8.0
# baseline and picks its kernels at run time (DYNAMIC_ARCH), so it runs on a Cortex-A53, A57 and
# A72 as on an A76. Its OpenMP build (not the pthread one) because it sizes its threads from
# OpenMP's setting, which the engine sets to 1 on every thread (tch::set_num_threads), as the
# wheel's NVPL (its `gomp` build) did; the pthread build starts its own pool of one thread per
# core whatever libtorch says. libgomp.so.1 is the wheel's, already shipped. gcc-12-base carries
# libgfortran's copyright file (libgfortran5's doc directory is a link to it).
debian_mirror="${EDGEMOE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
blas_debs=(
  "pool/main/o/openblas/libopenblas0-openmp_0.3.21+ds-4_arm64.deb 202482205beaebdc03f31a41351939add2ddac5b45c3e807a9fb0c978136985f"
  "pool/main/g/gcc-12/libgfortran5_12.2.0-14+deb12u1_arm64.deb 583497cf5a95960c11f2006586050375c4adbc4b0c569a7e7df346f2bf380cbc"
  "pool/main/g/gcc-12/gcc-12-base_12.2.0-14+deb12u1_arm64.deb 674cf6cba6d432bd200c45fe866c1652c7a53523cc2e7a613e05bc4abf7b5440"
)
# The NVPL libraries libtorch_cpu.so loads, which the stand-ins replace; they load
# libnvpl_blas_core.so.0 and libnvpl_lapack_core.so.0, which then are not shipped either.
nvpl_fronts=(libnvpl_blas_lp64_gomp.so.0 libnvpl_lapack_lp64_gomp.so.0)

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

# fetch_blas CACHE: downloads the .debs of blas_debs (checked against their SHA-256) into
# CACHE/debs, unpacks them, and makes CACHE/aarch64/blas:
#   lib/libopenblas.so.0, lib/libgfortran.so.5   Debian's files, unchanged
#   lib/libnvpl_*_lp64_gomp.so.0                 stand-ins: no code, the NVPL soname and version
#                                                node libtorch_cpu.so asks for, and a DT_NEEDED
#                                                on libopenblas.so.0, which defines every BLAS,
#                                                CBLAS and LAPACK function libtorch_cpu.so takes
#                                                from NVPL (checked by check_blas_symbols)
#   licenses/                                    the packages' copyright files
# Prints that directory. Skipped when it is already there for these packages.
fetch_blas() {
  local cache="$1"
  local python="${PYTHON:-python3}"
  local deb_dir="$cache/debs" blas="$cache/aarch64/blas" entry path sum deb root so
  local stamp="$blas/.made" want
  want="$(printf '%s\n' "${blas_debs[@]}" "stand-ins 2")"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "$blas"
    return 0
  fi
  command -v dpkg-deb >/dev/null 2>&1 || { echo "error: dpkg-deb is missing (package dpkg)" >&2; return 1; }
  command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 ||
    { echo "error: aarch64-linux-gnu-gcc is missing (package gcc-aarch64-linux-gnu)" >&2; return 1; }
  mkdir -p "$deb_dir"
  rm -rf "$blas"
  root="$blas/root"
  mkdir -p "$root" "$blas/lib" "$blas/licenses"
  for entry in "${blas_debs[@]}"; do
    path="${entry% *}"
    sum="${entry##* }"
    deb="$deb_dir/${path##*/}"
    if [ ! -f "$deb" ] || [ "$(sha256sum "$deb" | cut -d' ' -f1)" != "$sum" ]; then
      echo "downloading $debian_mirror/$path" >&2
      "$python" - "$debian_mirror/$path" "$deb.part" <<'PY'
import shutil, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=120) as r, open(sys.argv[2], "wb") as f:
    shutil.copyfileobj(r, f)
PY
      [ "$(sha256sum "$deb.part" | cut -d' ' -f1)" = "$sum" ] ||
        { echo "error: ${path##*/}: SHA-256 differs from the pinned one" >&2; return 1; }
      mv "$deb.part" "$deb"
    fi
    dpkg-deb -x "$deb" "$root"
  done
  cp -L "$root/usr/lib/aarch64-linux-gnu/openblas-openmp/libopenblas.so.0" "$blas/lib/"
  cp -L "$root/usr/lib/aarch64-linux-gnu/libgfortran.so.5" "$blas/lib/"
  cp "$root/usr/share/doc/libopenblas0-openmp/copyright" "$blas/licenses/libopenblas.so.0.copyright"
  cp "$root/usr/share/doc/gcc-12-base/copyright" "$blas/licenses/libgfortran.so.5.copyright"
  {
    echo "lib/libopenblas.so.0 and lib/libgfortran.so.5 are Debian 12's arm64 files, unchanged,"
    echo "from these packages ($debian_mirror):"
    for entry in "${blas_debs[@]}"; do echo "  ${entry% *}  sha256 ${entry##* }"; done
    echo "Their licences: libopenblas.so.0.copyright (OpenBLAS: BSD-3-Clause), libgfortran.so.5.copyright"
    echo "(GCC's runtime library: GPL-3.0 with the GCC Runtime Library Exception). The files"
    echo "lib/libnvpl_blas_lp64_gomp.so.0 and lib/libnvpl_lapack_lp64_gomp.so.0 hold no code of"
    echo "NVIDIA's: they carry those names so that libtorch_cpu.so loads OpenBLAS in their place."
  } >"$blas/licenses/README"
  # An empty constructor, so that the loader reports the stand-ins' initialization as it does
  # every other library's (`LD_DEBUG=files`: .ci/cross checks the libraries loaded with it).
  echo 'static void __attribute__((constructor)) stand_in_loaded(void) {}' >"$blas/stand-in.c"
  for so in "${nvpl_fronts[@]}"; do
    # The version node: libtorch_cpu.so's references to these libraries are versioned with it.
    printf '%s { local: *; };\n' "$so" >"$blas/$so.map"
    aarch64-linux-gnu-gcc -shared -fPIC -nostdlib -s -o "$blas/lib/$so" "$blas/stand-in.c" \
      -Wl,-soname,"$so" -Wl,--version-script,"$blas/$so.map" -Wl,--no-as-needed \
      -L"$blas/lib" -l:libopenblas.so.0
  done
  rm -rf "$root" "$blas"/*.map "$blas/stand-in.c"
  printf '%s\n' "$want" >"$stamp"
  echo "$blas"
}

# check_blas_symbols LIBTORCH_CPU NVPL_DIR OPENBLAS: every function LIBTORCH_CPU imports that the
# NVPL front libraries in NVPL_DIR define must be defined by OPENBLAS, and none may be NVPL's own
# (nvpl_*). Prints how many there are.
check_blas_symbols() {
  local torch="$1" nvpl_dir="$2" openblas="$3" so
  local undefined provided needed missing
  # Symbol lines: NUM: VALUE SIZE TYPE BIND VIS [FLAGS] NDX NAME[@VERSION] [(N)].
  dynsyms() { readelf --dyn-syms -W "$1" | awk -v want="$2" '$1 ~ /^[0-9]+:$/ && NF >= 8 {
    n = NF; if ($n ~ /^\([0-9]+\)$/) n--
    if ((want == "und") != ($(n - 1) == "UND")) next
    name = $n; sub(/@.*/, "", name); print name }' | LC_ALL=C sort -u; }
  undefined="$(dynsyms "$torch" und)"
  provided="$(for so in "${nvpl_fronts[@]}"; do dynsyms "$nvpl_dir/$so" def; done | LC_ALL=C sort -u)"
  needed="$(LC_ALL=C comm -12 <(echo "$undefined") <(echo "$provided"))"
  [ -n "$needed" ] || { echo "error: libtorch_cpu.so takes no function from NVPL?" >&2; return 1; }
  if grep -q '^nvpl_' <<<"$needed"; then
    echo "error: libtorch_cpu.so calls NVPL's own functions: $(grep '^nvpl_' <<<"$needed" | tr '\n' ' ')" >&2
    return 1
  fi
  missing="$(LC_ALL=C comm -23 <(echo "$needed") <(dynsyms "$openblas" def))"
  if [ -n "$missing" ]; then
    echo "error: OpenBLAS lacks what libtorch_cpu.so takes from NVPL: $(echo "$missing" | tr '\n' ' ')" >&2
    return 1
  fi
  echo "$(wc -l <<<"$needed") BLAS/LAPACK functions that libtorch_cpu.so takes from NVPL, all in OpenBLAS" >&2
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

# What runs, and what the package ships: RUN/lib, hard links to libtorch_cpu.so, libc10.so and
# every library they load, as in the view, but with BLAS's directory (fetch_blas) searched first:
# libtorch_cpu.so's two NVPL libraries are then the stand-ins, which bring libopenblas.so.0 and
# libgfortran.so.5, and NVPL's four libraries are left out. The build still links against the
# view, with NVPL: the linker checks libtorch_cpu.so's references to NVPL's versioned symbols,
# which OpenBLAS (unversioned) does not satisfy at link time; the loader binds them to it at run
# time, as a versioned reference may bind to an unversioned definition. The binary itself needs
# libtorch_cpu.so and libc10.so only, so it is the same either way.
make_run_libs() { # make_run_libs SITE BLAS RUN
  local site="$1" blas="$2" run="$3" lib closure
  check_blas_symbols "$site/torch/lib/libtorch_cpu.so" "$site/torch/lib" "$blas/lib/libopenblas.so.0"
  mkdir -p "$run/lib"
  closure="$(
    for lib in libtorch_cpu.so libc10.so; do
      echo "$site/torch/lib/$lib"
      needed_closure "$site/torch/lib/$lib" "$blas/lib" "$site/torch/lib" "$site/nvidia/cu13/lib"
    done | sort -u
  )"
  if grep -q 'libnvpl_.*_core' <<<"$closure"; then
    echo "error: NVPL is still loaded: $(grep libnvpl_ <<<"$closure" | tr '\n' ' ')" >&2
    return 1
  fi
  while read -r lib; do
    ln -f "$lib" "$run/lib/" 2>/dev/null || cp "$lib" "$run/lib/"
  done <<<"$closure"
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
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ ! -e "$site/torch/lib/libtorch_cpu.so" ]; then
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
    printf '%s\n' "$want" >"$stamp"
  fi

  [ -e "$view/lib/libtorch_cpu.so" ] || make_cpu_view "$site" "$view"

  # The libraries that run: remade when the wheels or the BLAS change.
  local blas run="$cache/aarch64/libtorch-run" run_stamp="$cache/aarch64/libtorch-run/.made"
  blas="$(fetch_blas "$cache")"
  want="$(printf '%s\n' "$want" "$(cat "$blas/.made")")"
  if [ ! -f "$run_stamp" ] || [ "$(cat "$run_stamp")" != "$want" ] || [ ! -e "$run/lib/libtorch_cpu.so" ]; then
    echo "gathering the aarch64 libraries that run (OpenBLAS for NVPL) into $run" >&2
    rm -rf "$run"
    make_run_libs "$site" "$blas" "$run"
    printf '%s\n' "$want" >"$run_stamp"
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
      rm -rf "$cache/wheels" "$cache/debs" # keep the image small
      ;;
    "") fetch_libtorch "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/.cache" ;;
    *) fetch_libtorch "$1" ;;
  esac
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
