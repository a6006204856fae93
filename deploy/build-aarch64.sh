#!/usr/bin/env bash
# Cross-compiles edgemoe for aarch64-unknown-linux-gnu (Raspberry Pi OS 64-bit, Jetson L4T)
# without containers, installing what it needs on the way and reusing it on later runs:
#   - the Rust target, through rustup;
#   - Debian's gcc-aarch64-linux-gnu and g++-aarch64-linux-gnu (linker, and C/C++ compilers for
#     torch-sys's wrapper and the tokenizer's oniguruma);
#   - libtorch for aarch64, through deploy/fetch-libtorch-aarch64.sh: the PyTorch 2.13.0 wheel
#     for manylinux_2_28_aarch64 and the CUDA runtime wheels its libtorch_cpu.so links to, in
#     deploy/.cache (ignored by git); the build links against a CPU view of it,
#     deploy/.cache/aarch64/libtorch-cpu (that script says why).
# The binary is linked with the rpath `$ORIGIN/lib`: it finds libtorch in a `lib/` directory next
# to it (deploy/package.sh makes that layout), wherever the directory is unpacked.
#
# Usage:
#   deploy/build-aarch64.sh                     # cargo build --release --bin edgemoe
#   deploy/build-aarch64.sh CARGO_COMMAND ARGS  # any cargo command with the same environment,
#                                               # e.g. `test --release --lib` (runs under qemu)
#   deploy/build-aarch64.sh --env               # print the environment, for `eval`
#   deploy/build-aarch64.sh --cross [CARGO ...] # the same build through cross-rs in a container
#                                               # (needs cross and Docker/Podman; reads cross.toml)
# The build goes to target/aarch64 (EDGEMOE_AARCH64_TARGET_DIR), never the x86_64 target dir.
set -euo pipefail
# shellcheck source=deploy/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

ensure_rust_target() {
  if rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    return 0
  fi
  say "adding the Rust target $target"
  rustup target add "$target"
}

ensure_toolchain() {
  ensure_cmd aarch64-linux-gnu-gcc gcc-aarch64-linux-gnu libc6-dev-arm64-cross
  ensure_cmd aarch64-linux-gnu-g++ g++-aarch64-linux-gnu
  ensure_cmd readelf binutils
  [ -e "$sysroot/lib/libc.so.6" ] || die "no aarch64 sysroot at $sysroot (package libc6-dev-arm64-cross)"
}

export_env() {
  # An exported LIBTORCH wins over .cargo/config.toml's [env] entry (which points at the x86_64
  # .venv): cargo's [env] does not override variables already set, as it has no `force`.
  export LIBTORCH="$libtorch"
  export LIBTORCH_CXX11_ABI=1
  unset LIBTORCH_USE_PYTORCH LIBTORCH_INCLUDE LIBTORCH_LIB LIBTORCH_STATIC
  export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
  export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
  export AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
  # `cargo test`/`cargo run` for the target go through qemu; the test binaries sit in deps/, not
  # beside a lib/ directory, so the runner hands the directory of the libraries that run (those
  # the package ships: OpenBLAS, not the view's NVPL) to the emulated loader.
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$root/deploy/qemu-aarch64.sh"
  export EDGEMOE_AARCH64_LIBS="$libtorch_run_lib"
  # shellcheck disable=SC2016  # a literal $ORIGIN, for the dynamic loader
  export EDGEMOE_RPATH='$ORIGIN/lib'
  export CARGO_TARGET_DIR="$aarch64_target_dir"
}

if [ "${1:-}" = "--env" ]; then
  export_env
  for v in LIBTORCH LIBTORCH_CXX11_ABI CC_aarch64_unknown_linux_gnu CXX_aarch64_unknown_linux_gnu \
    AR_aarch64_unknown_linux_gnu CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER \
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER EDGEMOE_AARCH64_LIBS EDGEMOE_RPATH CARGO_TARGET_DIR; do
    printf 'export %s=%q\n' "$v" "${!v}"
  done
  exit 0
fi

if [ "${1:-}" = "--cross" ]; then
  shift
  command -v cross >/dev/null 2>&1 || die "cross is not installed (cargo install cross)"
  [ "$#" -gt 0 ] || set -- build --release --bin edgemoe
  sub="$1"
  shift
  # cross's default file name is Cross.toml; ours is cross.toml.
  export CROSS_CONFIG="$root/cross.toml"
  export CARGO_TARGET_DIR="$aarch64_target_dir"
  cd "$root"
  say "CROSS_CONFIG=cross.toml cross $sub --target $target $*"
  exec cross "$sub" --target "$target" "$@"
fi

ensure_rust_target
ensure_toolchain
fetch_libtorch "$cache" >/dev/null
export_env

if [ "$#" -eq 0 ]; then
  set -- build --release --bin edgemoe
fi
sub="$1"
shift
say "cargo $sub --target $target $* (target dir $CARGO_TARGET_DIR)"
cd "$root"
cargo "$sub" --target "$target" "$@"

if [ "$sub" = build ] && [ -x "$aarch64_bin" ]; then
  # Fails if the binary needs a library that neither the wheels nor the system provide.
  needed_closure "$aarch64_bin" "$libtorch_run_lib" >/dev/null
  say "built $aarch64_bin"
fi
