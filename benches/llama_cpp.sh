#!/usr/bin/env bash
# llama.cpp vs edgemoe at equal widths (issue 11), side by side on one random-weight
# OLMoE-1B-7B-shaped checkpoint with 2 layers (benches/make_big_decoder.py), CPU only:
#   - llama.cpp: the copy vendored in the llama-cpp-python sdist from PyPI (fetched, never
#     committed: MIT licence, its own), built CPU-only (GGML_NATIVE) into target/llama.cpp/;
#     GGUF F32, F16 and Q8_0 from convert_hf_to_gguf.py (through benches/llama_cpp_convert.py,
#     which only bypasses the pre-tokenizer hash check that refuses the random test tokenizer),
#     Q4_0 from llama-quantize --pure (every matrix Q4_0, output.weight included: equal bits; without
#     --pure it would keep output.weight at Q6_K); llama-bench -p 512 -n 32 -r $REPS -o json.
#   - engine: `edgemoe convert --bits B [--resident R]` bundles, `edgemoe generate --mode io-free`
#     (every expert in memory, no reads): tg = decode_ms_per_token with 32 new tokens after an
#     8-id prompt, pp = 512 / encode_ms (the prompt's one forward call) with a 512-id prompt;
#     $ENGINE_REPS runs each (default 1: a run takes ~1 min on 2 cores), means.
#   Pairs (GGUF type : engine expert width : engine resident width) are the list `pairs` below.
#   If this edgemoe has no `convert --resident` yet, bundles are converted without it (resident
#   weights stored as the checkpoint's bf16, computed in f32) and a note says so.
# Prints the GGUF tensor types and one table: tg ms/token and pp512 tokens/s of both, with
# ratios engine/llama.cpp, for every thread count in $THREADS (and with PAIRED_ROUNDS, a second
# table of interleaved decode rounds).
# Everything is cached under OUT_DIR and target/llama.cpp except the measurements.
# Usage: benches/llama_cpp.sh [OUT_DIR]   (after ./setup.sh; needs cmake and a C++ compiler,
#        and PyPI the first time)   env: THREADS="1 2" (default 1 and all cores), REPS=3 (llama-bench -r),
#        ENGINE_REPS=1, PAIRS="Q4_0 4 int8;Q4_0 4 int4" (only these GGUF | --bits | --resident),
#        LLAMA_CPP_PYTHON_VERSION=0.3.36 (the sdist whose vendor/llama.cpp is built),
#        EDGEMOE_BIN=target/release/edgemoe (another build, to compare two side by side),
#        PAIRED_ROUNDS=0 (N > 0: also N interleaved rounds of decode, llama.cpp and the engine
#        back to back, and the median of the rounds' ratios: the figure that holds on a shared
#        machine)
set -euo pipefail
started=$SECONDS
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${1:-target/llama-bench}"
bin="${EDGEMOE_BIN:-$root/target/release/edgemoe}"
py="$root/.venv/bin/python"
cores="$(nproc)"
threads="${THREADS:-$( [ "$cores" -gt 1 ] && echo "1 $cores" || echo 1 )}"
reps="${REPS:-3}"
engine_reps="${ENGINE_REPS:-1}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
# GGUF type | engine --bits | engine --resident. Q4_0 twice: the issue's pairing (INT8 resident)
# and equal bits (llama-quantize --pure makes every matrix Q4_0, the LM head included).
pairs=(
  "F32 f32 f32"
  "F16 f16 f16"
  "Q8_0 8 int8"
  "Q4_0 4 int8"
  "Q4_0 4 int4"
)
if [ -n "${PAIRS:-}" ]; then IFS=';' read -r -a pairs <<< "$PAIRS"; fi
mkdir -p "$out"

# --- llama.cpp: fetch the sdist, build llama-bench and llama-quantize once -----------------
lc="$root/target/llama.cpp"
src="$lc/src/llama_cpp_python-$version/vendor/llama.cpp"
build="$lc/build"
if [ ! -f "$src/convert_hf_to_gguf.py" ]; then
  mkdir -p "$lc/src"
  "$root/.venv/bin/pip" download --quiet --no-deps --no-binary llama-cpp-python \
    "llama-cpp-python==$version" -d "$lc/src"
  tar xzf "$lc/src/llama_cpp_python-$version.tar.gz" -C "$lc/src"
fi
if [ ! -x "$build/bin/llama-bench" ] || [ ! -x "$build/bin/llama-quantize" ] \
  || [ "$(cat "$build/edgemoe-built-from" 2>/dev/null)" != "$version" ]; then
  rm -rf "$build"
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON > "$lc/cmake-$version.log"
  cmake --build "$build" -j2 --target llama-bench llama-quantize > "$lc/build-$version.log"
  echo "$version" > "$build/edgemoe-built-from"
fi

# --- the checkpoint and its GGUF files ----------------------------------------------------
ckpt="$out/olmoe-2l"
if [ ! -f "$ckpt/config.json" ]; then
  "$py" benches/make_big_decoder.py "$ckpt" --layers 2
fi
for t in f32 f16 q8_0; do
  gguf="$out/olmoe-2l-${t^^}.gguf"
  if [ ! -f "$gguf" ]; then
    "$py" benches/llama_cpp_convert.py "$src" "$ckpt" --outtype "$t" --outfile "$gguf.tmp" \
      > "$out/convert-$t.log" 2>&1 || { tail -20 "$out/convert-$t.log"; exit 1; }
    mv "$gguf.tmp" "$gguf"
  fi
