#!/usr/bin/env bash
# The engine against transformers eager (float32) on the switch-base-8 shape (random weights),
# one thread, a 353-token SAMSum dialogue, 32 greedy tokens: encoder ms and decode ms/token, for
# bundles converted at expert bits:resident dtype f32:f32, f16:f16 and 8:int8.
# Usage: benches/vs_transformers.sh [OUT_DIR] [extra vs_transformers.py options]
#   (after ./setup.sh; ../shared beside the repository; about 8 GB of disk under OUT_DIR)
#   PAIRS=f32:f32 benches/vs_transformers.sh    # only some pairs
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-target/vs-tf}"
shift || true
PAIRS="${PAIRS:-f32:f32,f16:f16,8:int8}"
python="${PYTHON:-$root/.venv/bin/python}"
cargo build --release --quiet
"$python" benches/vs_transformers.py --out "$out" --pairs "$PAIRS" "$@"
