#!/usr/bin/env bash
# Runs the same commands with two builds of edgemoe and compares what they print: for a change
# that must not change behaviour (a refactor), every line should say "same".
#
#   benches/compare_builds.sh OLD_BINARY NEW_BINARY
#
# e.g. build the commit before the change in a git worktree (`git worktree add ../old REV`,
# `cargo build --release` there) and pass ../old/target/release/edgemoe and
# target/release/edgemoe. Uses the demo checkpoint, the tiny decoder-only fixtures and the
# first 20 SAMSum test dialogues from ../shared. Exits 1 if anything differs.
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OLD_BINARY NEW_BINARY" >&2; exit 2; }
old=$(realpath "$1"); new=$(realpath "$2")
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
samsum="$root/../shared/data/samsum/test.jsonl"
[ -f "$samsum" ] || { echo "$samsum not found" >&2; exit 2; }
t=$(mktemp -d); trap 'rm -rf "$t"' EXIT
head -n 20 "$samsum" > "$t/docs.jsonl"; head -n 5 "$samsum" > "$t/docs5.jsonl"
same=0; differ=0
verdict() { # name, old text, new text
  if [ "$2" == "$3" ]; then same=$((same+1)); echo "same    $1"
  else differ=$((differ+1)); echo "DIFFER  $1"; diff <(echo "$2") <(echo "$3") | head -5; fi
}
check() { # name, then the command with BIN where the binary goes (stdout, stderr, exit code)
  local name=$1; shift
  local a b
  a=$("${@/BIN/$old}" 2>&1; echo "exit $?")
  b=$("${@/BIN/$new}" 2>&1; echo "exit $?")
  verdict "$name" "$a" "$b"
}
for v in old new; do
  bin=$old; [ $v == new ] && bin=$new
  $bin convert --hf "$root/models/switch-samsum-tiny" --out "$t/$v/switch" >/dev/null
  $bin convert --hf "$root/models/switch-samsum-tiny" --out "$t/$v/switch4" --bits 4 >/dev/null
  for f in tiny-mixtral tiny-qwen2-moe tiny-olmoe; do
    $bin convert --hf "$root/tests/fixtures/$f" --out "$t/$v/$f" >/dev/null
  done
done
for b in switch switch4 tiny-mixtral tiny-qwen2-moe tiny-olmoe; do
  verdict "convert $b: every bundle file" "$(cd "$t/old/$b" && sha256sum ./*)" "$(cd "$t/new/$b" && sha256sum ./*)"
  check "inspect $b" BIN inspect "$t/new/$b"
done
m="$t/new/switch"
for budget in 1.5GiB 88MiB 60MiB; do
  for policy in edgemoe lru lfu fifo; do
    check "summarize 20 dialogues, budget $budget, policy $policy" BIN summarize --model "$m" --input "$t/docs.jsonl" --budget "$budget" --policy "$policy" --ids -q
  done
  check "summarize 20 dialogues, beam 4, budget $budget" BIN summarize --model "$m" --input "$t/docs.jsonl" --budget "$budget" --beams 4 --ids -q
  check "summarize 20 dialogues as text, INT4 store, budget $budget" BIN summarize --model "$t/new/switch4" --input "$t/docs.jsonl" --budget "$budget" -q
done
for mode in io-free io-exp mmap edgemoe; do
  check "summarize 5 dialogues, mode $mode" BIN summarize --model "$m" --input "$t/docs5.jsonl" --mode "$mode" --ids -q
done
for mode in io-qexp q q+p q+p+c; do
  check "summarize 5 dialogues, mode $mode" BIN summarize --model "$m" --quantized "$t/new/switch4" --input "$t/docs5.jsonl" --mode "$mode" --ids -q