done
if [ ! -f "$out/olmoe-2l-Q4_0.gguf" ]; then
  "$build/bin/llama-quantize" --pure "$out/olmoe-2l-F32.gguf" "$out/olmoe-2l-Q4_0.gguf.tmp" Q4_0 \
    > "$out/quantize-q4_0.log" 2>&1 || { tail -20 "$out/quantize-q4_0.log"; exit 1; }
  mv "$out/olmoe-2l-Q4_0.gguf.tmp" "$out/olmoe-2l-Q4_0.gguf"
fi
echo "== GGUF tensor types (Q4_0: llama-quantize --pure from F32)"
PYTHONPATH="$src/gguf-py" "$py" benches/llama_cpp_table.py types \
  "$out"/olmoe-2l-{F32,F16,Q8_0,Q4_0}.gguf

# --- the engine's bundles -------------------------------------------------------------------
cargo build --release --quiet
has_resident=0
if "$bin" convert --help | grep -q -- '--resident'; then has_resident=1; fi
if [ "$has_resident" = 0 ]; then
  echo "note: this edgemoe has no 'convert --resident': engine bundles keep the checkpoint's bf16" \
    "resident weights (computed in f32); the resident width of each pair is NOT applied"
fi
# Each pair's bundle is $out/bundle-KEY; KEY also names its measurement files.
bundle_key() {
  if [ "$has_resident" = 1 ]; then echo "e$1-r$2"; else echo "e$1"; fi
}
labels=()
for pair in "${pairs[@]}"; do
  read -r gtype bits resident <<< "$pair"
  key="$(bundle_key "$bits" "$resident")"
  bundle="$out/bundle-$key"
  if [ "$has_resident" = 1 ]; then
    extra=(--resident "$resident")
    labels+=("$gtype|$key|experts $bits, resident $resident")
  else
    extra=()
    labels+=("$gtype|$key|experts $bits, resident bf16->f32 (wanted $resident)")
  fi
  if [ ! -f "$bundle/config.json" ]; then
    "$bin" convert --hf "$ckpt" --out "$bundle" --bits "$bits" "${extra[@]}" > /dev/null
  fi
done

# --- measurements ---------------------------------------------------------------------------
short="$("$py" benches/llama_cpp_table.py ids 8 1)"
long="$("$py" benches/llama_cpp_table.py ids 512 2)"
tlist="$(echo "$threads" | tr ' ' ',')"
load_start="$(cut -d' ' -f1-3 /proc/loadavg)"
benched=" "
for pair in "${pairs[@]}"; do
  read -r gtype bits resident <<< "$pair"
  key="$(bundle_key "$bits" "$resident")"
  if [[ "$benched" != *" $gtype "* ]]; then
    echo "== $gtype: llama-bench, threads $tlist"
    "$build/bin/llama-bench" -m "$out/olmoe-2l-$gtype.gguf" -p 512 -n 32 -t "$tlist" -r "$reps" \
      -o json > "$out/llama-bench-$gtype.json" 2> "$out/llama-bench-$gtype.log" \
      || { tail -20 "$out/llama-bench-$gtype.log"; exit 1; }
    benched+="$gtype "
  fi
  echo "== bundle-$key: edgemoe, threads $tlist"
  rm -f "$out/engine-$key"-t*.json
  for t in $threads; do
    for r in $(seq 1 "$engine_reps"); do
      "$bin" generate --model "$out/bundle-$key" --prompt-ids "$short" --max-new-tokens 32 \
        --mode io-free --threads "$t" --ids -q --stats-json "$out/engine-$key-t$t-tg-r$r.json" \
        > /dev/null
      "$bin" generate --model "$out/bundle-$key" --prompt-ids "$long" --max-new-tokens 1 \
        --mode io-free --threads "$t" --ids -q --stats-json "$out/engine-$key-t$t-pp-r$r.json" \
        > /dev/null
    done
  done
done

echo "== llama.cpp (llama-cpp-python $version sdist) vs edgemoe, $(uname -m), $cores cores;" \
  "tg: ms/token (lower is better), pp512: tokens/s (higher is better)"
"$py" benches/llama_cpp_table.py table "$out" "$threads" "${labels[@]}"

# --- decode, interleaved: PAIRED_ROUNDS rounds of llama.cpp and the engine back to back ------
paired_rounds="${PAIRED_ROUNDS:-0}"
if [ "$paired_rounds" -gt 0 ]; then
  rm -f "$out"/paired-*.json
  for pair in "${pairs[@]}"; do
    read -r gtype bits resident <<< "$pair"
    key="$(bundle_key "$bits" "$resident")"
    for t in $threads; do
      for r in $(seq 1 "$paired_rounds"); do
        llama_run() {
          "$build/bin/llama-bench" -m "$out/olmoe-2l-$gtype.gguf" -p 0 -n 32 -t "$t" -r 1 \
            -o json > "$out/paired-$gtype-t$t-r$r.json" 2>> "$out/llama-bench-$gtype.log"
        }
        engine_run() {
          "$bin" generate --model "$out/bundle-$key" --prompt-ids "$short" --max-new-tokens 32 \
            --mode io-free --threads "$t" --ids -q --stats-json "$out/paired-$key-t$t-r$r.json" \
            > /dev/null
        }
        if [ $((r % 2)) = 1 ]; then llama_run; engine_run; else engine_run; llama_run; fi
      done
    done
  done
  "$py" benches/llama_cpp_table.py paired "$out" "$threads" "$paired_rounds" "${labels[@]}"
fi
echo "load average (1/5/15 min) before the measurements: $load_start, after: $(cut -d' ' -f1-3 /proc/loadavg)" \
  "(anything else running on the machine skews these figures, multi-thread ones most)"
echo "total $((SECONDS - started)) s"
