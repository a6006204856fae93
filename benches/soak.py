"""Memory soak (issue 13): long runs inside a memory cgroup of the budget plus the runtime's
overhead, sampling resident memory over time.

Each scenario runs one `edgemoe` command as a child placed in a fresh cgroup-v1 memory group
(/sys/fs/cgroup/memory, needs root) whose limit is `--budget` + `--overhead`, with swap off for
the group where the kernel allows it. Every 0.25 s it samples the child's VmRSS and RssAnon
(anonymous memory: the heap, what could grow; file pages of the binary and libtorch come and go
under the limit). It reports the exit status, the OOM kills the group saw, the peak RSS, the
group's peak (memory.max_usage_in_bytes, what the limit is checked against), anonymous RSS at
10/25/50/75/100% of the run, and its trend after warm-up: a least-squares slope over the last 80%
of the samples, in MiB per minute (flat = the run does not grow).

Scenarios (the defaults reproduce BENCHMARKS.md):
  summarize  the demo model (INT4 experts) on the first 500 SAMSum test dialogues at --budget
             88MiB (10 expert slots), prefetch on, O_DIRECT reads;
  decode     1,000 generated tokens (seeded top-p sampling, so no early stop) on the OLMoE-shaped
             2-layer checkpoint of benches/llama_cpp.sh (INT4 experts, INT8 resident) at --budget
             512MiB, experts streamed from the store.

Usage (root; after ./setup.sh and benches/llama_cpp.sh for the decode bundle):
    python3 benches/soak.py [--out target/soak] [--overhead 192MiB] [--only summarize|decode]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release", "edgemoe")
SHARED = os.path.join(ROOT, "..", "shared")
MIB = 1 << 20


def size(text):
    m = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB)?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text}")
    return int(m.group(1)) * {None: 1, "KiB": 1 << 10, "MiB": MIB, "GiB": 1 << 30}[m.group(2)]


def read_int(path):
    with open(path) as f:
        return int(f.read().split()[0])


def rss(pid):
    """(VmRSS, RssAnon) in bytes: all resident pages, and the anonymous ones alone (the heap:
    what can grow; file pages of the binary and libtorch come and go under the group's limit)."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmRSS", "RssAnon"):
                    found[key] = int(line.split()[1]) * 1024
    except FileNotFoundError:
        return None
    return (found["VmRSS"], found["RssAnon"]) if len(found) == 2 else None


def run_confined(name, command, limit, out):
    group = f"/sys/fs/cgroup/memory/edgemoe-soak-{os.getpid()}-{name}"
    os.makedirs(group, exist_ok=True)
    try:
        with open(f"{group}/memory.limit_in_bytes", "w") as f:
            f.write(str(limit))
        try:
            with open(f"{group}/memory.memsw.limit_in_bytes", "w") as f:
                f.write(str(limit))
        except OSError:
            pass  # no swap accounting: the machine has no swap to fall back on anyway

        def enter():
            with open(f"{group}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))

        started = time.time()
        log = open(os.path.join(out, f"{name}.stderr"), "w")
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, preexec_fn=enter)
        samples = []
        while child.poll() is None:
            r = rss(child.pid)
            if r is not None:
                samples.append((time.time() - started, r[0], r[1]))
            time.sleep(0.25)
        elapsed = time.time() - started
        oom = 0
        with open(f"{group}/memory.oom_control") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    oom = int(line.split()[1])
        group_peak = read_int(f"{group}/memory.max_usage_in_bytes")
    finally:
        for _ in range(20):
            try:
                os.rmdir(group)
                break
            except OSError:
                time.sleep(0.1)
    return child.returncode, elapsed, oom, group_peak, samples


def trend(samples):
    """Anonymous RSS slope (MiB/min) over the last 80% of the samples."""
    tail = samples[len(samples) // 5:]
    if len(tail) < 3:
        return 0.0
    ts = [t for t, _, _ in tail]
    rs = [a / MIB for _, _, a in tail]
    mt, mr = sum(ts) / len(ts), sum(rs) / len(rs)
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (r - mr) for t, r in zip(ts, rs)) / var if var else 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "target", "soak"))
    parser.add_argument("--overhead", type=size, default=size("192MiB"))
    parser.add_argument("--only", choices=["summarize", "decode"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    demo = os.path.join(args.out, "demo-int4")
    if not os.path.exists(os.path.join(demo, "config.json")):
        subprocess.run([BIN, "convert", "--hf", os.path.join(ROOT, "models", "switch-samsum-tiny"),
                        "--out", demo, "--bits", "4"], check=True, stdout=subprocess.DEVNULL)
    docs = os.path.join(args.out, "samsum-500.jsonl")
    with open(os.path.join(SHARED, "data", "samsum", "test.jsonl")) as src, open(docs, "w") as dst:
        for i, line in enumerate(src):
            if i == 500:
                break
            dst.write(line)
    olmoe = os.path.join(ROOT, "target", "llama-bench", "bundle-e4-rint8")
    scenarios = {
        "summarize": (size("88MiB"), [BIN, "summarize", "--model", demo, "--input", docs,
                                      "--budget", "88MiB", "--storage", "direct", "-q",
                                      "--stats-json", os.path.join(args.out, "summarize.json")]),
        "decode": (size("512MiB"), [BIN, "generate", "--model", olmoe, "--prompt-ids",
                                    "100,200,300,400,500,600,700,800", "--max-new-tokens", "1000",
                                    "--temperature", "1.0", "--top-p", "0.95", "--seed", "7",
                                    "--budget", "512MiB", "--storage", "direct", "--ids", "-q",
                                    "--stats-json", os.path.join(args.out, "decode.json")]),
    }
    report = {}
    for name, (budget, command) in scenarios.items():
        if args.only and name != args.only:
            continue
        if name == "decode" and not os.path.exists(os.path.join(olmoe, "config.json")):
            print(f"{name}: skipped, {olmoe} missing (run benches/llama_cpp.sh first)")
            continue
        limit = budget + args.overhead
        code, elapsed, oom, group_peak, samples = run_confined(name, command, limit, args.out)
        rs = [r for _, r, _ in samples]
        anon = [a for _, _, a in samples]
        at = {p: anon[min(len(anon) - 1, int(len(anon) * p / 100))] / MIB
              for p in (10, 25, 50, 75, 100)} if anon else {}
        stats = {}
        stats_path = os.path.join(args.out, f"{name}.json")
        if code == 0 and os.path.exists(stats_path):
            stats = json.load(open(stats_path))
        row = {
            "exit": code, "seconds": round(elapsed, 1), "oom_kills": oom,
            "budget_mib": budget / MIB, "cgroup_limit_mib": limit / MIB,
            "peak_rss_mib": round(max(rs) / MIB, 1) if rs else None,
            "cgroup_peak_mib": round(group_peak / MIB, 1),
            "peak_anon_rss_mib": round(max(anon) / MIB, 1) if anon else None,
            "anon_rss_mib_at_percent": {k: round(v, 1) for k, v in at.items()},
            "anon_rss_trend_mib_per_min_after_warmup": round(trend(samples), 2),
            "tokens": stats.get("tokens_generated"), "documents": stats.get("documents"),
            "engine_peak_rss_mib": round(stats["peak_rss_bytes"] / MIB, 1) if stats else None,
        }
        report[name] = row
        print(f"{name}: {json.dumps(row)}")
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(report, f, indent=1)
    failed = [n for n, r in report.items() if r["exit"] != 0 or r["oom_kills"]]
    if failed:
        print(f"soak failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
