#!/usr/bin/env python3
"""Layer check: every module of src/ imports only from its own layer or the ones below, and no
two top-level modules import each other (directly or round a longer loop), within a layer too.

The layers are listed leaf first in scripts/layers.toml. Each `crate::x` path in a file of
src/ (a `use` or a path in code, `use crate::{a, b}` groups included) is an edge from that
file to the top-level module `x`; an edge to a module of a higher layer goes the wrong way.
`crate::Name` (an item of lib.rs itself) is an edge to the layer of `lib`.

An import cycle is a set of top-level modules each reachable from every other through such
edges (a strongly connected component of more than one module): the layers cannot tell it
(both ends may sit in one layer), yet it ties the modules into one unit nobody can read or
test apart.

A module may also be sealed (`[[sealed]]` in layers.toml: `module` and the `importers` that
may name it): any other module that names it fails, whatever the layers allow, and the baseline
cannot excuse it. `cluster` is sealed so that only the wiring (lib.rs, main.rs) names the Redis
engine and everything else goes through the session directory (app/directory.rs).

The wrong-way edges that exist today are listed in scripts/layers-baseline.txt, one
`<file> -> <module>` per line, and the cycles as `cycle: <module>, <module>, …` (sorted): a
ratchet. The check fails on any wrong-way edge or cycle that is not in the baseline, and on a
baseline line that no longer holds (delete it: the baseline only shrinks). `--write-baseline` rewrites the baseline from the tree (for the commit that adds a
layer or reviews the list, never to let a new edge in quietly).

Usage: python3 scripts/layers.py [--root DIR] [--write-baseline]
Exit status 0 when the tree keeps to the layers and the baseline, 1 otherwise.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tomllib

COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
STRING = re.compile(r'"(?:\\.|[^"\\])*"')
CRATE_PATH = re.compile(r"\bcrate::")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def strip(text: str) -> str:
    """Source without comments and string literals (doc text and strings may say `crate::`)."""
    return STRING.sub('""', COMMENT.sub("", text))


def group_items(text: str, start: int) -> list[str]:
    """The first identifier of each top-level item of the `{...}` group at `start`."""
    depth, item, items = 0, "", []
    for ch in text[start:]:
        if ch == "{":
            depth += 1
            if depth == 1:
                continue
        elif ch == "}":
            depth -= 1
            if depth == 0:
                items.append(item)
                break
        if depth == 1 and ch == ",":
            items.append(item)
            item = ""
        elif depth >= 1:
            item += ch
    names = []
    for it in items:
        m = IDENT.search(it)
        if m:
            names.append(m.group(0))
    return names


def targets(text: str) -> set[str]:
    """Top-level names this source refers to through `crate::`."""
    text = strip(text)
    out: set[str] = set()
    for m in CRATE_PATH.finditer(text):
        rest = m.end()
        if text[rest:rest + 1] == "{":
            out.update(group_items(text, rest))
        else:
            ident = IDENT.match(text, rest)
            if ident:
                out.add(ident.group(0))
    return {"lib" if name[:1].isupper() else name for name in out if name != "self"}


def module_of(rel: pathlib.PurePosixPath) -> str:
    first = rel.parts[0]
    return first[:-3] if first.endswith(".rs") else first


def load_layers(path: pathlib.Path) -> dict[str, int]:
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    rank: dict[str, int] = {}
    for i, layer in enumerate(doc["layers"]):
        for module in layer["modules"]:
            if module in rank:
                sys.exit(f"layers.toml: module {module} is in two layers")
            rank[module] = i
    return rank


def load_sealed(path: pathlib.Path, rank: dict[str, int]) -> dict[str, set[str]]:
    """Sealed module → the modules that may import it (`[[sealed]]` entries)."""
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    sealed: dict[str, set[str]] = {}
    for entry in doc.get("sealed", []):
        module, importers = entry["module"], set(entry["importers"])
        for name in [module, *sorted(importers)]:
            if name not in rank:
                sys.exit(f"layers.toml: sealed entry names {name}, which is in no layer")
        sealed[module] = importers
    return sealed


def seal_breaks(sealed: dict[str, set[str]], imports: dict[str, dict[str, list[str]]]) -> list[str]:
    """`file -> module` for each file naming a sealed module it may not import."""
    out = []
    for importer, targets in sorted(imports.items()):
        for module, files in sorted(targets.items()):
            if module in sealed and importer not in sealed[module]:
                out.extend(f"{f} -> {module} (only {', '.join(sorted(sealed[module]))} may import it)" for f in sorted(files))
    return out


def wrong_way(src: pathlib.Path, rank: dict[str, int]) -> tuple[set[str], list[str]]:
    """(`file -> module` edges that go up, problems such as a module no layer names)."""
    edges, problems, _ = scan(src, rank)
    return edges, problems


def scan(src: pathlib.Path, rank: dict[str, int]) -> tuple[set[str], list[str], dict[str, dict[str, list[str]]]]:
    """Wrong-way edges and problems as [`wrong_way`], and every module-to-module edge with the
    files that make it (`imports[a][b]` = files of `a` naming `crate::b`)."""
    edges: set[str] = set()
    problems: list[str] = []
    imports: dict[str, dict[str, list[str]]] = {}
    for file in sorted(src.rglob("*.rs")):
        rel = pathlib.PurePosixPath(file.relative_to(src).as_posix())
        own = module_of(rel)
        if own not in rank:
            problems.append(f"src/{rel}: module `{own}` is in no layer of scripts/layers.toml")
            continue
        for target in sorted(targets(file.read_text(encoding="utf-8"))):
            if target == own:
                continue
            if target not in rank:
                # Not a module (a macro or a re-export at the root): nothing to rank.
                continue
            imports.setdefault(own, {}).setdefault(target, []).append(f"src/{rel}")
            if rank[target] > rank[own]:
                edges.add(f"src/{rel} -> {target}")
    return edges, problems, imports


def cycles(imports: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module, sorted
    (Tarjan's algorithm, iterative so a deep graph cannot hit Python's recursion limit)."""
    nodes = sorted(set(imports) | {b for targets in imports.values() for b in targets})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(imports.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(imports.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def cycle_line(component: list[str]) -> str:
    return "cycle: " + ", ".join(component)


def cycle_detail(component: list[str], imports: dict[str, dict[str, list[str]]]) -> str:
    """The edges inside a cycle and the files that make them, for the failure message."""
    members = set(component)
    parts = []
    for a in component:
        for b, files in sorted(imports.get(a, {}).items()):
            if b in members:
                parts.append(f"{a} -> {b} ({', '.join(sorted(files))})")
    return "; ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=str(pathlib.Path(__file__).resolve().parent.parent))
    ap.add_argument("--write-baseline", action="store_true")
    args = ap.parse_args()
    root = pathlib.Path(args.root)
    rank = load_layers(root / "scripts" / "layers.toml")
    edges, problems, imports = scan(root / "src", rank)
    breaks = seal_breaks(load_sealed(root / "scripts" / "layers.toml", rank), imports)
    found = {cycle_line(c): c for c in cycles(imports)}
    baseline_path = root / "scripts" / "layers-baseline.txt"
    if args.write_baseline:
        header = "# Wrong-way imports and import cycles that exist today (scripts/layers.py). This list only shrinks.\n"
        baseline_path.write_text(header + "".join(f"{e}\n" for e in sorted(edges) + sorted(found)))
        print(f"wrote {len(edges)} edges and {len(found)} cycles to {baseline_path}")
        return 0
    baseline = set()
    if baseline_path.exists():
        baseline = {l.strip() for l in baseline_path.read_text().splitlines() if l.strip() and not l.startswith("#")}
    base_edges = {l for l in baseline if not l.startswith("cycle:")}
    base_cycles = {l for l in baseline if l.startswith("cycle:")}
    new = sorted(edges - base_edges)
    gone = sorted(base_edges - edges)
    new_cycles = sorted(set(found) - base_cycles)
    gone_cycles = sorted(base_cycles - set(found))
    for p in problems:
        print(p)
    for e in new:
        print(f"new wrong-way import: {e} (a module may import only from its own layer or below; see scripts/layers.toml)")
    for b in breaks:
        print(f"sealed module imported: {b}; see [[sealed]] in scripts/layers.toml")
    for e in gone:
        print(f"fixed: {e} no longer holds; delete its line from scripts/layers-baseline.txt")
    for c in new_cycles:
        print(f"new import {c}: {cycle_detail(found[c], imports)} (modules must not import each other, "
              "even within a layer: move what one needs down, or invert the call with a trait)")
    for c in gone_cycles:
        print(f"fixed: {c} no longer holds; delete its line from scripts/layers-baseline.txt")
    ok = not (problems or breaks or new or gone or new_cycles or gone_cycles)
    print(f"layers: {len(edges)} known wrong-way imports, {len(new)} new, {len(gone)} gone; "
          f"{len(found)} import cycles, {len(new_cycles)} new, {len(gone_cycles)} gone; "
          f"{len(breaks)} imports of sealed modules: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
