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
  echo "installing PyTorch 2.13.0 and the reference packages into $venv (about 5 GB, once)" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$root/tests/fixtures/requirements.txt"
fi
torch_dir="$("$venv/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))')"
ln -sfn "$torch_dir" "$venv/libtorch"
