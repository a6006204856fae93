#!/usr/bin/env bash
# Installs a package made by deploy/package.sh on the board itself, as root. deploy/install.sh
# copies it over ssh together with the tarball and runs it; it can also be run by hand:
#
#   sudo ./board-install.sh edgemoe-VERSION-aarch64-unknown-linux-gnu.tar.gz [options]
#
#   --prefix DIR       where the package goes (default /opt/edgemoe)
#   --model DIR        the bundle the service uses (default: the one bundle in the package, or
#                      the one already installed)
#   --profile NAME     the board's profile (--profile): one of the package's profiles/NAME.toml
#                      (rpi5-sd, jetson-orin-nano-nvme...), a built-in name, or a TOML file
#   --budget SIZE      the engine's memory budget, --budget (default: the profile's, else 1.5GiB)
#   --device DEVICE    cpu or cuda, --device (default: the profile's, else cpu)
#   --memory-max SIZE  the units' MemoryMax= (default: the budget plus 512 MiB)
#   --serve            enable and start edgemoe-serve.service, the long-running HTTP service
#                      (`edgemoe serve`), now and at every boot
#   --host HOST        the address it listens on (default 127.0.0.1: loopback only)
#   --port N           its port (default 8080)
#   --root DIR         install into a root filesystem mounted at DIR (e.g. a board's SD card)
#                      instead of /: no systemctl, no trial run
#
# It replaces an earlier install in place (keeping bundles the new package does not carry),
# installs edgemoe.service (the on-demand job) and edgemoe-serve.service (the service), each
# with a drop-in for the model and the budget, creates the spool directory /var/spool/edgemoe,
# reloads systemd, and checks that the binary loads its libraries; with --serve it starts the
# service and waits until it answers /health.
set -euo pipefail

say() { echo "[board-install] $*" >&2; }
die() {
  say "error: $*"
  exit 1
}

tarball=""
prefix=/opt/edgemoe
model=""
profile=""
budget=""
device=""
memory_max=""
dest=""
serve=""
host=127.0.0.1
port=8080
while [ "$#" -gt 0 ]; do
  case "$1" in
    --prefix) prefix="${2:?}"; shift 2 ;;
    --model) model="${2:?}"; shift 2 ;;
    --profile) profile="${2:?}"; shift 2 ;;
    --budget) budget="${2:?}"; shift 2 ;;
    --device) device="${2:?}"; shift 2 ;;
    --memory-max) memory_max="${2:?}"; shift 2 ;;
    --root) dest="${2:?}"; shift 2 ;;
    --serve) serve=1; shift ;;
    --host) host="${2:?}"; shift 2 ;;
    --port) port="${2:?}"; shift 2 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) [ -z "$tarball" ] || die "one tarball only"; tarball="$1"; shift ;;
  esac
done
if [ -z "$tarball" ] || [ ! -f "$tarball" ]; then
  die "usage: board-install.sh TARBALL [options] (see --help)"
fi
case "$prefix" in /*) ;; *) die "--prefix must be an absolute path" ;; esac
if [ -n "$dest" ]; then
  dest="$(cd "$dest" && pwd)"
elif [ "$(id -u)" -ne 0 ]; then
  die "run as root (sudo)"
fi
if [ -z "$dest" ] && [ "$(uname -m)" != aarch64 ]; then
  say "warning: this machine is $(uname -m); the package is for aarch64"
fi

# Unpack beside the old install, then swap, so a failed unpack leaves the old one working.
target_dir="$dest$prefix"
mkdir -p "$(dirname "$target_dir")"
work="$(mktemp -d "$(dirname "$target_dir")/.edgemoe-install.XXXXXX")"
trap 'rm -rf "$work"' EXIT
tar -xzf "$tarball" -C "$work"
top="$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -n 1)"
if [ -z "$top" ] || [ ! -x "$top/edgemoe" ] || [ ! -f "$top/MANIFEST" ]; then
  die "$tarball is not an edgemoe package"
fi
(cd "$top" && sha256sum --quiet -c <(awk -F'\t' '{ print $2 "  " $3 }' MANIFEST)) ||
  die "$tarball: files differ from its MANIFEST"
if [ -d "$target_dir/bundles" ]; then
  mkdir -p "$top/bundles"
  for b in "$target_dir"/bundles/*/; do
    [ -d "$b" ] || continue
    name="$(basename "$b")"
    [ -e "$top/bundles/$name" ] || mv "$b" "$top/bundles/$name"
  done
fi
if [ -e "$target_dir" ]; then
  mv "$target_dir" "$work/old"
fi
mv "$top" "$target_dir"
say "installed $(basename "$top") in $target_dir"

