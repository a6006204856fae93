"""The engine against transformers (eager, float32) on the switch-base-8 shape, one thread.

The same random-weight switch-base-8-shaped checkpoint (benches/make_big_switch.py), the same
SAMSum dialogue ("summarize: " + the dialogue with its line breaks turned into spaces, truncated
to --source-tokens tokens, 353 by default, with its </s>), the same greedy decoding of
--new-tokens tokens (32):

  transformers  SwitchTransformersForConditionalGeneration, float32 weights, eager attention,
                torch.set_num_threads(1): encoder time (one run per round, after one untimed
                warm-up), and the decoder's per-step time (median and mean over the greedy steps,
                a step being one forward of the last token with the KV cache, use_cache=True, +
                its argmax). Greedy runs the full --new-tokens steps (no stop at EOS).
  engine        `edgemoe convert --hf CKPT --out B --bits X --resident Y` for each pair X:Y of
                --pairs (default f32:f32, f16:f16, 8:int8; without `--resident` where the binary
                does not accept it yet, noted in the table), then `edgemoe summarize --mode
                io-free --threads 1 --max-new-tokens N --max-source-tokens S --beams 1
                --stats-json F`, one run per pair per round: `encode_ms`, `p50_ms` (median step)
                and `decode_ms_per_token` (mean step). io-free holds every
                expert in memory: no storage reads, so this compares compute only. (When this
                was written io-free decoded every expert to f32 at load and `--resident` did not
                exist yet, so the three pairs computed the same f32 math.) The engine
                stops at EOS: its token count is printed, and whether its ids equal
                transformers' greedy ids (a weak check: the random checkpoint's greedy output is
                id 0 repeated; its cost per step is what matters here).

With --beams N (N > 1) both sides run beam search instead (N beams, length penalty 1, early
stopping off: the checkpoint's generation config, as the engine's bundle has it; no n-gram ban;
up to --new-tokens tokens): transformers' `generate(encoder_outputs=..., num_beams=N)`
timed as a whole, its mean step being that time over the steps it ran (no median: generate's
steps are not timed one by one), against the engine's `--beams N` mean step
(`decode_ms_per_token`); the table's p50 column then repeats the mean for transformers.

--rounds rounds (3) interleave the two sides (transformers, then each pair), so that load from
other work on the machine hits both alike; the table gives the median over the rounds (encoder:
median of 3 runs; decode: median of the rounds' median steps) and the best round. Speedups are
transformers / engine, on the median step (`p50_ms`) and on the mean step (the engine's
`decode_ms_per_token`). Last, each round's own encoder and p50 ratios and their median: the
steadier figure when the machine's load moves from round to round.

The checkpoint, the bundles, the document (as JSON lines) and the results
(vs_transformers.json) are cached under --out (target/vs-tf, ignored by git); the SAMSum data is
read from ../shared at run time, never copied into the repository.

Usage (after ./setup.sh and cargo build --release; ~8 GB of disk under --out, ~2 minutes with cached bundles):
    benches/vs_transformers.sh            # or:
    .venv/bin/python benches/vs_transformers.py [--pairs f32:f32,8:int8:int8] [--rounds 5] [--out target/vs-tf]
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import transformers
from transformers import PreTrainedTokenizerFast, SwitchTransformersForConditionalGeneration

assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
assert transformers.__version__ == "5.23.0", transformers.__version__

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared")


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def document(split, doc_id):
    path = os.path.join(SHARED, "data", "samsum", f"{split}.jsonl")
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row["id"] == doc_id:
                return row["dialogue"]
    sys.exit(f"no dialogue with id {doc_id} in {path}")


def model_input(dialogue):
    # as engine/generation/input.rs model_input and tests/fixtures/make_samsum_golden.py
    return "summarize: " + dialogue.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")


class Transformers:
    """The transformers side, loaded once and measured once per round."""

    def __init__(self, ckpt, ids):
        torch.set_num_threads(1)
        self.model = SwitchTransformersForConditionalGeneration.from_pretrained(
            ckpt, dtype=torch.float32, attn_implementation="eager").eval()
        self.x = torch.tensor([ids])
        self.mask = torch.ones_like(self.x)
        self.encode()  # warm-up, not timed

    def encode(self):
        with torch.no_grad():
            t = time.perf_counter()
            encoder_outputs = self.model.get_encoder()(input_ids=self.x, attention_mask=self.mask)
            return encoder_outputs, (time.perf_counter() - t) * 1e3

    def round(self, new_tokens, beams=1):
        """One encoder run and `new_tokens` greedy steps with the KV cache, each timed; or, with
        `beams` > 1, one beam search timed as a whole."""
        encoder_outputs, encode_ms = self.encode()
        if beams > 1:
            with torch.no_grad():
                t = time.perf_counter()
                out = self.model.generate(encoder_outputs=encoder_outputs, attention_mask=self.mask,
                                          num_beams=beams, max_new_tokens=new_tokens, do_sample=False,
                                          length_penalty=1.0, no_repeat_ngram_size=0, early_stopping=False)
                total_ms = (time.perf_counter() - t) * 1e3
            tokens = out[0, 1:].tolist()  # after the decoder start token
            mean = total_ms / max(len(tokens), 1)
            return {"encode_ms": encode_ms, "p50_ms": mean, "decode_ms_per_token": mean,
                    "step_ms": [mean], "tokens": tokens}
        token, past, steps, tokens = self.model.generation_config.decoder_start_token_id, None, [], []
        with torch.no_grad():
            for _ in range(new_tokens):
                t = time.perf_counter()
                out = self.model(encoder_outputs=encoder_outputs, attention_mask=self.mask,
                                 decoder_input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                steps.append((time.perf_counter() - t) * 1e3)
                tokens.append(token)
        return {"encode_ms": encode_ms, "p50_ms": statistics.median(steps),
                "decode_ms_per_token": statistics.fmean(steps), "step_ms": steps, "tokens": tokens}


def accepts_resident(binary):
    help_text = subprocess.run([binary, "convert", "--help"], capture_output=True, text=True, check=True).stdout
    return "--resident" in help_text


class Engine:
    """One bits:resident pair: its bundle (converted once, cached) and one summarize run per round."""

    def __init__(self, binary, ckpt, out, pair, resident_ok, doc_path, source_tokens, new_tokens, reconvert,
                 beams=1):
        self.binary, self.out, self.doc_path, self.beams = binary, out, doc_path, beams
        self.source_tokens, self.new_tokens = source_tokens, new_tokens
        self.bits, resident = pair[:2]
        self.kv_cache = pair[2] if len(pair) > 2 else None  # --kv-cache, when a third field names one
        self.resident = None
        if resident_ok:
            # A --resident the binary accepts but refuses for this width falls back to none.
            self.resident = resident if self.convert(ckpt, f"bundle-{self.bits}-{resident}", reconvert,
                                                     ["--resident", resident]) else None
        if self.resident is None:
            if not self.convert(ckpt, f"bundle-{self.bits}-noresident", reconvert, []):
                sys.exit(f"edgemoe convert --bits {self.bits} failed")
        if self.kv_cache:
            self.name += f"-kv{self.kv_cache}"

    def convert(self, ckpt, name, reconvert, extra):
        self.name, self.bundle = name, os.path.join(self.out, name)
        if reconvert:
            shutil.rmtree(self.bundle, ignore_errors=True)
        if os.path.exists(os.path.join(self.bundle, "config.json")):
            return True
        cmd = [self.binary, "convert", "--hf", ckpt, "--out", self.bundle, "--bits", self.bits] + extra
        log("$ " + " ".join(cmd))
        t = time.perf_counter()
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
            log(f"convert failed{': trying without --resident' if extra else ''}")
            shutil.rmtree(self.bundle, ignore_errors=True)
            return False
        log(f"converted in {time.perf_counter() - t:.0f} s")
        return True

    def round(self, i):
        stats_path = os.path.join(self.out, f"stats-{self.name}-{i}.json")
        cmd = [self.binary, "summarize", "--model", self.bundle, "--input", self.doc_path, "--mode", "io-free",
               "--threads", "1", "--max-new-tokens", str(self.new_tokens),
               "--max-source-tokens", str(self.source_tokens), "--beams", str(self.beams), "--no-repeat-ngram-size", "0",
               "--ids", "-q", "--stats-json", stats_path] + (["--kv-cache", self.kv_cache] if self.kv_cache else [])
        if i == 0:
            log("$ " + " ".join(cmd))
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(stats_path) as f:
            s = json.load(f)
        return {"encode_ms": s["encode_ms"], "p50_ms": s["p50_ms"], "decode_ms_per_token": s["decode_ms_per_token"],
                "tokens": s["output_ids"][0], "source_tokens": s["samples"][0]["source_tokens"],
                "resident_bytes": s["resident_bytes"], "peak_rss_bytes": s["peak_rss_bytes"]}


KEYS = ("encode_ms", "p50_ms", "decode_ms_per_token")


def summary(runs):
    """Median and best (min) over the rounds of each timing, plus the first round's tokens."""
    out = {k: statistics.median(r[k] for r in runs) for k in KEYS}
    out.update({f"best_{k}": min(r[k] for r in runs) for k in KEYS})
    out["tokens"] = runs[0]["tokens"]
    out["rounds"] = [{k: r[k] for k in KEYS} for r in runs]
    return out


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "target", "vs-tf"))
    parser.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "edgemoe"))
    parser.add_argument("--split", default="test")
    parser.add_argument("--doc-id", default="13829773", help="SAMSum id (test 13829773: 354 tokens)")
    parser.add_argument("--source-tokens", type=int, default=353)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--pairs", default="f32:f32,f16:f16,8:int8",
                        help="expert bits:resident dtype[:kv cache format], ... (e.g. 8:int8:int8)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each one transformers encoder run + greedy decode and one engine run per pair")
    parser.add_argument("--beams", type=int, default=1,
                        help="beam search with this many beams on both sides instead of greedy decoding")
    parser.add_argument("--reconvert", action="store_true", help="convert the bundles again (after a format change)")
    args = parser.parse_args()
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",") if p]
    os.makedirs(args.out, exist_ok=True)
    ckpt = os.path.join(args.out, "switch-base-8")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        subprocess.run([sys.executable, os.path.join(ROOT, "benches", "make_big_switch.py"), ckpt,
                        "--experts", "8"], check=True, stdout=sys.stderr)

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(ckpt, "tokenizer.json"))
    dialogue = document(args.split, args.doc_id)
    ids = tokenizer(model_input(dialogue), truncation=True, max_length=args.source_tokens)["input_ids"]
    assert ids[-1] == 1, "the source ends with </s>"
    doc_path = os.path.join(args.out, f"doc-{args.doc_id}.jsonl")
    with open(doc_path, "w") as f:
        f.write(json.dumps({"id": args.doc_id, "dialogue": dialogue}) + "\n")
    log(f"document {args.split}/{args.doc_id}: {len(ids)} source tokens")

    results_path = os.path.join(args.out, "vs_transformers.json")
    started = time.perf_counter()
    load_start = os.getloadavg()[0]  # other work on the machine makes one-thread timings noisy
    resident_ok = accepts_resident(args.bin)
    if not resident_ok:
        log("note: this edgemoe convert has no --resident yet: bundles keep their resident weights at "
            "the checkpoint's width (f32); only the experts' width differs between pairs")
    engines = [Engine(args.bin, ckpt, args.out, pair, resident_ok, doc_path, args.source_tokens, args.new_tokens,
                      args.reconvert, args.beams)
               for pair in pairs]
    tf_model = Transformers(ckpt, ids)
    tf_runs, engine_runs = [], [[] for _ in engines]
    # Rounds interleave the two sides, so that a change in the machine's load hits both alike.
    for i in range(args.rounds):
        r = tf_model.round(args.new_tokens, args.beams)
        log(f"round {i} transformers: encode {r['encode_ms']:.0f} ms, decode p50 {r['p50_ms']:.1f} ms "
            f"(mean {r['decode_ms_per_token']:.1f}, first step {r['step_ms'][0]:.0f})")
        tf_runs.append(r)
        for engine, runs in zip(engines, engine_runs):
            r = engine.round(i)
            assert r["source_tokens"] == len(ids), f"engine saw {r['source_tokens']} source tokens, not {len(ids)}"
            log(f"round {i} {engine.name}: encode {r['encode_ms']:.0f} ms, decode p50 {r['p50_ms']:.1f} ms "
                f"(mean {r['decode_ms_per_token']:.1f}), {len(r['tokens'])} tokens")
            runs.append(r)
    del tf_model
    gc.collect()
    tf = summary(tf_runs)
    engine = []
    for e, runs in zip(engines, engine_runs):
        r = summary(runs)
        r.update({"bundle": e.bundle, "bits": e.bits, "resident": e.resident, "kv_cache": e.kv_cache or "f32",
                  "resident_bytes": runs[0]["resident_bytes"], "peak_rss_bytes": runs[0]["peak_rss_bytes"],
                  "same_tokens_as_transformers": common_prefix(r["tokens"], tf["tokens"])})
        engine.append(r)
    load_end = os.getloadavg()[0]
    with open(results_path, "w") as f:
        json.dump({"load_average": [load_start, load_end], "checkpoint": ckpt,
                   "document": f"{args.split}/{args.doc_id}", "source_tokens": len(ids),
                   "new_tokens": args.new_tokens, "beams": args.beams, "threads": 1, "rounds": args.rounds, "resident_flag": resident_ok,
                   "transformers": tf, "engine": engine}, f, indent=1)

    print(f"switch-base-8 shape (random weights), 1 thread, {len(ids)} source tokens "
          f"(SAMSum {args.split}/{args.doc_id}), "
          + (f"beam search ({args.beams} beams) up to {args.new_tokens}" if args.beams > 1 else
             f"greedy {args.new_tokens}") + " new tokens, io-free engine; "
          f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"load average {load_start:.1f} at the start, {load_end:.1f} at the end on {os.cpu_count()} cores")
    rows = [("transformers eager f32", tf)] + [
        (f"edgemoe {r['bits']} / " + (f"res {r['resident']}" if r["resident"] else "res f32*")
         + (f" kv {r['kv_cache']}" if r["kv_cache"] != "f32" else ""), r) for r in engine]
    for best in (False, True):
        k = (lambda key: f"best_{key}") if best else (lambda key: key)
        print(f"\n{'best' if best else 'median'} of {args.rounds} rounds"
              + (" (the least disturbed by other load)" if best else "") + ":")
        head = (f"{'run (experts / resident)':<32} {'encoder ms':>10} {'dec ms/tok p50':>14} {'mean':>7} "
                f"{'tokens':>6} {'= tf':>4} {'enc x':>6} {'dec x p50':>9} {'x mean':>6}")
        print(head)
        print("-" * len(head))
        for label, r in rows:
            line = (f"{label:<32} {r[k('encode_ms')]:>10.1f} {r[k('p50_ms')]:>14.2f} "
                    f"{r[k('decode_ms_per_token')]:>7.2f} {len(r['tokens']):>6}")
            if r is not tf:
                line += (f" {r['same_tokens_as_transformers']:>4} {tf[k('encode_ms')] / r[k('encode_ms')]:>6.2f} "
                         f"{tf[k('p50_ms')] / r[k('p50_ms')]:>9.2f} "
                         f"{tf[k('decode_ms_per_token')] / r[k('decode_ms_per_token')]:>6.2f}")
            print(line)
    print("x = transformers / engine (higher: engine faster); p50 = median step, mean = mean step "
          "(the engine's decode_ms_per_token); '= tf': leading tokens equal to transformers' ids")
    # On a shared machine the load moves within minutes: a round's two sides ran back to back, so
    # the ratio within each round is steadier than a ratio of medians taken over all rounds.
    print(f"\nratios within each round (transformers / engine), then their median:")
    for (label, r), runs in zip(rows[1:], engine_runs):
        for key, name in (("encode_ms", "encoder"), ("p50_ms", "dec p50")):
            ratios = [t[key] / e[key] for t, e in zip(tf_runs, runs)]
            print(f"{label:<32} {name:<8} " + " ".join(f"{x:.2f}" for x in ratios)
                  + f"   median {statistics.median(ratios):.2f}")
    if any(r["resident"] is None for r in engine):
        print("* converted without --resident (" + ("this edgemoe convert has none" if not resident_ok else
              "refused for this width") + "): resident weights stay at the checkpoint's f32")
    log(f"benchmark took {time.perf_counter() - started:.0f} s; results in {results_path}")


if __name__ == "__main__":
    main()
