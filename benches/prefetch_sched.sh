#!/usr/bin/env bash
# Prefetch on vs off on emulated storage (BENCHMARKS.md §11, issue 12): for each profile and
# buffer size, `summarize` over DATA with and without --no-prefetch, 40 new tokens per dialogue,
# one compute thread; every build given runs each configuration back to back, so builds compare
# under the same machine load. One TSV row per run.
# Usage: benches/prefetch_sched.sh OUT.tsv BUNDLE DATA.jsonl LABEL=BINARY[@BUNDLE]...
#        (PROFILES="rpi4-sd rpi5-sd rpi5-nvme" BUFFERS="6 10 16 24" to narrow; a build's own
#        @BUNDLE replaces BUNDLE for it, e.g. the same model calibrated by another build)
set -euo pipefail
out=$1 bundle=$2 data=$3; shift 3
profiles=${PROFILES:-rpi4-sd rpi5-sd rpi5-nvme}
buffers=${BUFFERS:-6 10 16 24}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf 'build\tprofile\tbuffer\tprefetch\tms_per_token\thit_ratio\tstall_ms_per_token\tbytes_read\tprefetch_bytes\twasted_bytes\tids_md5\tms_per_document\tdecode_stall_ms_per_token\tdecode_misses_per_token\tdecoder_moe_layers\n' >"$out"
for p in $profiles; do
  for b in $buffers; do
    for build in "$@"; do
      label=${build%%=*} bin=${build#*=} model=$bundle
      case $bin in *@*) model=${bin#*@} bin=${bin%%@*} ;; esac
      for mode in on off; do
        flag=(); [ "$mode" = off ] && flag=(--no-prefetch)
        "$bin" summarize --model "$model" --input "$data" --profile "$p" --storage emulate \
          --buffer-experts "$b" --max-new-tokens 40 --beams 1 --threads 1 "${flag[@]}" \
          --stats-json "$tmp/s.json" -q >/dev/null
        python3 - "$tmp/s.json" "$label" "$p" "$b" "$mode" >>"$out" <<'PY'
import json, sys, hashlib
s = json.load(open(sys.argv[1]))
pf = s.get("prefetch", {})
ids = hashlib.md5(json.dumps(s["output_ids"]).encode()).hexdigest()[:8]
# Decoder MoE layers, and decoder steps (greedy: one per generated token).
dec = [l for l in s["per_layer"] if l["stack"] == "decoder"]
steps = max(1, s["tokens_generated"])
print("\t".join(map(str, [*sys.argv[2:6],
  round(s["decode_ms_per_token"], 2), round(s["hit_ratio"], 3),
  round(s.get("stall_ms_per_token", 0), 2), s["bytes_read"],
  pf.get("bytes_read", 0), pf.get("wasted_bytes", 0), ids,
  round(sum(x["sample_ms"] for x in s["samples"]) / max(1, len(s["samples"])), 1),
  round(s["decode_stall_ms_per_token"], 3),
  round(sum(l["accesses"] - l["hits"] for l in dec) / steps, 4), len(dec)])))
PY
      done
    done
  done
done
column -t "$out"
