#!/usr/bin/env bash
# Stand-ins (`--stand-in`, issue 12 item 6): speed and ROUGE cost on the demo model.
#
# Speed: the first 20 SAMSum test dialogues, `summarize --storage emulate --profile P
# --buffer-experts N --max-new-tokens 40 --threads 1`, prefetch on, with no stand-ins, INT4 and
# INT2 stand-ins, and without stand-ins at equal memory (N + the stand-ins' bytes in slots);
# ROUNDS interleaved rounds, medians. Quality: `eval` on the first EVAL_N SAMSum test dialogues
# at rpi4-sd, N=6, the same three settings: ROUGE and how many summaries equal the run without.
# Usage: benches/stand_in.sh [OUT_DIR=target/stand-in]   (after ./setup.sh; env: BUNDLE,
#        PROFILES="rpi4-sd rpi5-sd", BUFFERS="6 10", ROUNDS=2, EVAL_N=200)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-target/stand-in}"
bundle="${BUNDLE:-bundles/demo}"
profiles="${PROFILES:-rpi4-sd rpi5-sd}"
buffers="${BUFFERS:-6 10}"
rounds="${ROUNDS:-2}"
eval_n="${EVAL_N:-200}"
bin="$root/target/release/edgemoe"
test_data="$root/../shared/data/samsum/test.jsonl"
[ -f "$bundle/config.json" ] || { echo "no bundle at $bundle (./setup.sh makes bundles/demo; calibrate it)" >&2; exit 2; }
cargo build --release --quiet
mkdir -p "$out"
head -20 "$test_data" > "$out/test20.jsonl"

# Slots the stand-ins' bytes would buy instead (nearest whole slot).
slots_for() { # bits
  "$bin" summarize --model "$bundle" --input "$out/test20.jsonl" --max-new-tokens 1 --stand-in "$1" \
    --buffer-experts 2 -q --stats-json "$out/probe-$1.json" >/dev/null
  python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(round(s['stand_in']['bytes'] / (s['buffer_bytes'] / s['buffer_slots'])))" "$out/probe-$1.json"
}
extra4=$(slots_for int4)
extra2=$(slots_for int2)

: > "$out/runs.tsv"
for round in $(seq 1 "$rounds"); do
  for profile in $profiles; do
    for n in $buffers; do
      for setting in off int4 int2 eq-int4 eq-int2; do
        args=(--buffer-experts "$n"); label="$setting"
        case "$setting" in
          int4|int2) args+=(--stand-in "$setting") ;;
          eq-int4) args=(--buffer-experts $((n + extra4))) ;;
          eq-int2) args=(--buffer-experts $((n + extra2))) ;;
        esac
        stats="$out/r$round-$profile-$n-$label.json"
        "$bin" summarize --model "$bundle" --input "$out/test20.jsonl" --storage emulate \
          --profile "$profile" --max-new-tokens 40 --threads 1 "${args[@]}" -q \
          --stats-json "$stats" >/dev/null
        printf '%s\t%s\t%s\t%s\t%s\n' "$round" "$profile" "$n" "$label" "$stats" >> "$out/runs.tsv"
      done
    done
  done
done

for setting in off int4 int2; do
  args=(); [ "$setting" = off ] || args=(--stand-in "$setting")
  "$bin" eval --model "$bundle" --data "$test_data" --limit "$eval_n" --storage emulate \
    --profile rpi4-sd --buffer-experts 6 --threads 1 --json "${args[@]}" \
    --predictions "$out/eval-$setting.txt" > "$out/eval-$setting.json"
done

python3 - "$out" "$extra4" "$extra2" "$eval_n" <<'PY'
import json, statistics, sys, hashlib
out, extra4, extra2, eval_n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
runs = {}
for line in open(f"{out}/runs.tsv"):
    rnd, profile, n, label, path = line.split()
    runs.setdefault((profile, int(n), label), []).append(json.load(open(path)))
def med(xs): return statistics.median(xs)
def digest(s): return hashlib.md5(str(s["output_ids"]).encode()).hexdigest()[:8]
print(f"demo model, 20 SAMSum test dialogues, 40 new tokens, prefetch on, 1 thread; medians of "
      f"{len(next(iter(runs.values())))} rounds. INT4 stand-ins = {extra4} slots of memory, INT2 = {extra2}.")
print("| profile | slots | stand-ins | decode ms/token | × off | encoder ms/doc | ms/doc (encoder + decode) | × off | stall ms/token | hit ratio | computed by stand-ins | outputs = off |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for (profile, n) in sorted({(p, n) for p, n, _ in runs}):
    off = runs[(profile, n, "off")]
    off_tok = med([s["decode_ms_per_token"] for s in off])
    off_doc = med([statistics.mean(x["sample_ms"] for x in s["samples"]) for s in off])
    for label in ["off", "int4", "int2", "eq-int4", "eq-int2"]:
        ss = runs[(profile, n, label)]
        tok = med([s["decode_ms_per_token"] for s in ss])
        enc = med([s["encode_ms"] / s["documents"] for s in ss])
        doc = med([statistics.mean(x["sample_ms"] for x in s["samples"]) for s in ss])
        stall = med([s["stall_ms_per_token"] for s in ss])
        hit = med([s["hit_ratio"] for s in ss])
        used = med([(s["stand_in"] or {}).get("used", 0) / max(1, s["expert_accesses"]) for s in ss])
        slots = ss[0]["buffer_slots"]
        name = {"off": "none", "int4": "INT4", "int2": "INT2",
                "eq-int4": "none (= INT4's memory)", "eq-int2": "none (= INT2's memory)"}[label]
        same = "yes" if all(digest(s) == digest(off[0]) for s in ss) else "no"
        print(f"| {profile} | {slots} | {name} | {tok:.2f} | {off_tok / tok:.2f}× | {enc:.0f} | {doc:.0f} | "
              f"{off_doc / doc:.2f}× | {stall:.1f} | {hit:.3f} | {100 * used:.0f}% | {same} |")
print()
print(f"ROUGE, first {eval_n} SAMSum test dialogues, rpi4-sd, 6 slots, prefetch on, 1 thread:")
print("| stand-ins | ROUGE-1 | ROUGE-2 | ROUGE-L | ROUGE-2 vs off | same text as off | decode ms/token |")
print("|---|---|---|---|---|---|---|")
ref = open(f"{out}/eval-off.txt").read().splitlines()
r2_off = json.load(open(f"{out}/eval-off.json"))["rouge"]["rouge2"]["fmeasure"]
for setting in ["off", "int4", "int2"]:
    s = json.load(open(f"{out}/eval-{setting}.json"))
    r = s["rouge"]
    pred = open(f"{out}/eval-{setting}.txt").read().splitlines()
    same = sum(a == b for a, b in zip(pred, ref))
    r2 = r["rouge2"]["fmeasure"]
    print(f"| {setting} | {100*r['rouge1']['fmeasure']:.2f} | {100*r2:.2f} | {100*r['rouge_l']['fmeasure']:.2f} | "
          f"{100 * (r2 - r2_off) / r2_off:+.1f}% | {same}/{len(ref)} | {s['run']['decode_ms_per_token']:.2f} |")
PY
