#!/usr/bin/env bash
# Decoder-only row of BENCHMARKS.md: a random-weight OLMoE-1B-7B-shaped model with 2 layers under
# the rpi5-nvme profile (reads paced), edgemoe vs io-exp vs mmap, one prompt, 16 new tokens.
# Usage: benches/big_decoder.sh [OUT_DIR]   (after ./setup.sh)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-target/big}"
bin="$root/target/release/edgemoe"
cargo build --release --quiet
if [ ! -f "$out/olmoe-2l/config.json" ]; then
  .venv/bin/python benches/make_big_decoder.py "$out/olmoe-2l" --layers 2
fi
if [ ! -f "$out/olmoe-2l-bundle/config.json" ]; then
  "$bin" convert --hf "$out/olmoe-2l" --out "$out/olmoe-2l-bundle"
fi
"$bin" inspect "$out/olmoe-2l-bundle"
for mode in io-free io-exp mmap edgemoe; do
  "$bin" generate --model "$out/olmoe-2l-bundle" --prompt "Edge devices run mixture of experts" \
    --max-new-tokens 16 --mode "$mode" --profile rpi5-nvme --storage emulate --ids -q \
    --stats-json "$out/olmoe-2l-$mode.json" > "$out/olmoe-2l-$mode.ids"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
ref = open(f"{out}/olmoe-2l-io-free.ids").read()
rows = {}
for mode in ["io-free", "io-exp", "mmap", "edgemoe"]:
    s = json.load(open(f"{out}/olmoe-2l-{mode}.json"))
    rows[mode] = s
    same = open(f"{out}/olmoe-2l-{mode}.ids").read() == ref
    print(f"{mode:>8}: {s['decode_ms_per_token']:8.1f} ms/token, hit ratio {s['hit_ratio']:.3f}, "
          f"{s['bytes_read_per_token']/2**20:7.1f} MiB read/token, slots {s['buffer_slots']}, same ids {same}")
e = rows["edgemoe"]["decode_ms_per_token"]
for base in ["io-exp", "mmap", "io-free"]:
    print(f"edgemoe vs {base}: {rows[base]['decode_ms_per_token'] / e:.2f}x")
PY
