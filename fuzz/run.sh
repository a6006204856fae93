#!/usr/bin/env bash
# Builds the fuzz targets with AFL++ instrumentation (cargo-afl, stable toolchain) and fuzzes
# each for SECONDS (default 25), one after the other, from the committed corpus in fuzz/corpus/.
# Fails if any target records a crash (a panic, an abort, an allocation above 256 MiB) or a hang
# (an input running longer than AFL_TIMEOUT_MS, default 2000). Prints executions, paths found,
# crashes and hangs per target; findings stay in fuzz/out/<target>/default/{crashes,hangs}.
#
#   fuzz/run.sh [SECONDS] [TARGET...]      e.g. fuzz/run.sh 600 store paths
#
# Environment: AFL_TIMEOUT_MS; FUZZ_EXECS=N to stop a target after N executions instead of
# after SECONDS (the long run: FUZZ_EXECS=1000000 fuzz/run.sh 86400); FUZZ_NICE (default 19).
# Installs cargo-afl (pinned, from crates.io) when missing; AFL++ itself is built by cargo-afl.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
root="$(cd .. && pwd)"

seconds="${1:-25}"
shift || true
all=(store paths profile trace config manifest safetensors tokenizer jsonl)
targets=("${@:-${all[@]}}")
timeout_ms="${AFL_TIMEOUT_MS:-2000}"
nice_level="${FUZZ_NICE:-19}"

if ! cargo afl --version >/dev/null 2>&1; then
  echo "installing cargo-afl 0.18.2" >&2
  cargo install --locked cargo-afl --version 0.18.2
fi
# cargo-afl builds AFL++ on first use; `config --build` is a no-op when it is already built.
cargo afl config --build >/dev/null 2>&1 || true

# libtorch, as the engine finds it (.cargo/config.toml points LIBTORCH at .venv/libtorch).
export LIBTORCH="${LIBTORCH:-$root/.venv/libtorch}"
export LD_LIBRARY_PATH="$LIBTORCH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nice -n "$nice_level" cargo afl build --release --quiet

# Unattended runs: no UI, no CPU-governor or core-pattern demands, stop at the time limit.
export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1
export AFL_NO_AFFINITY=1
# A fresh output directory per run; the corpus (not previous findings) is the starting point.
failed=0
printf '%-12s %12s %9s %8s %8s %8s\n' target execs exec/s paths crashes hangs
for target in "${targets[@]}"; do
  out="out/$target"
  rm -rf "$out"
  mkdir -p "$out"
  limit=(-V "$seconds")
  if [ -n "${FUZZ_EXECS:-}" ]; then
    limit+=(-E "$FUZZ_EXECS")
  fi
  if ! nice -n "$nice_level" cargo afl fuzz "${limit[@]}" -t "$timeout_ms" -m none \
      -i "corpus/$target" -o "$out" "target/release/$target" > "$out/afl.log" 2>&1; then
    echo "$target: afl-fuzz failed:" >&2
    tail -20 "$out/afl.log" >&2
    failed=1
    continue
  fi
  stats="$out/default/fuzzer_stats"
  value() { sed -n "s/^$1 *: *//p" "$stats"; }
  crashes="$(find "$out/default/crashes" -type f -name 'id:*' | wc -l)"
  hangs="$(find "$out/default/hangs" -type f -name 'id:*' | wc -l)"
  printf '%-12s %12s %9s %8s %8s %8s\n' "$target" "$(value execs_done)" \
    "$(value execs_per_sec)" "$(value corpus_count)" "$crashes" "$hangs"
  if [ "$crashes" -gt 0 ] || [ "$hangs" -gt 0 ]; then
    echo "$target: findings in fuzz/$out/default/{crashes,hangs}" >&2
    failed=1
  fi
done
exit "$failed"
