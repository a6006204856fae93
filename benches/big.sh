#!/usr/bin/env bash
# The switch-base-8 shape (random weights) under the rpi4-sd and rpi5-nvme profiles:
# edgemoe vs io-exp, io-qexp, mmap and io-free as ratios measured in one run.
# Usage: benches/big.sh [OUT_DIR]   (after ./setup.sh; needs about 6 GB of disk)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-target/big}"
LIMIT="${LIMIT:-2}"
NEW_TOKENS="${NEW_TOKENS:-16}"
bin="$root/target/release/edgemoe"
cargo build --release --quiet
if [ ! -f "$out/switch-base-8/config.json" ]; then
  .venv/bin/python benches/make_big_switch.py "$out/switch-base-8" --experts 8
fi
if [ ! -f "$out/bundle-8/config.json" ]; then
  "$bin" convert --hf "$out/switch-base-8" --out "$out/bundle-8"
fi
"$bin" inspect "$out/bundle-8"
for profile in rpi4-sd rpi5-nvme; do
  echo "== $profile"
  "$bin" bench --model "$out/bundle-8" --data ../shared/data/samsum/test.jsonl --limit "$LIMIT" \
    --max-new-tokens "$NEW_TOKENS" --profile "$profile" \
    --modes io-free,io-exp,io-qexp,mmap,edgemoe,q,q+p,q+p+c --out "$out/bench-$profile"
done
