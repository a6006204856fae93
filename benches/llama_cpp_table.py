"""Helpers of benches/llama_cpp.sh.

    llama_cpp_table.py types GGUF...          tensor types of each GGUF file (needs llama.cpp's
                                              gguf-py on PYTHONPATH)
    llama_cpp_table.py ids N SEED             N token ids (random, in the tiny test tokenizer's
                                              range, never an EOS id), comma separated
    llama_cpp_table.py table OUT THREADS PAIR...
                                              the side-by-side table from OUT's JSON files;
                                              THREADS "1 2"; PAIR "GGUF_TYPE|engine label"
    llama_cpp_table.py paired OUT THREADS ROUNDS PAIR...
                                              decode only, from the interleaved rounds
                                              (PAIRED_ROUNDS): each round's engine/llama.cpp ratio,
                                              their median and range

Figures: llama.cpp's are llama-bench's means over its repetitions (`-r`): tg = 1000 / avg_ts of
`tg32` (32 single-token decodes from an empty context), pp = avg_ts of `pp512` (one 512-token
batch). The engine's are means over the runs of `edgemoe generate --mode io-free`: tg =
`decode_ms_per_token` (mean of the decoder steps after the first new token, prompt of 8 ids, 32
new tokens), pp = `source_tokens` / `encode_ms` (`encode_ms` is the wall time of the prompt's
one forward call: 512 ids in, the last position's logits out; engine/generation/causal.rs).
"""

import collections
import glob
import json
import os
import random
import statistics
import sys


def types(paths):
    from gguf import GGUFReader
    for path in paths:
        reader = GGUFReader(path)
        counts = collections.Counter()
        named = {}
        weights = 0
        by_type = collections.Counter()
        for t in reader.tensors:
            name = t.tensor_type.name
            counts[name] += 1
            by_type[name] += int(t.n_elements)
            weights += int(t.n_elements)
            if t.name in ("output.weight", "token_embd.weight") or t.name.startswith("blk.0.ffn_") \
                    or t.name == "blk.0.attn_q.weight":
                named[t.name] = name
        share = ", ".join(f"{k} {v} tensors ({by_type[k] / weights:.1%} of weights)"
                          for k, v in sorted(counts.items()))
        layer0 = ", ".join(f"{k.removeprefix('blk.0.')} {v}" for k, v in sorted(named.items()))
        size = os.path.getsize(path) / 2**30
        print(f"{os.path.basename(path)}: {size:.2f} GiB; {share}; {layer0}")


def ids(n, seed):
    rng = random.Random(seed)
    # Ids 0 and 1 are <|endoftext|> (EOS) and <s>; the tokenizer has 320 entries.
    print(",".join(str(rng.randrange(2, 320)) for _ in range(n)))


def mean(values):
    return statistics.fmean(values) if values else float("nan")


