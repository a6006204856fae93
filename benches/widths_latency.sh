#!/usr/bin/env bash
# Decode latency of the demo model per expert width (issue 11: an INT4 store must be at least as
# fast as f16 once experts are computed in their stored encoding), the protocol of BENCHMARKS §4:
# the same 20 SAMSum test dialogues, a buffer of 8 experts, O_DIRECT reads, no prefetch, one
# compute thread; ROUNDS rounds (default 3) interleave the widths so that load from other work
# hits them alike; the table gives each width's median ms/token over the rounds.
# Usage: benches/widths_latency.sh [OUT_DIR=target/bench-bits]   (after ./setup.sh; needs ../shared)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-target/bench-bits}"
rounds="${ROUNDS:-3}"
bin="$root/target/release/edgemoe"
data="$root/../shared/data/samsum"
cargo build --release --quiet
mkdir -p "$out"
widths=(f16 8 4 2)
for w in "${widths[@]}"; do
  [ -f "$out/lat-$w/config.json" ] \
    || "$bin" convert --hf models/switch-samsum-tiny --out "$out/lat-$w" --bits "$w" > /dev/null
done
awk 'NR <= 20' "$data/test.jsonl" > "$out/latency.jsonl"
for r in $(seq 1 "$rounds"); do
  for w in "${widths[@]}"; do
    "$bin" summarize --model "$out/lat-$w" --input "$out/latency.jsonl" --buffer-experts 8 \
      --no-prefetch --storage direct --threads 1 -q --stats-json "$out/lat-$w-r$r.json" > /dev/null
  done
done
python3 - "$out" "$rounds" "${widths[@]}" <<'PY'
import json, statistics, sys
out, rounds, widths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
runs = {w: [json.load(open(f"{out}/lat-{w}-r{r}.json")) for r in range(1, rounds + 1)] for w in widths}
ms = {w: statistics.median(s["decode_ms_per_token"] for s in runs[w]) for w in widths}
print(f"demo model, 20 SAMSum test dialogues, 8-expert buffer, O_DIRECT, 1 thread, median of {rounds} rounds")
print(f"{'experts':>7} | ms/token | vs f16 | KiB read/token | hit ratio")
for w in widths:
    s = runs[w][0]
    print(f"{w:>7} | {ms[w]:8.2f} | {ms[w] / ms['f16']:5.2f}x | {s['bytes_read_per_token'] / 2**10:14.0f} | {s['hit_ratio']:.3f}")
PY