done
counters() { # the deterministic part of --stats-json (no prefetch thread)
  $1 summarize --model "$m" --input "$t/docs.jsonl" --budget 88MiB --no-prefetch --ids -q --stats-json "$t/s.json" >/dev/null &&
    python3 -c "import json; d=json.load(open('$t/s.json')); print(sorted(d)); print({k: d[k] for k in ['expert_accesses', 'hits', 'misses', 'bytes_read', 'buffer_slots', 'budget_bytes', 'resident_bytes', 'working_bytes', 'output_ids', 'per_layer']})"
}
verdict "--stats-json keys and cache counters (88MiB, no prefetch)" "$(counters "$old")" "$(counters "$new")"
for f in tiny-mixtral tiny-qwen2-moe tiny-olmoe; do
  check "generate $f, greedy" BIN generate --model "$t/new/$f" --prompt-ids 5,6,7,8 --max-new-tokens 24 --ids -q
  check "generate $f, top-p seed 7" BIN generate --model "$t/new/$f" --prompt-ids 5,6,7,8 --max-new-tokens 24 --temperature 0.8 --top-p 0.9 --seed 7 --ids -q
  check "generate $f, 2-slot buffer" BIN generate --model "$t/new/$f" --prompt-ids 5,6,7,8 --max-new-tokens 24 --buffer-experts 2 --ids -q
done
rouge() { $1 eval --model "$m" --data "$t/docs.jsonl" --stem --json | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["rouge"], d["run"]["output_ids"])'; }
verdict "eval: ROUGE and ids of 20 dialogues" "$(rouge "$old")" "$(rouge "$new")"
# Inputs longer than the token limit: the first tokens of a document, the last of a prompt.
python3 - "$t" <<'PY'
import json, sys
t = sys.argv[1]
docs = [json.loads(l)["dialogue"] for l in open(f"{t}/docs.jsonl")]
open(f"{t}/long.txt", "w").write("\n".join(docs))
with open(f"{t}/long.jsonl", "w") as f:
    for i in range(0, 20, 4):
        f.write(json.dumps({"dialogue": "\n".join(docs[i:i + 4]), "summary": docs[i][:80]}) + "\n")
PY
check "summarize a long document (first 512 tokens)" BIN summarize --model "$m" --input "$t/long.txt" --ids -q
check "summarize a long document (first 100 tokens)" BIN summarize --model "$m" --input "$t/long.txt" --max-source-tokens 100 --ids -q
calibrated() { # calibrate a copy of a decoder-only bundle on long documents (their last tokens)
  rm -rf "$t/cal" && cp -r "$t/new/$2" "$t/cal" &&
    $1 calibrate --model "$t/cal" --data "$t/long.jsonl" --eval-data "$t/long.jsonl" 2>/dev/null | grep -v '^wrote'
}
# (paths.bin's bytes follow hash-map order, which differs run to run; its held-out accuracy in
# the report does not.)
for f in tiny-mixtral tiny-qwen2-moe; do
  verdict "calibrate $f on long documents (report, held-out accuracy)" "$(calibrated "$old" $f)" "$(calibrated "$new" $f)"
done
tuned() { # tune-bits on a decoder-only bundle: the printed result and the plan
  rm -rf "$t/tune" && mkdir "$t/tune" &&
    $1 tune-bits --model "$t/new/tiny-mixtral" --data "$t/long.jsonl" --max-loss 10% --max-new-tokens 12 --out "$t/tune/plan.json" 2>/dev/null | grep -v '^wrote' &&
    cat "$t/tune/plan.json"
}
verdict "tune-bits tiny-mixtral on long documents (result and plan)" "$(tuned "$old")" "$(tuned "$new")"
check "summarize with a decoder-only bundle (refused)" BIN summarize --model "$t/new/tiny-olmoe" --input "$t/docs5.jsonl"
check "generate with a Switch bundle (refused)" BIN generate --model "$m" --prompt-ids 5,6
check "a budget too small" BIN summarize --model "$m" --input "$t/docs5.jsonl" --budget 20MiB
echo "== $same same, $differ different"
[ $differ -eq 0 ]
