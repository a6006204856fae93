#!/usr/bin/env bash
# Packages the aarch64 build for a board: a tarball whose top directory holds
#   edgemoe          the binary (stripped), rpath $ORIGIN/lib
#   lib/             exactly the libraries it loads (followed through DT_NEEDED from the binary):
#                    libtorch's from the unpacked wheels, nothing else of libtorch, and in place
#                    of the wheel's NVPL BLAS (ARMv8.1+ only) Debian's OpenBLAS behind two
#                    stand-ins (deploy/fetch-libtorch-aarch64.sh, fetch_blas)
#   licenses/        the licences of the OpenBLAS and libgfortran shipped in lib/
#   edgemoe.service  the systemd unit of the on-demand job that deploy/install.sh installs
#   edgemoe-serve.service  the unit of the long-running service (`edgemoe serve`)
#   profiles/        profiles/*.toml of the repository, when there are any
#   bundles/NAME/    a converted model bundle, with --bundle
#   MANIFEST         every file with its size and SHA-256
# It runs wherever it is unpacked: `./edgemoe summarize --model bundles/NAME --input doc.txt`.
#
# Usage: deploy/package.sh [--bundle DIR] [--out DIR] [--no-build]
#   --bundle DIR  include this bundle (made by `edgemoe convert`; the format does not depend on
#                 the architecture, so the x86_64 build can make it)
#   --out DIR     where the tarball goes (default target/aarch64/dist)
#   --no-build    use the binary already built instead of running deploy/build-aarch64.sh first
# Prints the tarball's path on standard output.
set -euo pipefail
# shellcheck source=deploy/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

bundle=""
out="$aarch64_target_dir/dist"
build=1
while [ "$#" -gt 0 ]; do
  case "$1" in
    --bundle) bundle="${2:?--bundle needs a directory}"; shift 2 ;;
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --no-build) build=0; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

if [ "$build" -eq 1 ]; then
  "$root/deploy/build-aarch64.sh" >&2
fi
[ -x "$aarch64_bin" ] || die "no aarch64 binary at $aarch64_bin: run deploy/build-aarch64.sh"
# The libraries to ship (already there after deploy/build-aarch64.sh; not after a cross build).
fetch_libtorch "$cache" >/dev/null
if [ -n "$bundle" ]; then
  for f in config.json resident.safetensors experts.bin tokenizer.json; do
    [ -f "$bundle/$f" ] || die "$bundle is not a bundle (no $f): make one with \`edgemoe convert\`"
  done
fi

version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -n 1)"
name="edgemoe-$version-$target"
stage="$aarch64_target_dir/package/$name"
rm -rf "$stage"
mkdir -p "$stage/lib" "$out"

install -m 755 "$aarch64_bin" "$stage/edgemoe"
if command -v aarch64-linux-gnu-strip >/dev/null 2>&1; then
  aarch64-linux-gnu-strip "$stage/edgemoe"
fi
closure="$(needed_closure "$stage/edgemoe" "$libtorch_run_lib")"
while read -r lib; do
  cp -L "$lib" "$stage/lib/"
done <<<"$closure"
install -m 644 "$root/deploy/edgemoe.service" "$stage/edgemoe.service"
install -m 644 "$root/deploy/edgemoe-serve.service" "$stage/edgemoe-serve.service"
mkdir -p "$stage/licenses"
cp "$(fetch_blas "$cache")"/licenses/* "$stage/licenses/"

shopt -s nullglob
profiles=("$root"/profiles/*.toml)
shopt -u nullglob
if [ "${#profiles[@]}" -gt 0 ]; then
  mkdir -p "$stage/profiles"
  cp "${profiles[@]}" "$stage/profiles/"
else
  say "note: no profiles/*.toml in the repository yet, so the package has no profile"
fi
if [ -n "$bundle" ]; then
  mkdir -p "$stage/bundles"
  cp -r "$bundle" "$stage/bundles/$(basename "$bundle")"
fi

manifest="$(
  cd "$stage"
  find . -type f | sed 's|^\./||' | LC_ALL=C sort | while read -r f; do
    printf '%s\t%s\t%s\n' "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)" "$f"
  done
)"
printf '%s\n' "$manifest" >"$stage/MANIFEST"

tarball="$out/$name.tar.gz"
tar -C "$(dirname "$stage")" --owner=0 --group=0 --numeric-owner -czf "$tarball.part" "$name"
mv "$tarball.part" "$tarball"

say "packaged $tarball ($(du -h "$tarball" | cut -f1)); contents, uncompressed:"
awk -F'\t' '{ printf "  %12d  %s\n", $1, $3; total += $1 } END { printf "  %12d  total\n", total }' \
  "$stage/MANIFEST" >&2
echo "$tarball"
