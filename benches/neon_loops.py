#!/usr/bin/env python3
"""Cycles per block of the NEON GEMV kernels on a model of a Raspberry Pi's core (llvm-mca).

No board is at hand, so this reads the aarch64 build's assembly instead of timing it: for each
integer GEMV kernel (`neon::dot_quant_bits`, one row, and `neon::dot_quant_rows_bits`, rows one
after another, on ARMv8.0; their `_sdot` twins with `dotprod`), it finds the kernel's main loop
(the innermost loop with the most blocks, counted by their products), tells its width from its
instructions (`sshr #6`: INT2, `sshr #4`: INT4, else INT8), and runs `llvm-mca` on the loop body
for each `--cpu` (LLVM's Cortex-A72 model is its Cortex-A57 one; a Raspberry Pi 4 has A72 cores,
a Pi 3 A53 ones). It prints instructions and
cycles per block, and the bytes of weights per cycle that gives; at a clock of `--ghz` (a Pi 4's
1.8 GHz by default) that is the rate a core could read weights at if memory kept up.

  deploy/build-aarch64.sh rustc --release --lib -- --emit asm -C codegen-units=1
  benches/neon_loops.py target/aarch64/aarch64-unknown-linux-gnu/release/deps/edgemoe-*.s

Needs `llvm-mca` (Debian's `llvm` package). llvm-mca models the core's pipelines, not its
caches or memory: a loop that needs fewer cycles per byte than memory delivers is bound by
memory on the board instead.
"""
import argparse
import re
import shutil
import subprocess
import sys

BLOCK_BYTES = {8: 32, 4: 16, 2: 8}
# One row at a time (beams of INT4/INT2 rows), and rows one after another (a decode step's GEMV).
KERNELS = ["dot_quant_bits", "dot_quant_bits_sdot", "dot_quant_rows_bits", "dot_quant_rows_bits_sdot"]
DIRECTIVE = re.compile(r"^\s*\.(cfi|p2align|loc|file)\b|^\s*//")
BRANCH = re.compile(r"^\s*(b\.\w+|b|cbnz|cbz|tbnz|tbz)\s+(?:[^,]*,\s*)*(\.L\w+)\s*$")


def functions(asm_lines, name):
    """(symbol, body lines) of every instance of the function `neon::name` (one per width)."""
    mangled = f"kernels4neon{len(name)}{name}17h"
    symbol, body = None, []
    for line in asm_lines:
        if re.match(r"^_ZN\S*:$", line):
            if symbol:
                yield symbol, body
            symbol = line[:-1] if mangled in line else None
            body = []
        elif symbol is not None:
            if ".cfi_endproc" in line:
                yield symbol, body
                symbol = None
            elif not DIRECTIVE.match(line):
                body.append(line)


def main_loop(body):
    """The body of the innermost loop (label to backward branch, no loop inside it) with the
    most blocks ([`block_count`]): the loop over blocks, not the one over rows around it."""
    labels = {line[:-1]: i for i, line in enumerate(body) if re.match(r"^\.L\w+:$", line)}
    loops = []
    for i, line in enumerate(body):
        m = BRANCH.match(line)
        if m and m.group(2) in labels and labels[m.group(2)] < i:
            loops.append((labels[m.group(2)], i))
    best = None
    for start, end in loops:
        if any(start <= s and e <= end and (s, e) != (start, end) for s, e in loops):
            continue
        loop = [l for l in body[start + 1 : end + 1] if not l.endswith(":")]
        blocks = block_count(loop)
        if blocks and (best is None or blocks > best[1]):
            best = (loop, blocks)
    return best


def block_count(loop):
    """Blocks one pass of `loop` computes, counted by their products: a 32-code block takes
    two `sdot`, or on ARMv8.0 two `smull` and two `smlal2` (or `smlal` on high halves moved by
    `ext`), whatever its width. (Not by `fmla`: INT4 and INT2 sum a scale group's 8 blocks in
    integers and take one `fmla` per group, BENCHMARKS.md §9.37.)"""
    ops = [l.split()[0] for l in loop if l.split()]
    return ops.count("sdot") // 2 + (ops.count("smull") + ops.count("smlal") + ops.count("smlal2")) // 4


def width(loop):
    text = "\n".join(loop)
    if re.search(r"sshr\s+v\d+\.\d+b,\s*v\d+\.\d+b,\s*#6", text):
        return 2
    if re.search(r"sshr\s+v\d+\.\d+b,\s*v\d+\.\d+b,\s*#4", text):
        return 4
    return 8


def mca_cycles(loop, cpu, iterations=400):
    source = "\n".join(loop) + "\n"
    if shutil.which("llvm-mca") is None:
        sys.exit("llvm-mca is missing: apt-get install llvm")
    out = subprocess.run(
        ["llvm-mca", "-mtriple=aarch64", f"-mcpu={cpu}", "-mattr=+dotprod",
         f"-iterations={iterations}"],
        input=source, capture_output=True, text=True, check=True).stdout
    return int(re.search(r"Total Cycles:\s+(\d+)", out).group(1)) / iterations


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("asm", help="the aarch64 build's assembly (see above)")
    parser.add_argument("--cpu", action="append", help="llvm-mca CPU models (cortex-a72 by default)")
    parser.add_argument("--ghz", type=float, default=1.8, help="clock for the GB/s column")
    args = parser.parse_args()
    cpus = args.cpu or ["cortex-a72"]
    lines = open(args.asm).read().splitlines()
    rows = []
    for kernel in KERNELS:
        for _, body in functions(lines, kernel):
            found = main_loop(body)
            if not found:
                continue
            loop, blocks = found
            bits = width(loop)
            per_block = [mca_cycles(loop, cpu) / blocks for cpu in cpus]
            rows.append((kernel, bits, len(loop) / blocks, per_block))
    if not rows:
        sys.exit("no NEON GEMV kernel found: is this the aarch64 build's assembly?")
    head = f"{'kernel':<26}{'width':>6}{'instr/block':>13}"
    for cpu in cpus:
        head += f"{cpu + ' cyc/block':>24}{'B/cycle':>9}{'GB/s @' + str(args.ghz):>11}"
    print(head)
    for kernel, bits, instructions, per_block in sorted(rows, key=lambda r: (KERNELS.index(r[0]), -r[1])):
        line = f"{kernel:<26}{'INT' + str(bits):>6}{instructions:>13.1f}"
        for cycles in per_block:
            rate = BLOCK_BYTES[bits] / cycles
            line += f"{cycles:>24.2f}{rate:>9.2f}{rate * args.ghz:>11.2f}"
        print(line)


if __name__ == "__main__":
    main()
