#!/usr/bin/env bash
# Creates, or reuses when it is already right, the project's Python environment in .venv
# (ignored by git): PyTorch 2.13.0, whose libtorch the engine links through tch 0.26, and the
# pinned reference packages that produced the golden fixtures. `.venv/libtorch` points at the
# wheel's torch directory; .cargo/config.toml hands it to the build as LIBTORCH and build.rs
# records it as an rpath, so built binaries find libtorch without any exported variable.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "creating $venv" >&2
  "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" - <<'PY' 2>/dev/null
import sys, torch, transformers
ok = torch.__version__.split("+")[0] == "2.13.0" and transformers.__version__ == "5.23.0"
sys.exit(0 if ok else 1)
PY
then
  # The wheels (~3.5 GB) are unpacked beside the installed packages (~5 GB): refuse early, by
  # name, where that cannot fit instead of failing half-way through pip.
  need_kib=$((9 * 1024 * 1024))
  for dir in "$venv" "${TMPDIR:-/tmp}"; do
    free_kib="$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')"
    if [ "$free_kib" -lt "$need_kib" ]; then
      echo "error: installing PyTorch needs about 9 GiB free on the disk of $dir; it has $((free_kib / 1024)) MiB" >&2
      exit 1
    fi
  done
  echo "installing PyTorch 2.13.0 and the reference packages into $venv (about 5 GB, once)" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir \
    -r "$root/tests/fixtures/requirements.txt"
fi
torch_dir="$("$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
ln -sfn "$torch_dir" "$venv/libtorch"
