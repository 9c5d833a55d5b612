#!/usr/bin/env python3
"""Reading a callgrind output file, shared by cg-self.py, cg-misses.py and cg-inclusive.py:
names given once as `(id) name` and later as `(id)`, and the self-cost lines per function."""
import re


class Names:
    """Expands callgrind's name compression: `(12) foo` defines 12, `(12)` refers to it."""

    def __init__(self):
        self.names = {}

    def __call__(self, v):
        m = re.match(r'\((\d+)\)(?: (.*))?', v)
        if not m:
            return v
        if m.group(2) is not None:
            self.names[m.group(1)] = m.group(2)
        return self.names.get(m.group(1), v)


def is_cost(line):
    return line[:1].isdigit() or line[:1] in ('+', '-', '*')


def self_costs(path):
    """Yields (events, function, counts) for every self-cost line of `path`: `events` the
    file's event names, `counts` the line's numbers after its position (strings). The cost
    line after a `calls=` line is an inclusive call cost and is skipped."""
    name = Names(); fn = None; skip = False; events = None
    for line in open(path, errors='replace'):
        line = line.rstrip('\n')
        if not line:
            continue
        if line.startswith('events:'):
            events = line.split()[1:]; continue
        if line.startswith('fn='):
            fn = name(line[3:]); continue
        if line.startswith(('cfn=', 'cfi=', 'cfl=', 'cob=')):
            if line.startswith('cfn='):
                name(line[4:])
            continue
        if line.startswith('calls='):
            skip = True; continue
        if is_cost(line):
            if skip:
                skip = False; continue
            if fn is not None:
                yield events, fn, line.split()[1:]
