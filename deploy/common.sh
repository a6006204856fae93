# Shared by the deploy/ scripts and .ci/cross (sourced, not run): where the aarch64 toolchain,
# libtorch and build live, and small helpers. Everything downloaded goes under deploy/.cache/
# (ignored by git) and is reused by later runs.
# shellcheck shell=bash
# shellcheck disable=SC2034  # the variables are for the scripts that source this file

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The versions of the aarch64 wheels, needed_closure, fetch_libtorch.
# shellcheck source=deploy/fetch-libtorch-aarch64.sh
. "$root/deploy/fetch-libtorch-aarch64.sh"
target=aarch64-unknown-linux-gnu
cache="$root/deploy/.cache"
# What the build links against (LIBTORCH): the CPU view of the aarch64 wheel that
# fetch-libtorch-aarch64.sh makes. Its lib/ holds libtorch_cpu.so, libc10.so and every library
# they load, and nothing else (but a linker-script stand-in for libtorch.so).
libtorch="$cache/aarch64/libtorch-cpu"
# What runs and is shipped: the same libraries with Debian's OpenBLAS (ARMv8.0) and two stand-ins
# for the wheel's NVPL BLAS (ARMv8.1+), which the view keeps for the linker (make_run_libs).
libtorch_run_lib="$cache/aarch64/libtorch-run/lib"
aarch64_target_dir="${EDGEMOE_AARCH64_TARGET_DIR:-$root/target/aarch64}"
aarch64_bin="$aarch64_target_dir/$target/release/edgemoe"

say() { echo "[$(basename "$0")] $*" >&2; }
die() {
  say "error: $*"
  exit 1
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# ensure_cmd COMMAND DEBIAN_PACKAGE...: installs the packages with apt-get when COMMAND is missing.
apt_updated=0
ensure_cmd() {
  local cmd="$1"
  shift
  command -v "$cmd" >/dev/null 2>&1 && return 0
  command -v apt-get >/dev/null 2>&1 || die "$cmd is missing; install the Debian/Ubuntu packages $* (or your distribution's equivalent)"
  say "installing $* (for $cmd)"
  if [ "$apt_updated" -eq 0 ]; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  command -v "$cmd" >/dev/null 2>&1 || die "$cmd still missing after installing $*"
}
