"""Load test of `edgemoe serve` (issue 14): N concurrent clients for a bounded time on loopback.

It starts `edgemoe serve` on 127.0.0.1 with a free port, waits for /health, then runs --clients
threads that each POST /v1/summarize (one document per request, round-robin over the SAMSum test
dialogues when ../shared/data/samsum is there, else models/sample-dialogue.txt) for --duration
seconds, backing off 0.2 s after a 503. Every 2 s it samples the server's resident memory
(VmRSS). At the end it sends SIGTERM and checks that the server exits 0.

It reports:
  - answered requests by status; failed = any answer other than 200 or 503, or an exception;
  - lost requests: sent but never answered (a connection error or timeout), and the server's own
    count (`edgemoe_requests_total` in /metrics) against the answers the clients received;
  - p50/p99 latency of the 200s, requests/s and generated tokens/s;
  - RSS over time and its drift after warm-up: the mean of the last tenth of the samples against
    the mean of the first tenth after --warmup seconds.

Usage (after ./setup.sh, with a release build):
    python3 benches/serve_load.py [--model bundles/switch-samsum-tiny] [--clients 4]
        [--duration 120] [--warmup 20] [--queue 2] [--max-new-tokens 40] [--out FILE]
        [-- extra edgemoe serve flags]
"""

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def documents():
    samsum = os.path.join(ROOT, "..", "shared", "data", "samsum", "test.jsonl")
    if os.path.exists(samsum):
        with open(samsum) as f:
            docs = [json.loads(line)["dialogue"] for line in f if line.strip()]
        return docs[:200], "SAMSum test (first 200)"
    with open(os.path.join(ROOT, "models", "sample-dialogue.txt")) as f:
        return [f.read()], "models/sample-dialogue.txt"


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def percentile(values, q):
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 1))))
    return ordered[rank - 1]


def request(host, port, method, path, body=None, timeout=300):
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(ROOT, "bundles", "switch-samsum-tiny"))
    parser.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "edgemoe"))
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--queue", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("extra", nargs="*", help="more `edgemoe serve` flags (after --)")
    args = parser.parse_args()

    docs, source = documents()
    command = [args.bin, "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
               "--queue", str(args.queue), *args.extra]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    address = None
    log = []
    for line in server.stderr:
        log.append(line)
        if "listening on http://" in line:
            address = line.split("listening on http://")[1].split()[0]
            break
    if address is None:
        sys.exit("edgemoe serve printed no address:\n" + "".join(log))
    threading.Thread(target=lambda: log.extend(server.stderr), daemon=True).start()
    host, port = address.rsplit(":", 1)
    port = int(port)
    started = time.time()
    while True:
        try:
            if request(host, port, "GET", "/health", timeout=5)[0] == 200:
                break
        except OSError:
            pass
        if server.poll() is not None:
            time.sleep(0.5)
            sys.exit(f"edgemoe serve exited with {server.returncode}:\n" + "".join(log))
        if time.time() - started > 300:
            sys.exit("server not healthy after 300 s")
        time.sleep(0.2)
    print(f"server {address} ready in {time.time() - started:.1f} s; {args.clients} clients for "
          f"{args.duration:.0f} s, queue {args.queue}, {args.max_new_tokens} new tokens, documents: {source}",
          flush=True)

    lock = threading.Lock()
    results = []       # (start, seconds, status, tokens)
    lost = []          # (start, error)
    samples = []       # (t, rss KiB)
    begin = time.time()
    deadline = begin + args.duration
    next_doc = [0]

    def client():
        while time.time() < deadline:
            with lock:
                doc = docs[next_doc[0] % len(docs)]
                next_doc[0] += 1
            body = json.dumps({"documents": [doc], "max_new_tokens": args.max_new_tokens})
            t0 = time.time()
            try:
                status, _, payload = request(host, port, "POST", "/v1/summarize", body)
            except OSError as error:
                with lock:
                    lost.append((t0 - begin, repr(error)))
                continue
            tokens = 0
            if status == 200:
                tokens = sum(s["tokens"] for s in json.loads(payload)["summaries"])
            with lock:
                results.append((t0 - begin, time.time() - t0, status, tokens))
            if status == 503:
                time.sleep(0.2)

    def sampler():
        while time.time() < deadline + 1:
            samples.append((time.time() - begin, rss_kib(server.pid)))
            time.sleep(2.0)

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    watcher = threading.Thread(target=sampler)
    for t in threads + [watcher]:
        t.start()
    for t in threads + [watcher]:
        t.join()
    elapsed = time.time() - begin

    metrics = request(host, port, "GET", "/metrics")[2].decode()
    server_answered = sum(float(line.split()[-1]) for line in metrics.splitlines()
                          if line.startswith("edgemoe_requests_total{endpoint=\"/v1/summarize\""))
    server.send_signal(signal.SIGTERM)
    try:
        exit_code = server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        exit_code = "still running 60 s after SIGTERM (killed)"

    by_status = {}
    for _, _, status, _ in results:
        by_status[status] = by_status.get(status, 0) + 1
    ok = [r for r in results if r[2] == 200]
    latencies = [r[1] for r in ok]
    failed = sum(n for s, n in by_status.items() if s not in (200, 503))
    after = [kib for t, kib in samples if t >= args.warmup]
    tenth = max(1, len(after) // 10)
    drift = (statistics.mean(after[-tenth:]) / statistics.mean(after[:tenth]) - 1) if after else 0.0
    report = {
        "clients": args.clients,
        "duration_s": round(elapsed, 1),
        "queue": args.queue,
        "max_new_tokens": args.max_new_tokens,
        "answered_by_status": by_status,
        "failed": failed,
        "lost_client_side": len(lost),
        "lost_errors": lost[:5],
        "server_counted": int(server_answered),
        "client_received": len(results),
        "p50_s": round(percentile(latencies, 0.5), 3),
        "p99_s": round(percentile(latencies, 0.99), 3),
        "requests_per_s": round(len(ok) / elapsed, 3),
        "tokens_per_s": round(sum(r[3] for r in ok) / elapsed, 2),
        "rss_mib": [[round(t), round(kib / 1024, 1)] for t, kib in samples],
        "rss_drift_after_warmup": round(drift, 4),
        "server_exit": exit_code,
    }
    print(f"answered: {by_status}; failed (not 200/503): {failed}; lost: {len(lost)} "
          f"(server counted {int(server_answered)}, clients received {len(results)})")
    print(f"latency of the 200s: p50 {report['p50_s']} s, p99 {report['p99_s']} s; "
          f"{report['requests_per_s']} requests/s, {report['tokens_per_s']} tokens/s")
    rss = report["rss_mib"]
    marks = [rss[int(i * (len(rss) - 1) / 4)] for i in range(5)] if rss else []
    print("RSS (s, MiB): " + ", ".join(f"{t}: {m}" for t, m in marks) +
          f"; drift after {args.warmup:.0f} s warm-up: {100 * drift:+.2f}%")
    print(f"server exit after SIGTERM: {exit_code}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    good = failed == 0 and not lost and int(server_answered) == len(results) and exit_code == 0
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
