#!/usr/bin/env bash
# The next-layer predictors side by side (BENCHMARKS.md §13): precision and recall per MoE layer
# of the path dictionary, the gate lookahead and both, then decoding with prefetch driven by
# each (and off) on emulated storage at several buffer sizes: ms/token, hit ratio, stalls and
# the share of bytes read that speculation wasted. One run per cell, interleaved, on one machine.
#
# Usage: benches/predictors.sh BUNDLE [OUT_DIR]
#   BUNDLE must be calibrated (`edgemoe calibrate`); documents: SAMSum test (never used to
#   calibrate), DOCS of them (default 20). PROFILE (default rpi4-sd), BUFFERS (default
#   "6 10 16 24"), TOKENS (max new tokens, default 40).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="${1:?usage: benches/predictors.sh BUNDLE [OUT_DIR]}"
out="${2:-$root/target/bench-predictors}"
DOCS="${DOCS:-20}"
PROFILE="${PROFILE:-rpi4-sd}"
BUFFERS="${BUFFERS:-6 10 16 24}"
TOKENS="${TOKENS:-40}"
bin="$root/target/release/edgemoe"
mkdir -p "$out"
head -n "$DOCS" "$root/../shared/data/samsum/test.jsonl" > "$out/held-out.jsonl"

run() { # NAME ARGS...: one summarize run, its stats in $out/NAME.json
  local name="$1"
  shift
  "$bin" summarize --model "$bundle" --input "$out/held-out.jsonl" --max-new-tokens "$TOKENS" \
    --profile "$PROFILE" --storage emulate --stats-json "$out/$name.json" "$@" > "$out/$name.txt" 2> "$out/$name.err"
}

for slots in $BUFFERS; do
  run "off-$slots" --buffer-experts "$slots" --no-prefetch
  for p in dictionary gate both; do
    run "$p-$slots" --buffer-experts "$slots" --predictor "$p"
  done
  for p in dictionary gate both; do
    cmp -s "$out/off-$slots.txt" "$out/$p-$slots.txt" \
      || { echo "outputs differ: --predictor $p, $slots slots" >&2; exit 1; }
  done
done

python3 - "$out" "$BUFFERS" "$PROFILE" <<'EOF'
import json, sys
out, buffers, profile = sys.argv[1], sys.argv[2].split(), sys.argv[3]
load = lambda name: json.load(open(f"{out}/{name}.json"))
print(f"precision / recall per MoE layer (prefetch off, {buffers[0]} slots: every predictor scored)")
rows = {}
for s in load(f"off-{buffers[0]}")["predictors"]:
    rows.setdefault((s["stack"] != "encoder", s["block"]), {})[s["predictor"]] = s
print("| stack | block | dictionary P / R | gate P / R | both P / R |\n|---|---|---|---|---|")
for (dec, block), r in sorted(rows.items()):
    cell = lambda p: f"{r[p]['precision']:.3f} / {r[p]['recall']:.3f}" if p in r else "–"
    print(f"| {'decoder' if dec else 'encoder'} | {block} | {cell('dictionary')} | {cell('gate')} | {cell('both')} |")
print(f"\ndecoding, {profile} emulated, ms/token (hit ratio, stall ms/token, wasted % of bytes read)")
print("| slots | off | dictionary | gate | both |\n|---|---|---|---|---|")
for slots in buffers:
    cells = []
    for p in ["off", "dictionary", "gate", "both"]:
        s = load(f"{p}-{slots}")
        wasted = 100 * s["prefetch"]["wasted_bytes"] / max(1, s["bytes_read"])
        cells.append(f"{s['decode_ms_per_token']:.1f} ({s['hit_ratio']:.2f}, {s['stall_ms_per_token']:.1f}, {wasted:.0f}%)")
    print(f"| {slots} | " + " | ".join(cells) + " |")
EOF
