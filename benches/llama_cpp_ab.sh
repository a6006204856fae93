#!/usr/bin/env bash
# Decode (or, with PP=1, the prompt) of two or more edgemoe builds against llama.cpp,
# interleaved: each round runs llama-bench tg32 (-r 1) on GGUF, then every build's
# `generate --mode io-free` (8-id prompt, 32 new tokens) on BUNDLE, rotating the builds' order
# from round to round; prints each round's ms/token and engine/llama.cpp ratios. For A/B tests
# of a change on a shared machine, where the memory bandwidth left to a process moves within
# minutes (BENCHMARKS.md §9.12).
# Usage: benches/llama_cpp_ab.sh GGUF BUNDLE THREADS ROUNDS BIN...
#   e.g. benches/llama_cpp_ab.sh target/llama-bench/olmoe-2l-F16.gguf \
#          target/llama-bench/bundle-ef16-rf16 2 6 /tmp/edgemoe-before target/release/edgemoe
#   (after benches/llama_cpp.sh has built llama-bench and the files under target/llama-bench)
# DEPTH=N (env) decodes after N tokens of context instead: llama-bench `-d N`, the engine a
# prompt of N ids (its decode_ms_per_token leaves the prompt's prefill out, as tg does).
# PP=1 (env) measures the prompt instead: llama-bench pp512 (`-p 512 -n 0`) against the
# engine's 512-id prompt and one new token (512000 / encode_ms), in tokens/s, each ratio
# engine ÷ llama.cpp (higher is better).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 5 ] || { sed -n 2,10p "$0"; exit 2; }
gguf="$1" bundle="$2" threads="$3" rounds="$4"
shift 4
llama="$root/target/llama.cpp/build/bin/llama-bench"
depth="${DEPTH:-0}"
# Per mode: llama-bench's arguments, the prompt, the engine's new tokens, and how each side's
# figure is read (llama-bench JSON on stdin; the engine's --stats-json as `s`).
if [ "${PP:-0}" = 1 ]; then
  llama_args=(-p 512 -n 0)
  ids="$("$root/.venv/bin/python" "$root/benches/llama_cpp_table.py" ids 512 2)"
  new_tokens=1 unit=" t/s"
  llama_figure="round(json.load(sys.stdin)[0]['avg_ts'], 1)"
  engine_figure="round(512000 / s['encode_ms'], 1)"
else
  llama_args=(-p 0 -n 32 -d "$depth")
  ids="$("$root/.venv/bin/python" "$root/benches/llama_cpp_table.py" ids "$([ "$depth" -gt 0 ] && echo "$depth" || echo 8)" 1)"
  new_tokens=32 unit=""
  llama_figure="round(1000 / json.load(sys.stdin)[0]['avg_ts'], 2)"
  engine_figure="round(s['decode_ms_per_token'], 2)"
fi
stats="$(mktemp)"
trap 'rm -f "$stats"' EXIT
for r in $(seq 1 "$rounds"); do
  l="$("$llama" -m "$gguf" "${llama_args[@]}" -t "$threads" -r 1 -o json 2>/dev/null \
    | python3 -c "import json,sys; print($llama_figure)")"
  line="round $r: llama.cpp $l$unit"
  for bin in "$@"; do
    "$bin" generate --model "$bundle" --prompt-ids "$ids" --max-new-tokens "$new_tokens" \
      --mode io-free --threads "$threads" --ids -q --stats-json "$stats" > /dev/null
    e="$(python3 -c "import json; s = json.load(open('$stats')); print($engine_figure)")"
    line="$line | $bin $e ($(python3 -c "print(f'{$e / $l:.3f}')")x)"
  done
  echo "$line"
  set -- "${@:2}" "$1"
done
