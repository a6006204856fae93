#!/usr/bin/env bash
# Builds side by side on one decode: `summarize --mode io-free --threads 1` of the 353-token
# SAMSum dialogue that benches/vs_transformers.py prepares (run it once first: it writes the
# switch-base-8-shaped bundles and the document under target/vs-tf), 32 greedy tokens, rounds
# interleaving the builds so that load from other work hits them alike. Prints a line per run,
# then a table: each build's median p50 step and the median of each round's ratio to the first
# build, and the digests of the output ids (one digest: every build wrote the same tokens).
#
#   benches/decode_ab.sh ROUNDS LABEL=BINARY [LABEL=BINARY ...]
#   CFGS="8-int8:f16 f16-f16:f16" benches/decode_ab.sh 5 base=/tmp/edgemoe-base new=target/release/edgemoe
#
# CFGS: bundle:cache pairs (bundle-B under target/vs-tf, `--kv-cache` format); default below.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[ $# -ge 2 ] || { echo "usage: $0 ROUNDS LABEL=BINARY [LABEL=BINARY ...]" >&2; exit 2; }
rounds=$1
shift
dir=target/vs-tf
[ -f "$dir/doc-13829773.jsonl" ] || { echo "$dir/doc-13829773.jsonl not found: run benches/vs_transformers.py first" >&2; exit 2; }
t=$(mktemp -d)
trap 'rm -rf "$t"' EXIT
labels=()
for lb in "$@"; do labels+=("${lb%%=*}"); done
for r in $(seq 1 "$rounds"); do
  for cfg in ${CFGS:-8-int8:f16 8-int8:int8 f16-f16:f16 f32-f32:f32}; do
    bundle=${cfg%%:*}
    kv=${cfg##*:}
    for lb in "$@"; do
      label=${lb%%=*}
      bin=${lb#*=}
      "$bin" summarize --model "$dir/bundle-$bundle" --input "$dir/doc-13829773.jsonl" \
        --mode io-free --threads 1 --max-new-tokens 32 --max-source-tokens 353 --beams 1 \
        --no-repeat-ngram-size 0 --ids -q --stats-json "$t/stats.json" --kv-cache "$kv" > "$t/ids"
      python3 - "$t" "$r" "$bundle" "$kv" "$label" <<'PY' | tee -a "$t/runs.txt"
import hashlib, json, sys
t, r, bundle, kv, label = sys.argv[1:]
s = json.load(open(f"{t}/stats.json"))
digest = hashlib.md5(open(f"{t}/ids", "rb").read()).hexdigest()[:8]
print(f"{r} {bundle} {kv} {label} {s['p50_ms']:.2f} {s['decode_ms_per_token']:.2f} {digest}")
PY
    done
  done
done
python3 - "$t/runs.txt" "${labels[@]}" <<'PY'
import collections, statistics, sys
runs, labels = sys.argv[1], sys.argv[2:]
p50 = collections.defaultdict(dict)
digests = set()
for line in open(runs):
    r, bundle, kv, label, p, _mean, digest = line.split()
    p50[(bundle, kv)].setdefault(label, {})[r] = float(p)
    digests.add(digest)
print("| bundle | cache | " + " | ".join(f"{l} p50 ms (median, range)" for l in labels)
      + "".join(f" | {l} / {labels[0]}" for l in labels[1:]) + " |")
print("|---" * (2 + 2 * len(labels) - 1) + "|")
for (bundle, kv), by_label in sorted(p50.items()):
    cells = [bundle, kv]
    for l in labels:
        v = list(by_label[l].values())
        cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}–{max(v):.2f})")
    for l in labels[1:]:
        ratios = [x / by_label[labels[0]][r] for r, x in by_label[l].items()]
        cells.append(f"{statistics.median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f})")
    print("| " + " | ".join(cells) + " |")
print("output ids digests:", sorted(digests))
PY