if [ -z "$model" ]; then
  shopt -s nullglob
  bundles=("$target_dir"/bundles/*/)
  shopt -u nullglob
  if [ "${#bundles[@]}" -eq 1 ]; then
    model="$prefix/bundles/$(basename "${bundles[0]}")"
  elif [ "${#bundles[@]}" -eq 0 ]; then
    say "note: no bundle installed; copy one to $prefix/bundles/ and pass --model, or edit the drop-in"
    model="$prefix/bundles/switch-samsum-tiny"
  else
    model="$prefix/bundles/$(basename "${bundles[0]}")"
    say "note: several bundles installed; the service uses $model (--model chooses)"
  fi
fi

# A profile shipped in the package is used by its path; other names are the engine's built-ins.
profile_file=""
if [ -n "$profile" ] && [ -f "$target_dir/profiles/$profile.toml" ]; then
  profile_file="$target_dir/profiles/$profile.toml"
  profile="$prefix/profiles/$profile.toml"
elif [ -n "$profile" ] && [ -f "$dest$profile" ]; then
  profile_file="$dest$profile"
fi
# MemoryMax=: the budget in force (flag, else profile, else the engine's default) + 512 MiB.
if [ -z "$memory_max" ]; then
  size="$budget"
  if [ -z "$size" ] && [ -n "$profile_file" ]; then
    size="$(sed -n 's/^memory_budget *= *"\(.*\)".*/\1/p' "$profile_file" | head -n 1)"
  fi
  mib="$(awk -v s="${size:-1.5GiB}" 'BEGIN {
    n = s + 0; u = toupper(substr(s, length(n "") + 1))
    if (u ~ /^G/) n *= 1024; else if (u ~ /^K/) n /= 1024; else if (u !~ /^M/) n /= 1048576
    printf "%d", n + 512.5 }')"
  memory_max="${mib}M"
fi

unit_dir="$dest/etc/systemd/system"
mkdir -p "$dest/var/spool/edgemoe"
units=(edgemoe.service)
# Packages made before the service existed carry only the job's unit.
[ -f "$target_dir/edgemoe-serve.service" ] && units+=(edgemoe-serve.service)
if [ -n "$serve" ] && [ ! -f "$target_dir/edgemoe-serve.service" ]; then
  die "--serve: this package has no edgemoe-serve.service (make it again with deploy/package.sh)"
fi
for unit in "${units[@]}"; do
  mkdir -p "$unit_dir/$unit.d"
  sed "s|/opt/edgemoe|$prefix|g" "$target_dir/$unit" >"$unit_dir/$unit"
  {
    echo "# Written by board-install.sh; run it again with other options to change these."
    echo "[Service]"
    echo "Environment=EDGEMOE_MODEL=$model"
    echo "Environment=EDGEMOE_PROFILE=$profile"
    echo "Environment=EDGEMOE_BUDGET=$budget"
    echo "Environment=EDGEMOE_DEVICE=$device"
    if [ "$unit" = edgemoe-serve.service ]; then
      echo "Environment=EDGEMOE_HOST=$host"
      echo "Environment=EDGEMOE_PORT=$port"
    fi
    echo "MemoryMax=$memory_max"
  } >"$unit_dir/$unit.d/budget.conf"
  say "installed $unit_dir/$unit: model $model, profile ${profile:-none}," \
    "budget ${budget:-from the profile, else 1.5GiB}, device ${device:-from the profile, else cpu}," \
    "MemoryMax=$memory_max"
done

if [ -z "$dest" ]; then
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
  else
    say "note: systemd is not running here; the unit is in place for the next boot"
  fi
  if [ "$(uname -m)" = aarch64 ]; then
    "$target_dir/edgemoe" --version
    if [ -f "$model/config.json" ]; then
      "$target_dir/edgemoe" inspect "$model" | head -n 3
    fi
  fi
fi
if [ -n "$serve" ] && [ -n "$dest" ]; then
  mkdir -p "$unit_dir/multi-user.target.wants"
  ln -sfn ../edgemoe-serve.service "$unit_dir/multi-user.target.wants/edgemoe-serve.service"
  say "edgemoe-serve.service enabled: it starts at the board's next boot"
elif [ -n "$serve" ] && [ -d /run/systemd/system ]; then
  systemctl enable edgemoe-serve.service
  systemctl restart edgemoe-serve.service
  # The model loads before /health answers 200: seconds on a Raspberry Pi.
  for _ in $(seq 1 120); do
    if curl -fsS "http://$host:$port/health" 2>/dev/null; then
      echo
      say "edgemoe-serve is up on http://$host:$port/ (journalctl -u edgemoe-serve: its log)"
      exit 0
    fi
    sleep 1
  done
  die "edgemoe-serve did not answer http://$host:$port/health within 120 s: journalctl -u edgemoe-serve"
fi
say "next: put a document in /var/spool/edgemoe/input, then: systemctl start edgemoe;" \
  "cat /var/lib/edgemoe/summaries.txt; or the service: systemctl enable --now edgemoe-serve"
