#!/usr/bin/env bash
# Reproduces the expert-cache figures of BENCHMARKS.md on the demo model:
#  1. calibrates the path dictionary on SAMSum train (first $CALIB documents), measured on
#     validation;
#  2. records a trace of held-out text (SAMSum validation, $DOCS documents) and replays it through
#     every policy and buffer size, with Belady as the upper bound (table + SVG);
#  3. decode latency with prefetch off vs on at two budgets, expert reads bypassing the page
#     cache (O_DIRECT), as ratios measured in one run;
#  4. (BENCHMARKS.md §12) demand-only replays of held-out traces next to Belady: the step-2
#     trace, and the first 100 SAMSum test dialogues with the dictionary calibrated on the
#     first 200 train dialogues (`SKIP_S12=1` skips it).
# Usage: benches/cache.sh [OUT_DIR]   (after ./setup.sh; needs ../shared)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-target/bench-cache}"
CALIB="${CALIB:-400}"
DOCS="${DOCS:-50}"
data="$root/../shared/data/samsum"
bin="$root/target/release/edgemoe"
bundle="$out/bundle"
mkdir -p "$out"

cargo build --release --quiet
"$bin" convert --hf models/switch-samsum-tiny --out "$bundle" >/dev/null
echo "== calibrate: $CALIB train dialogues, measured on 100 validation dialogues"
"$bin" calibrate --model "$bundle" --data "$data/train.jsonl" --limit "$CALIB" \
  --eval-data "$data/validation.jsonl" --eval-limit 100 --json "$out/calibration.json"

# Held-out text: validation dialogues after the 100 used to measure the dictionary.
awk -v n="$DOCS" 'NR > 100 && NR <= 100 + n' "$data/validation.jsonl" > "$out/held-out.jsonl"

echo
echo "== trace of $DOCS held-out dialogues (demand paging: no prefetch), replayed"
"$bin" summarize --model "$bundle" --input "$out/held-out.jsonl" --buffer-experts 8 \
  --no-prefetch --trace "$out/trace.jsonl" -q > /dev/null
"$bin" replay --trace "$out/trace.jsonl" --slots 2,4,6,8,10,12,16,24,32,48,64 \
  --plot "$out/hit-ratio.svg"
"$bin" replay --trace "$out/trace.jsonl" --slots 2,4,6,8,10,12,16,24,32,48,64 --json \
  > "$out/replay.json"

echo
echo "== decode latency, prefetch off vs on, storage ${STORAGE:-direct}"
# Budgets: resident weights + working memory take about 85 MiB; 88 MiB leaves ~6 slots,
# 95 MiB ~20 slots.
# STORAGE=emulate PROFILE=rpi4-sd paces the reads to a Pi 4's SD card instead.
STORAGE="${STORAGE:-direct}"
PROFILE="${PROFILE:-rpi4-sd}"
for budget in 88MiB 95MiB; do
  for prefetch in off on; do
    flag=""; [ "$prefetch" = off ] && flag="--no-prefetch"
    "$bin" summarize --model "$bundle" --input "$out/held-out.jsonl" --budget "$budget" \
      --profile "$PROFILE" --storage "$STORAGE" $flag -q \
      --stats-json "$out/latency-$budget-$prefetch.json" > /dev/null
  done
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print(f"{'budget':>7} {'prefetch':>8} {'slots':>5} {'ms/token':>9} {'p90 ms':>7} {'stall ms/token':>14} "
      f"{'hit ratio':>9} {'MiB read/token':>14} {'issued':>6} {'useful':>6} {'wasted MiB':>10}")
rows = {}
for budget in ["88MiB", "95MiB"]:
    for prefetch in ["off", "on"]:
        s = json.load(open(f"{out}/latency-{budget}-{prefetch}.json"))
        rows[(budget, prefetch)] = s
        p = s["prefetch"]
        print(f"{budget:>7} {prefetch:>8} {s['buffer_slots']:>5} {s['decode_ms_per_token']:>9.2f} "
              f"{s['p90_ms']:>7.2f} {s['stall_ms_per_token']:>14.3f} {s['hit_ratio']:>9.3f} "
              f"{s['bytes_read_per_token']/2**20:>14.3f} {p['issued']:>6} {p['useful']:>6} "
              f"{p['wasted_bytes']/2**20:>10.1f}")
for budget in ["88MiB", "95MiB"]:
    off, on = rows[(budget, "off")], rows[(budget, "on")]
    print(f"{budget}: prefetch on / off decode ms per token = "
          f"{on['decode_ms_per_token'] / off['decode_ms_per_token']:.2f}, "
          f"stall = {on['stall_ms_per_token'] / max(off['stall_ms_per_token'], 1e-9):.2f}")
PY

if [ -z "${SKIP_S12:-}" ]; then
  echo
  echo "== §12: demand-only replays of held-out traces (validation 101-$((100 + DOCS)); test 1-100)"
  "$bin" replay --trace "$out/trace.jsonl" --slots 4,6,8,10,12,16,24,32 --demand-only
  s12="$out/s12"
  mkdir -p "$s12"
  "$bin" convert --hf models/switch-samsum-tiny --out "$s12/demo" >/dev/null
  "$bin" calibrate --model "$s12/demo" --data "$data/train.jsonl" --limit 200 >/dev/null
  head -100 "$data/test.jsonl" > "$s12/test100.jsonl"
  "$bin" summarize --model "$s12/demo" --input "$s12/test100.jsonl" --buffer-experts 8 \
    --no-prefetch --trace "$s12/trace-test.jsonl" -q > /dev/null
  "$bin" replay --trace "$s12/trace-test.jsonl" --slots 4,6,8,10,12,16,24,32 --demand-only
fi
