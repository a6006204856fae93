#!/usr/bin/env bash
# ROUGE of the demo model (switch-samsum-tiny, ../shared) on SAMSum test at every resident width
# and at INT8/INT4 experts, against the f32 reference (issue 11: where quantizing the non-expert
# weights starts to hurt). Each bundle is converted from the checkpoint and run with
# `edgemoe eval --mode io-free` (all experts in memory) on the first N dialogues.
# Usage: benches/widths_rouge.sh [N=200] [OUT_DIR=target/widths]   (after ./setup.sh)
#   RUNS="f32 f32;f32 int4" benches/widths_rouge.sh   # only these experts|resident pairs
#   RUNS="f32 f32;8 int8 int8" benches/widths_rouge.sh  # a third field: the run's --kv-cache
#   (the first pair, f32 f32, is the reference the others are compared with)
#   EDGEMOE_BIN=/tmp/edgemoe-before benches/widths_rouge.sh 200 target/widths-before
#   (another build, not rebuilt; bundles are converted by it, so give each build its own OUT_DIR)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
n="${1:-200}"
out="${2:-target/widths}"
bin="${EDGEMOE_BIN:-$root/target/release/edgemoe}"
ckpt="$root/../shared/models/switch-samsum-tiny"
data="$root/../shared/data/samsum/test.jsonl"
[ -n "${EDGEMOE_BIN:-}" ] || cargo build --release --quiet
mkdir -p "$out"
# experts (--bits) | resident (--resident)
runs=("f32 f32" "f16 f16" "bf16 bf16" "f32 int8" "8 f32" "4 f32" "8 int8" "4 int8" "f32 int4" "4 int4")
if [ -n "${RUNS:-}" ]; then IFS=';' read -r -a runs <<< "$RUNS"; fi
name() { # experts resident [kv-cache]
  if [ "${3:-f32}" = f32 ]; then echo "e$1-r$2"; else echo "e$1-r$2-kv$3"; fi
}
for run in "${runs[@]}"; do
  read -r bits resident kv <<<"$run"
  kv="${kv:-f32}"
  b="$out/e$bits-r$resident"
  [ -f "$b/config.json" ] || "$bin" convert --hf "$ckpt" --out "$b" --bits "$bits" --resident "$resident" >/dev/null
  "$bin" eval --model "$b" --data "$data" --limit "$n" --mode io-free --threads 1 --json \
    --kv-cache "$kv" --predictions "$out/$(name $bits $resident $kv).txt" \
    > "$out/$(name $bits $resident $kv).json"
done
python3 - "$out" "$n" "${runs[@]}" <<'PY'
import json, sys
out, n, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
ref = open(f"{out}/ef32-rf32.txt").read().splitlines()
print(f"SAMSum test, first {n} dialogues, greedy/beam as the model's generation config, io-free, 1 thread")
print(f"{'experts':>7} {'resident':>8} {'kv':>4} | {'R-1':>6} {'R-2':>6} {'R-L':>6} | same text as f32 | ms/token")
for run in runs:
    bits, res, kv = (run.split() + ["f32"])[:3]
    name = f"e{bits}-r{res}" + ("" if kv == "f32" else f"-kv{kv}")
    s = json.load(open(f"{out}/{name}.json"))
    r = s["rouge"]
    pred = open(f"{out}/{name}.txt").read().splitlines()
    same = sum(a == b for a, b in zip(pred, ref))
    print(f"{bits:>7} {res:>8} {kv:>4} | {100*r['rouge1']['fmeasure']:6.2f} {100*r['rouge2']['fmeasure']:6.2f} "
          f"{100*r['rouge_l']['fmeasure']:6.2f} | {same:4d}/{len(ref)} | {s['run']['decode_ms_per_token']:.2f}")
PY
