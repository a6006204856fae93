#!/usr/bin/env bash
# Installs edgemoe on a board over ssh: copies the package made by deploy/package.sh (rsync when
# both ends have it, scp otherwise) and runs deploy/board-install.sh there with sudo, which
# unpacks it into /opt/edgemoe and installs the systemd units deploy/edgemoe.service (the
# on-demand job) and deploy/edgemoe-serve.service (the long-running service).
#
#   deploy/install.sh [options] user@host
#
#   --tarball FILE     the package (default: the newest in target/aarch64/dist; when there is none,
#                      deploy/package.sh makes one with bundles/switch-samsum-tiny if it exists)
#   --port N           ssh port
#   --profile, --budget, --device, --memory-max, --model, --prefix, --root, --host, --serve
#                      passed to board-install.sh (see `deploy/board-install.sh --help`;
#                      --serve starts the long-running service edgemoe-serve.service)
#   --service-port N   the service's port (board-install.sh's --port; --port is ssh's)
# EDGEMOE_SSH_OPTS     extra options for ssh, scp and rsync's ssh (e.g. "-i ~/.ssh/board")
set -euo pipefail
# shellcheck source=deploy/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

tarball=""
host=""
port=""
remote_args=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --tarball) tarball="${2:?}"; shift 2 ;;
    --port) port="${2:?}"; shift 2 ;;
    --prefix | --model | --profile | --budget | --device | --memory-max | --root | --host)
      remote_args+=("$1" "${2:?$1 needs a value}")
      shift 2
      ;;
    --service-port) remote_args+=(--port "${2:?--service-port needs a value}"); shift 2 ;;
    --serve) remote_args+=(--serve); shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$host" ] || die "one host only"; host="$1"; shift ;;
  esac
done
[ -n "$host" ] || die "usage: deploy/install.sh [options] user@host (see --help)"

if [ -z "$tarball" ]; then
  tarball="$(find "$aarch64_target_dir/dist" -maxdepth 1 -name "edgemoe-*-$target.tar.gz" -printf '%T@ %p\n' 2>/dev/null |
    sort -nr | head -n 1 | cut -d' ' -f2- || true)"
  if [ -z "$tarball" ]; then
    args=()
    [ -d "$root/bundles/switch-samsum-tiny" ] && args=(--bundle "$root/bundles/switch-samsum-tiny")
    tarball="$("$root/deploy/package.sh" "${args[@]}")"
  fi
fi
[ -f "$tarball" ] || die "no package at $tarball"

# shellcheck disable=SC2206  # EDGEMOE_SSH_OPTS is a list of options, split on purpose
ssh_opts=(${EDGEMOE_SSH_OPTS:-})
scp_opts=("${ssh_opts[@]}")
if [ -n "$port" ]; then
  ssh_opts+=(-p "$port")
  scp_opts+=(-P "$port")
fi

remote_dir="/tmp/edgemoe-install"
say "copying $(basename "$tarball") ($(du -h "$tarball" | cut -f1)) to $host:$remote_dir"
# shellcheck disable=SC2029  # $remote_dir is meant to expand here
ssh "${ssh_opts[@]}" "$host" "mkdir -p $remote_dir"
if command -v rsync >/dev/null 2>&1 && ssh "${ssh_opts[@]}" "$host" "command -v rsync" >/dev/null 2>&1; then
  rsync -a --partial --inplace -e "ssh ${ssh_opts[*]}" \
    "$tarball" "$root/deploy/board-install.sh" "$host:$remote_dir/"
else
  scp -q "${scp_opts[@]}" "$tarball" "$root/deploy/board-install.sh" "$host:$remote_dir/"
fi

say "installing on $host"
quoted="$(printf ' %q' "${remote_args[@]}")"
[ "${#remote_args[@]}" -gt 0 ] || quoted=""
# -t: sudo may ask for a password (a Jetson's default user), not on Raspberry Pi OS.
tty_opt=()
[ -t 0 ] && tty_opt=(-t)
# shellcheck disable=SC2029  # the command line is built here, arguments quoted with %q
ssh "${tty_opt[@]}" "${ssh_opts[@]}" "$host" \
  "sudo bash $remote_dir/board-install.sh $remote_dir/$(basename "$tarball")$quoted && rm -f $remote_dir/$(basename "$tarball")"
say "done"
