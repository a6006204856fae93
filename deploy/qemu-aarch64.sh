#!/usr/bin/env bash
# Runs an aarch64 Linux program on another machine under qemu user-mode emulation (Debian's
# qemu-user-static), with the aarch64 sysroot of the cross toolchain as its library root.
# deploy/build-aarch64.sh makes it cargo's runner for the target, so `cargo test` works as usual.
#
#   deploy/qemu-aarch64.sh [QEMU_OPTIONS] PROGRAM ARGS...
#
# EDGEMOE_AARCH64_LIBS  directories (:-separated) the emulated loader searches first
#                       (LD_LIBRARY_PATH inside the emulation), e.g. libtorch for test binaries
# EDGEMOE_QEMU_CPU      CPU model: cortex-a76 (default; a Raspberry Pi 5's core), cortex-a72
#                       (a Raspberry Pi 4's), cortex-a57 (Jetson TX1/TX2/Nano), cortex-a53
#                       (Raspberry Pi 3), neoverse-n1, max. The package runs on all of them: it
#                       ships OpenBLAS for ARMv8.0, not the wheel's NVPL (ARMv8.1 atomics, SIGILL
#                       on the ARMv8.0 cores).
#
# libtorch reads the CPU's description from /proc/cpuinfo (pytorch's cpuinfo library), and the
# one qemu 7.2 leaves visible is the host's x86_64 one, on which it crashes. So the program runs
# in a private mount namespace where /proc/cpuinfo is that of the emulated core (as root, or
# through a user namespace otherwise).
set -euo pipefail
sysroot="${EDGEMOE_AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}"
cpu="${EDGEMOE_QEMU_CPU:-cortex-a76}"
command -v qemu-aarch64-static >/dev/null 2>&1 ||
  { echo "qemu-aarch64-static is missing: apt-get install qemu-user-static" >&2; exit 1; }
args=(-L "$sysroot" -cpu "$cpu")
if [ -n "${EDGEMOE_AARCH64_LIBS:-}" ]; then
  args+=(-E "LD_LIBRARY_PATH=$EDGEMOE_AARCH64_LIBS")
fi

# What a board with this core shows in /proc/cpuinfo (the fields cpuinfo parses): MIDR's variant,
# part and revision, and the kernel's hwcaps. The Raspberry Pis' BCM2711 (A72) and BCM2837 (A53)
# lack the crypto extension; the A57 is a Jetson's (Tegra X1/X2). ARMv8.0 cores have no `atomics`.
case "$cpu" in
  cortex-a53) variant=0x0 part=0xd03 revision=4 features="fp asimd evtstrm crc32 cpuid" ;;
  cortex-a57) variant=0x1 part=0xd07 revision=1 features="fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid" ;;
  cortex-a72) variant=0x0 part=0xd08 revision=3 features="fp asimd evtstrm crc32 cpuid" ;;
  cortex-a76) variant=0x4 part=0xd0b revision=1 features="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp" ;;
  neoverse-n1 | max) variant=0x3 part=0xd0c revision=1 features="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs" ;;
  *) echo "qemu-aarch64.sh: no /proc/cpuinfo description for the CPU model $cpu" \
    "(cortex-a53, cortex-a57, cortex-a72, cortex-a76, neoverse-n1, max)" >&2; exit 2 ;;
esac
ncpu="$(nproc --all)"
cpuinfo="${TMPDIR:-/tmp}/edgemoe-qemu-cpuinfo2.$cpu.$ncpu.$(id -u)"
if [ ! -s "$cpuinfo" ]; then
  for ((i = 0; i < ncpu; i++)); do
    printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: %s\nCPU implementer\t: 0x41\n' "$i" "$features"
    printf 'CPU architecture: 8\nCPU variant\t: %s\nCPU part\t: %s\nCPU revision\t: %s\n\n' "$variant" "$part" "$revision"
  done >"$cpuinfo.$$"
  mv "$cpuinfo.$$" "$cpuinfo"
fi

if [ "$(id -u)" -eq 0 ]; then
  ns=(unshare --mount --propagation private)
else
  ns=(unshare --user --map-root-user --mount --propagation private)
fi
# shellcheck disable=SC2016  # expanded by the inner shell
exec "${ns[@]}" sh -c 'mount --bind "$1" /proc/cpuinfo && shift && exec qemu-aarch64-static "$@"' \
  sh "$cpuinfo" "${args[@]}" "$@"
