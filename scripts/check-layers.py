#!/usr/bin/env python3
"""Check the host library's module layering: no import cycles, and every
module uses only modules below it.

Each top-level module of host/src (a file or a directory) has a layer in
LAYERS below; a module may refer (`crate::name`) only to modules of lower
layers. Modules of one layer are independent of each other. Since every
reference points down, there is no cycle. Run with --dot to print the
module graph for Graphviz (`scripts/check-layers.py --dot | dot -Tsvg`).

Exceptions are listed in NARROW: where a module may use only some names of
a module below it.

Inside a module made of several files, the files other than mod.rs must
not use each other in a circle either (`super::sibling`).
"""

import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "host" / "src"

# Bottom first. The binary (bin/) and the crate root (lib.rs) sit above all.
LAYERS = [
    ["cores"],
    ["error", "metrics", "failure", "preemption", "alloc", "executor", "tensor"],
    ["config", "cluster"],
    ["storage", "collective"],
    ["record"],
    ["persist", "checkpoint", "sync", "owner"],
    ["ledger"],
    ["attempt"],
    ["runtime"],
    ["result"],
    ["trainer"],
    ["bench", "fuzzing"],
]

# module -> {module below it: the only names it may take from there}
NARROW = {
    # The runtime knows an attempt only through the handle it gives a rank
    # (and the types its calls take and return), and nothing of how
    # checkpoints are written, recorded or read.
    "runtime": {
        "attempt": {
            "RankHandle",
            "RankEnd",
            "Refused",
            "Aborted",
            "Reported",
            "HandOver",
            "Inode",
        },
        "persist": set(),
        "ledger": set(),
        "record": set(),
        "checkpoint": set(),
    },
}

REFERENCE = re.compile(r"\bcrate::(\w+)((?:::\{[^}]*\}|::\w+)*)")
SIBLING = re.compile(r"\bsuper::(\w+|\{[^}]*\})")


def module_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0].removesuffix(".rs")


def code(text: str) -> str:
    """The text without comments (doc comments included) and strings."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def names(tail: str) -> set[str]:
    """The item names in `::a::{B, c::D}` (the last part of each path)."""
    found = set()
    for group in re.findall(r"\{([^}]*)\}", tail):
        for item in group.split(","):
            item = item.strip().split(" as ")[0]
            if item:
                found.add(item.split("::")[-1])
    rest = re.sub(r"::\{[^}]*\}", "", tail)
    if rest:
        found.add(rest.split("::")[-1])
    return found


def sibling_names(text: str) -> set[str]:
    """The first path part of every `super::a` and `super::{a, b::c}`."""
    found = set()
    for part in SIBLING.findall(text):
        items = part.strip("{}").split(",") if part.startswith("{") else [part]
        found.update(i.strip().split("::")[0] for i in items if i.strip())
    return found


def sibling_cycles() -> list[str]:
    """Circles among the files of one directory module (mod.rs aside)."""
    found = []
    for directory in sorted(p for p in SRC.rglob("*") if p.is_dir()):
        files = {f.stem: f for f in directory.glob("*.rs") if f.stem != "mod"}
        uses = {
            name: {s for s in sibling_names(code(f.read_text())) if s in files and s != name}
            for name, f in files.items()
        }
        state: dict[str, int] = {}

        def visit(name: str, path: list[str]) -> None:
            state[name] = 1
            for other in sorted(uses[name]):
                if state.get(other) == 1:
                    circle = path[path.index(other):] + [other]
                    rel = directory.relative_to(SRC)
                    found.append(f"{rel}/: files use each other in a circle: {' -> '.join(circle)}")
                elif other not in state:
                    visit(other, path + [other])
            state[name] = 2

        for name in sorted(files):
            if name not in state:
                visit(name, [name])
    return found


def main() -> int:
    layer = {m: i for i, group in enumerate(LAYERS) for m in group}
    edges: dict[tuple[str, str], set[str]] = {}
    problems = []
    for path in sorted(SRC.rglob("*.rs")):
        source = module_of(path)
        if source in ("lib", "main", "bin"):
            continue
        if source not in layer:
            problems.append(f"{path.relative_to(SRC)}: module {source!r} has no layer in {Path(__file__).name}")
            continue
        for target, tail in REFERENCE.findall(code(path.read_text())):
            if target == source:
                continue
            used = names(tail)
            edges.setdefault((source, target), set()).update(used)
            where = f"{path.relative_to(SRC)}: {source} uses crate::{target}"
            if target not in layer:
                problems.append(f"{where}, which has no layer")
            elif layer[target] >= layer[source]:
                problems.append(f"{where}, which is not below it")
            allowed = NARROW.get(source, {}).get(target)
            if allowed is not None and not used <= allowed:
                problems.append(f"{where}::{sorted(used - allowed)}; it may use only {sorted(allowed)}")
    problems += sibling_cycles()
    if "--dot" in sys.argv:
        print("digraph host {\n  rankdir=BT;")
        for (a, b), used in sorted(edges.items()):
            print(f'  "{a}" -> "{b}" [label="{len(used)}"];')
        print("}")
    for p in problems:
        print(f"layering: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"layering: {len(edges)} references between {len(layer)} modules, all pointing down, no cycle", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
