#!/usr/bin/env python3
"""Median over rounds of benches/prefetch_sched.sh TSVs → the markdown table of BENCHMARKS §11:
ms/token, hit ratio, wasted share and stall per cell as medians over the rounds; on/off as the
median (and range) of each round's ratio of its two back-to-back runs; with TSVs that have
`ms_per_document` (encoder + decoding of one dialogue), its on/off too.

With TSVs that have `decode_stall_ms_per_token` (the waits inside decoder steps), a second
table says where issue 12's "≥ 1.25× faster where read stalls are ≥ 30% of decode time" applies
and what any prefetcher could reach there, from the prefetch-off runs (medians): decode time
`off`, its stall `s`, decode misses per token `m`, decoder MoE layers `L`, so compute `c = off − s`
and a miss's read `r = s / m`:
  - every stall hidden: on/off ≥ max(c, s) / off (reads overlap all compute; no fewer bytes);
  - one layer ahead: on/off ≥ (off − m · min(r, c / L)) / off: a read started when the previous
    MoE layer routes can overlap about one layer's compute (c / L) before the layer needs it.
The target (≥ 1.25× faster) is on/off ≤ 0.80.
Usage: benches/prefetch_sched_table.py ROUND1.tsv [ROUND2.tsv ...]"""
import csv, statistics, sys
from collections import defaultdict

runs = defaultdict(list)
# on/off of the two runs made back to back in one round: the ratio the machine's load disturbs least.
paired = defaultdict(list)
paired_doc = defaultdict(list)
for path in sys.argv[1:]:
    rows = list(csv.DictReader(open(path), delimiter="\t"))
    for row in rows:
        runs[(row["build"], row["profile"], int(row["buffer"]), row["prefetch"])].append(row)
    by = {(r["build"], r["profile"], r["buffer"], r["prefetch"]): float(r["ms_per_token"]) for r in rows}
    for (b, p, buf, mode), ms in by.items():
        if mode == "on" and (b, p, buf, "off") in by:
            paired[(b, p, int(buf))].append(ms / by[(b, p, buf, "off")])
    doc = {(r["build"], r["profile"], r["buffer"], r["prefetch"]): float(r["ms_per_document"])
           for r in rows if r.get("ms_per_document")}
    for (b, p, buf, mode), ms in doc.items():
        if mode == "on" and (b, p, buf, "off") in doc:
            paired_doc[(b, p, int(buf))].append(ms / doc[(b, p, buf, "off")])

def med(key, field):
    rows = runs.get(key)
    return statistics.median(float(r[field]) for r in rows) if rows else None

builds = sorted({k[0] for k in runs}, reverse=True)  # before, after
configs = sorted({(k[1], k[2]) for k in runs}, key=lambda c: (["rpi4-sd", "rpi5-sd", "rpi5-nvme"].index(c[0]) if c[0] in ["rpi4-sd", "rpi5-sd", "rpi5-nvme"] else 9, c[1]))
head = ["profile", "buffer"]
for b in builds:
    head += [f"{b} on ms/tok", f"{b} off", f"{b} on/off (paired)", f"{b} hit on/off", f"{b} wasted %", f"{b} stall on/off"]
    if any(k[0] == b for k in paired_doc):
        head += [f"{b} per document on/off"]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for p, buf in configs:
    cells = [p, str(buf)]
    for b in builds:
        on, off = med((b, p, buf, "on"), "ms_per_token"), med((b, p, buf, "off"), "ms_per_token")
        hon, hoff = med((b, p, buf, "on"), "hit_ratio"), med((b, p, buf, "off"), "hit_ratio")
        wasted = med((b, p, buf, "on"), "wasted_bytes") / max(1.0, med((b, p, buf, "on"), "bytes_read"))
        son, soff = med((b, p, buf, "on"), "stall_ms_per_token"), med((b, p, buf, "off"), "stall_ms_per_token")
        cells += [f"{on:.2f}", f"{off:.2f}", f"**{statistics.median(paired[(b, p, buf)]):.2f}×** ({min(paired[(b, p, buf)]):.2f}–{max(paired[(b, p, buf)]):.2f})", f"{hon:.2f} / {hoff:.2f}", f"{100 * wasted:.0f}%", f"{son:.1f} / {soff:.1f}"]
        if any(k[0] == b for k in paired_doc):
            d = paired_doc.get((b, p, buf), [])
            cells += [f"{statistics.median(d):.2f}× ({min(d):.2f}–{max(d):.2f})" if d else "—"]
    print("| " + " | ".join(cells) + " |")
if any("decode_stall_ms_per_token" in r for v in runs.values() for r in v):
    print()
    head = ["profile", "buffer", "off ms/tok", "decode stall off (share)", "decode misses per token",
            "best on/off, every stall hidden", "best on/off, one layer ahead", "measured on/off"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for p, buf in configs:
        for b in builds:
            key = (b, p, buf, "off")
            if key not in runs or "decode_stall_ms_per_token" not in runs[key][0]:
                continue
            off, s = med(key, "ms_per_token"), med(key, "decode_stall_ms_per_token")
            m, layers = med(key, "decode_misses_per_token"), med(key, "decoder_moe_layers")
            c = max(0.0, off - s)
            hidden = max(c, s) / off
            ahead = (off - (m * min(s / m, c / layers) if m > 0 else 0.0)) / off
            pr = paired.get((b, p, buf), [])
            cells = [p, str(buf) + (f" ({b})" if len(builds) > 1 else ""), f"{off:.2f}",
                     f"{s:.2f} ({100 * s / off:.0f}%)", f"{m:.2f}", f"{hidden:.2f}", f"{ahead:.2f}",
                     f"{statistics.median(pr):.2f}" if pr else "—"]
            print("| " + " | ".join(cells) + " |")
n = {len(v) for v in runs.values()}
print(f"\n(median of {sorted(n)} runs per cell)")
same = {r["ids_md5"] for v in runs.values() for r in v}
print(f"output ids digests over every run: {sorted(same)}")