def table(out, threads, pairs):
    rows = []
    notes = []
    for pair in pairs:
        gtype, key, label = pair.split("|", 2)
        bench = json.load(open(os.path.join(out, f"llama-bench-{gtype}.json")))
        for t in threads:
            tg_l = [r for r in bench if r["n_threads"] == t and r["n_gen"] > 0 and r["n_prompt"] == 0]
            pp_l = [r for r in bench if r["n_threads"] == t and r["n_prompt"] > 0 and r["n_gen"] == 0]
            for kind, rec in (("tg", tg_l), ("pp", pp_l)):
                if rec and rec[0]["stddev_ts"] > 0.1 * rec[0]["avg_ts"]:
                    notes.append(f"{gtype} t{t} {kind}: llama-bench's stddev is "
                                 f"{rec[0]['stddev_ts'] / rec[0]['avg_ts']:.0%} of its mean (noisy)")
            tg_llama = 1e3 / tg_l[0]["avg_ts"] if tg_l else float("nan")
            pp_llama = pp_l[0]["avg_ts"] if pp_l else float("nan")
            tg_runs = [json.load(open(p)) for p in
                       sorted(glob.glob(os.path.join(out, f"engine-{key}-t{t}-tg-r*.json")))]
            pp_runs = [json.load(open(p)) for p in
                       sorted(glob.glob(os.path.join(out, f"engine-{key}-t{t}-pp-r*.json")))]
            tg_engine = mean([s["decode_ms_per_token"] for s in tg_runs])
            pp_engine = mean([s["samples"][0]["source_tokens"] / (s["encode_ms"] / 1e3)
                              for s in pp_runs])
            for s in tg_runs:
                if s["tokens_generated"] != 32:
                    notes.append(f"{gtype} t{t}: the engine stopped after {s['tokens_generated']} "
                                 "tokens (EOS)")
            for s in pp_runs:
                if s["samples"][0]["source_tokens"] != 512:
                    notes.append(f"{gtype} t{t}: prompt of {s['samples'][0]['source_tokens']} tokens")
            rows.append((f"{gtype} | {label}", t, tg_llama, tg_engine, tg_engine / tg_llama,
                         pp_llama, pp_engine, pp_engine / pp_llama, len(tg_runs), len(pp_runs)))
    commit = bench[0].get("build_commit", "?") if bench else "?"
    print(f"llama.cpp build {commit}; engine/llama > 1 in tg and < 1 in pp: the engine is slower")
    width = max(len(r[0]) for r in rows)
    head = (f"{'llama.cpp GGUF | engine bundle':<{width}} | thr | tg ms/token: llama.cpp   engine"
            f"  engine/llama | pp512 tokens/s: llama.cpp   engine  engine/llama | engine runs tg/pp")
    print(head)
    print("-" * len(head))
    for name, t, tl, te, tr, pl, pe, pr, ntg, npp in rows:
        print(f"{name:<{width}} | {t:>3} | {tl:>22.2f} {te:>8.2f} {tr:>12.2f}x | {pl:>25.1f} "
              f"{pe:>8.1f} {pr:>12.3f}x | {ntg}/{npp}")
    for note in notes:
        print("note:", note)


def paired(out, threads, rounds, pairs):
    """Rounds alternate the two programs back to back, so both see the same machine: on a
    shared machine the memory bandwidth left to a process moves by ±20% within minutes, and a
    ratio of two means taken minutes apart moves with it. The median of the rounds' ratios is
    the figure to quote."""
    print(f"decode (tg32) in {rounds} interleaved rounds: llama-bench -p 0 -n 32 -r 1 and the "
          "engine back to back, alternating which goes first; ms/token")
    head = (f"{'llama.cpp GGUF | engine bundle':<40} | thr | llama.cpp median | engine median "
            "| engine/llama per round: median (min-max)")
    print(head)
    print("-" * len(head))
    for pair in pairs:
        gtype, key, label = pair.split("|", 2)
        for t in threads:
            llama, engine = [], []
            for r in range(1, rounds + 1):
                bench = json.load(open(os.path.join(out, f"paired-{gtype}-t{t}-r{r}.json")))
                llama.append(1e3 / bench[0]["avg_ts"])
                run = json.load(open(os.path.join(out, f"paired-{key}-t{t}-r{r}.json")))
                engine.append(run["decode_ms_per_token"])
            ratios = [e / l for e, l in zip(engine, llama)]
            print(f"{gtype + ' | ' + label:<40} | {t:>3} | {statistics.median(llama):>16.2f} "
                  f"| {statistics.median(engine):>14.2f} | {statistics.median(ratios):.3f}x "
                  f"({min(ratios):.3f}-{max(ratios):.3f})")


def main():
    cmd = sys.argv[1]
    if cmd == "types":
        types(sys.argv[2:])
    elif cmd == "ids":
        ids(int(sys.argv[2]), int(sys.argv[3]))
    elif cmd == "table":
        table(sys.argv[2], [int(t) for t in sys.argv[3].split()], sys.argv[4:])
    elif cmd == "paired":
        paired(sys.argv[2], [int(t) for t in sys.argv[3].split()], int(sys.argv[4]),
               sys.argv[5:])
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
