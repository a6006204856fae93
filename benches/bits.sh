#!/usr/bin/env bash
# Reproduces the bit-width table of BENCHMARKS.md on the demo model: store size and ROUGE-2 on
# SAMSum test for f16, all-INT8, all-INT4, all-INT2 and plans tuned on SAMSum validation at
# P = 1%, 5%, 10%, 20%; then decode latency per width measured in one run.
# Usage: benches/bits.sh [OUT_DIR]   (after ./setup.sh; needs ../shared)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-target/bench-bits}"
TUNE_LIMIT="${TUNE_LIMIT:-20}"
TEST_LIMIT="${TEST_LIMIT:-100}"
data="$root/../shared/data/samsum"
bin="$root/target/release/edgemoe"
mkdir -p "$out"
cargo build --release --quiet

"$bin" convert --hf models/switch-samsum-tiny --out "$out/f16" > /dev/null
for p in 1 5 10 20; do
  echo "== tune-bits P = $p% on $TUNE_LIMIT validation dialogues"
  "$bin" tune-bits --model "$out/f16" --data "$data/validation.jsonl" --limit "$TUNE_LIMIT" \
    --max-loss "$p%" --out "$out/plans/p$p.json"
done
for w in 8 4 2; do
  "$bin" convert --hf models/switch-samsum-tiny --out "$out/int$w" --bits "$w" > /dev/null
done
for p in 1 5 10 20; do
  "$bin" convert --hf models/switch-samsum-tiny --out "$out/p$p" --plan "$out/plans/p$p.json" > /dev/null
done

echo "== ROUGE on the first $TEST_LIMIT SAMSum test dialogues"
for b in f16 int8 int4 int2 p1 p5 p10 p20; do
  "$bin" eval --model "$out/$b" --data "$data/test.jsonl" --limit "$TEST_LIMIT" --no-prefetch \
    --storage cached --json > "$out/eval-$b.json"
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
base = json.load(open(f"{out}/eval-f16.json"))["rouge"]["rouge2"]["fmeasure"]
print(f"{'store':>6} {'expert store MiB':>16} {'ROUGE-1':>8} {'ROUGE-2':>8} {'ROUGE-L':>8} {'ROUGE-2 vs f16':>14}")
for b in ["f16", "int8", "int4", "int2", "p1", "p5", "p10", "p20"]:
    r = json.load(open(f"{out}/eval-{b}.json"))["rouge"]
    size = os.path.getsize(f"{out}/{b}/experts.bin") / 2**20
    r2 = r["rouge2"]["fmeasure"]
    print(f"{b:>6} {size:>16.2f} {100*r['rouge1']['fmeasure']:>8.2f} {100*r2:>8.2f} "
          f"{100*r['rougeL']['fmeasure'] if 'rougeL' in r else 100*r['rouge_l']['fmeasure']:>8.2f} "
          f"{(r2 - base) / base * 100 if base else 0:>+13.1f}%")
PY

echo "== decode latency per width (same 20 test dialogues, buffer of 8 experts, O_DIRECT)"
awk 'NR <= 20' "$data/test.jsonl" > "$out/latency.jsonl"
for b in f16 int8 int4 int2; do
  "$bin" summarize --model "$out/$b" --input "$out/latency.jsonl" --buffer-experts 8 \
    --no-prefetch --storage direct -q --stats-json "$out/latency-$b.json" > /dev/null
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
f16 = json.load(open(f"{out}/latency-f16.json"))
for b in ["f16", "int8", "int4", "int2"]:
    s = json.load(open(f"{out}/latency-{b}.json"))
    print(f"{b:>5}: {s['decode_ms_per_token']:.2f} ms/token ({s['decode_ms_per_token']/f16['decode_ms_per_token']:.2f}× f16), "
          f"{s['bytes_read_per_token']/2**10:.0f} KiB read/token, hit ratio {s['hit_ratio']:.3f}")
PY
