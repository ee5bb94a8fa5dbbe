#!/usr/bin/env python3
"""Locked instructions executed per operation, by function, from two callgrind runs.

A locked read-modify-write (`lock`-prefixed, or `xchg` with memory) costs about 8 ns on
the 2-vCPU VMs of bench/RESULTS.md even uncontended, and more right after a large copy,
as it waits for the stores before it; callgrind's instruction counts weigh it as one
instruction. This counts them: run the same command twice under

    valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file=OUT_N BIN ... --ops N

with two operation counts N1 < N2, then

    bench/scripts/locked-ops.py [--clock] BIN OUT_N1 OUT_N2 N2-N1

prints the locked instructions per operation the second run added (set-up cancels), and
the functions they are in (by `objdump` of BIN, which must be the binary that ran).

With `--clock` it counts reads of the time-stamp counter (`rdtsc`, `rdtscp`) instead: one
costs 15-20 ns on these VMs, and callgrind weighs it as one instruction too. Work driven by
time (periodic reports, load flushes) runs about fifty times as often per operation under
callgrind as at full speed, so a function that reads the clock on a timer shows more reads
here than it makes.
"""

import collections
import re
import subprocess
import sys


def is_locked(mnemonic, operands):
    """A locked read-modify-write: `lock`-prefixed, or `xchg` with memory."""
    return mnemonic == "lock" or (mnemonic.startswith("xchg") and "(" in operands)


def is_clock_read(mnemonic, _operands):
    """A read of the time-stamp counter."""
    return mnemonic in ("rdtsc", "rdtscp")


def locked_instructions(binary, wanted=is_locked):
    """Address -> enclosing function, for every instruction of `binary` that `wanted`
    picks (by default the locked ones)."""
    dump = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", binary],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    locked = {}
    function = None
    for line in dump.splitlines():
        header = re.match(r"^([0-9a-f]+) <(.*)>:$", line)
        if header:
            function = header.group(2)
            continue
        insn = re.match(r"^\s+([0-9a-f]+):\s+(\S+)\s*(.*)", line)
        if not insn:
            continue
        mnemonic, operands = insn.group(2), insn.group(3)
        if wanted(mnemonic, operands):
            locked[int(insn.group(1), 16)] = function
    return locked


def executions(path, locked):
    """Address -> times executed, for the locked addresses, from a callgrind output file
    written with --dump-instr=yes (positions: instruction, then line; cost: Ir)."""
    counts = collections.Counter()
    address = 0
    skip_next = False
    with open(path) as f:
        for line in f:
            if line.startswith("calls="):
                # The next cost line is the call's inclusive cost, not an execution.
                skip_next = True
                continue
            if not line or line[0] not in "0123456789+-*":
                continue
            fields = line.split()
            position = fields[0]
            if position.startswith("0x"):
                address = int(position, 16)
            elif position[0] in "+-":
                step = int(position[1:], 0)
                address += step if position[0] == "+" else -step
            elif position != "*":
                address = int(position)
            if skip_next:
                skip_next = False
                continue
            if len(fields) >= 3 and address in locked:
                counts[address] += int(fields[2])
    return counts


def main():
    args = sys.argv[1:]
    clock = args[:1] == ["--clock"]
    if clock:
        args = args[1:]
    if len(args) != 4:
        sys.exit(__doc__)
    binary, first, second, operations = args
    operations = int(operations)
    if operations <= 0:
        sys.exit("the operation count between the runs must be positive")
    locked = locked_instructions(binary, is_clock_read if clock else is_locked)
    before, after = executions(first, locked), executions(second, locked)
    by_function = collections.Counter()
    for address in set(before) | set(after):
        by_function[locked[address]] += after.get(address, 0) - before.get(address, 0)
    total = sum(by_function.values()) / operations
    what = "time-stamp counter reads" if clock else "locked instructions"
    print(f"{what} per operation: {total:.2f}")
    for function, n in by_function.most_common():
        if n / operations < 0.05:
            break
        print(f"{n / operations:7.2f}  {function[:120]}")


if __name__ == "__main__":
    main()
