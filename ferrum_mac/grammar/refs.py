"""A schema's local `$ref`s resolved into one flat table of definitions, recursion unrolled to a bounded depth.

`hoist` gives a schema whose every local reference (`#/$defs/Item`, `#/definitions/Item`,
`#/properties/a/items`, `#`) points into a `#/$defs/` table of its own: the schema can then be
placed anywhere (a tool's parameters inside the call's wrapper) and its pointers still resolve.
`unroll` copies the definitions of each cycle of references once per level, the deepest level's
references to the cycle replaced by `false`, so a recursive schema (a linked list, a tree)
nests at most `RECURSION_DEPTH` deep and a constrained answer always ends.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

from ferrum_mac.errors import FerrumError
from ferrum_mac.grammar.schema_tree import DEFINITIONS, subschemas, with_subschemas

RECURSION_DEPTH = 8
DEFS = "#/$defs/"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class RefError(FerrumError):
    """A `$ref` that points nowhere in its schema."""


def hoist(schema: Any, prefix: str = "", taken: set[str] | None = None) -> tuple[Any, dict[str, Any]]:
    """`schema` with its local references pointing into a flat table (names start with `prefix`
    and avoid `taken`, which grows by them), and that table. Definitions no reference reaches
    are left out; references to other documents are left as they are."""
    taken = taken if taken is not None else set()
    names: dict[str, str] = {}  # pointer -> its definition's name
    defs: dict[str, Any] = {}
    pending: list[tuple[str, Any]] = []

    def name_of(pointer: str) -> str:
        if pointer not in names:
            target = resolve(schema, pointer)
            names[pointer] = unique_name(prefix + (pointer.rsplit("/", 1)[-1] or "root"), taken)
            pending.append((names[pointer], target))
        return names[pointer]

    def rewrite(node: Any, key: str = "") -> Any:
        if not isinstance(node, dict):
            return node
        out = with_subschemas(node, rewrite)
        for container in DEFINITIONS:
            out.pop(container, None)
        ref = out.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = DEFS + name_of(pointer_of(ref))
        return out

    root = rewrite(schema)
    while pending:
        name, target = pending.pop()
        defs[name] = rewrite(target)
    return root, defs


def pointer_of(ref: str) -> str:
    """The JSON pointer of a local reference: "#/$defs/a%20b" -> "/$defs/a b", "#" -> ""."""
    return unquote(ref[1:]).rstrip("/") if ref not in ("#", "#/") else ""


def resolve(schema: Any, pointer: str) -> Any:
    node = schema
    for part in pointer.split("/")[1:] if pointer else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise RefError(f"'$ref' '#{pointer[:100]}' points nowhere in the schema")
    if not isinstance(node, (dict, bool)):
        raise RefError(f"'$ref' '#{pointer[:100]}' points at {type(node).__name__}, not at a schema")
    return node


def unique_name(wanted: str, taken: set[str]) -> str:
    base = _UNSAFE.sub("_", wanted)[:60] or "def"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def unroll(defs: dict[str, Any], depth: int = RECURSION_DEPTH, taken: set[str] | None = None) -> dict[str, Any]:
    """`defs` with each cycle of references unrolled `depth` levels: its level-1 definitions keep
    their names (what everything else refers to), level k refers to level k+1 within the cycle,
    and the last level's references to the cycle are `false` (a branch the answer cannot take)."""
    taken = taken if taken is not None else set(defs)
    taken.update(defs)
    edges = {name: refs_in(schema) & defs.keys() for name, schema in defs.items()}
    out = dict(defs)
    for cycle in cycles(edges):
        levels = [{m: m for m in cycle}]
        levels += [{m: unique_name(f"{m}_{k}", taken) for m in cycle} for k in range(2, depth + 1)]
        for k, level in enumerate(levels):
            deeper: dict[str, str | None] = levels[k + 1] if k + 1 < len(levels) else dict.fromkeys(cycle)
            for member in cycle:
                out[level[member]] = retarget(defs[member], deeper)
    return out


def refs_in(node: Any) -> set[str]:
    """The definitions `node` refers to (through `#/$defs/`, not following them)."""
    if not isinstance(node, dict):
        return set()
    ref = node.get("$ref")
    found = {ref[len(DEFS) :]} if isinstance(ref, str) and ref.startswith(DEFS) else set()
    for sub in subschemas(node):
        found |= refs_in(sub)
    return found


def reachable(root: Any, defs: dict[str, Any]) -> list[str]:
    """The definitions `root` refers to, directly or through others, in `defs`' order."""
    seen: set[str] = set()
    todo = sorted(refs_in(root) & defs.keys())
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(refs_in(defs[name]) & defs.keys())
    return [name for name in defs if name in seen]


def retarget(node: Any, names: dict[str, str | None]) -> Any:
    """`node` with its references to `names` pointed at their new names (None: `false`)."""
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith(DEFS) and ref[len(DEFS) :] in names:
        new = names[ref[len(DEFS) :]]
        if new is None:
            return False
        node = {**node, "$ref": DEFS + new}
    return with_subschemas(node, lambda sub, key: retarget(sub, names))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of the graph `edges` that hold a cycle (Tarjan's, without
    recursion: a hostile schema may chain thousands of definitions)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1 or node in edges[node]:
                        found.append(part)
    return found
