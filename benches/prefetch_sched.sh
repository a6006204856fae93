#!/usr/bin/env bash
# Prefetch on vs off, emulated storage (BENCHMARKS.md §11): for each profile and buffer size,
# `summarize` over the held-out dialogues with and without --no-prefetch, 40 new tokens each.
# Usage: benches/prefetch_sched.sh BINARY BUNDLE DATA.jsonl OUT.tsv [profiles] [buffers]
set -euo pipefail
bin=$1 bundle=$2 data=$3 out=$4
profiles=${5:-rpi4-sd rpi5-sd rpi5-nvme}
buffers=${6:-6 10 16 24}
tmp=$(mktemp -d)
printf 'profile\tbuffer\tprefetch\tms_per_token\thit_ratio\tstall_ms_per_token\tbytes_read\tprefetch_bytes\twasted_bytes\tids_md5\n' >"$out"
for p in $profiles; do
  for b in $buffers; do
    for mode in on off; do
      flag=(); [ "$mode" = off ] && flag=(--no-prefetch)
      "$bin" summarize --model "$bundle" --input "$data" --profile "$p" --storage emulate \
        --buffer-experts "$b" --max-new-tokens 40 --threads 1 "${flag[@]}" \
        --stats-json "$tmp/s.json" -q >/dev/null
      python3 - "$tmp/s.json" "$p" "$b" "$mode" >>"$out" <<'PY'
import json, sys, hashlib
s = json.load(open(sys.argv[1]))
pf = s.get("prefetch", {})
ids = hashlib.md5(json.dumps(s["output_ids"]).encode()).hexdigest()[:8]
print("\t".join(map(str, [sys.argv[2], sys.argv[3], sys.argv[4],
  round(s["decode_ms_per_token"], 2), round(s["hit_ratio"], 3),
  round(s.get("stall_ms_per_token", 0), 2), s["bytes_read"],
  pf.get("bytes_read", 0), pf.get("wasted_bytes", 0), ids])))
PY
    done
  done
done
rm -rf "$tmp"
column -t "$out"
