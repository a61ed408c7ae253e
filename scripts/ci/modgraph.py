#!/usr/bin/env python3
"""The library's module import graph, from the sources alone: one line per
edge, `from to`, each a module path (`model::process`; the crate root is
`crate`). scripts/ci/check-cycles and scripts/ci/check-layers read it.

    scripts/ci/modgraph.py [src]          # the edges, sorted
    scripts/ci/modgraph.py --top [src]    # between top-level modules only

Why by hand: the checks used cargo-modules, which builds rust-analyzer's
crates when it is installed (557 s of a fresh 2-core machine's CI run,
measured), for one question a few hundred lines of Python answer: which
module uses which. It reads what cargo-modules' "uses" edges meant, with
the library's default cfg (no `cfg(test)`):

- the modules are the files `mod` declarations reach from src/lib.rs
  (src/main.rs is the binary, not the library), less those declared
  under `#[cfg(test)]`;
- comments, strings and every item, field, arm or statement under
  `#[cfg(test)]` are dropped before reading;
- an edge is a path that names another module: in `use` trees (braces
  expanded), and in code (`crate::…`, `super::…`, `self::…`, and a child
  module's name followed by `::`);
- a module's use of what encloses it (`super::…`, its parent's items)
  is not an edge: the parent holds the child, so a loop through the two
  is the child's access to its own enclosing scope, not a cycle between
  modules (cargo-modules did not count those either);
- a path through a module's re-export (`crate::model::DeviceInfo`, which
  model/mod.rs re-exports from model/device.rs) points at the module
  that defines the name, as a compiler would resolve it, so a child that
  names a sibling's item through its parent does not read as a loop.

What it does not see: paths built by macros and names brought in by a
glob `use` of another module and then used bare (the glob itself is an
edge, so the dependency is still counted).
"""

import os
import re
import sys

ITEM = re.compile(
    r"(?<!')\b(?:struct|enum|fn|trait|type|const|static|union|mod|macro_rules!)\s+([A-Za-z_]\w*)")
PATH = re.compile(r"(?<![\w:])((?:crate|super|self)(?:\s*::\s*[A-Za-z_]\w*)+)")
MOD_DECL = re.compile(r"(?:pub(?:\([^)]*\))?\s+)?mod\s+([A-Za-z_]\w*)\s*;")
USE = re.compile(r"(?<![\w:])use\s+([^;]+);")
RESERVED = {"crate", "super", "self"}


def strip_comments_and_strings(text):
    """The text with comments, string and char literals blanked (lines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    if text[i] == "\n":
                        out.append("\n")
                    i += 1
        elif c == "r" and re.match(r'r#*"', text[i:i + 10]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i)):
            i += 2 if c == "b" else 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            out.append('""')
            i += 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{..}'), else a lifetime.
            m = re.match(r"'(?:\\.|\\u\{[0-9a-fA-F]+\}|[^\\'])'", text[i:])
            if m:
                out.append("' '")
                i += len(m.group(0))
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def drop_cfg_test(text):
    """Remove what `#[cfg(test)]` annotates: up to the end of its block,
    or its `;`, or a `,` outside brackets (a field, a variant, an arm)."""
    attr = re.compile(r"#\[cfg\(test\)\]")
    while True:
        m = attr.search(text)
        if not m:
            return text
        i, depth = m.end(), 0
        end = len(text)
        while i < len(text):
            c = text[i]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
            elif c == "{":
                j, braces = i, 0
                while j < len(text):
                    if text[j] == "{":
                        braces += 1
                    elif text[j] == "}":
                        braces -= 1
                        if braces == 0:
                            break
                    j += 1
                end = j + 1
                break
            elif c == ";" or (c == "," and depth == 0):
                end = i + 1
                break
            i += 1
        text = text[:m.start()] + "\n" * text.count("\n", m.start(), end) + text[end:]


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> [a::b, a::c::d, a::c::e] (aliases and globs kept as the path)."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix, s):
        s = s.strip(",")
        if not s:
            return
        k = s.find("{")
        if k < 0:
            out.append(prefix + s)
            return
        head, inner = s[:k], s[k + 1:s.rfind("}")]
        depth, start, parts = 0, 0, []
        for idx, ch in enumerate(inner):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(inner[start:idx])
                start = idx + 1
        parts.append(inner[start:])
        for p in parts:
            if p == "self":
                out.append((prefix + head).rstrip(":"))
            elif p:
                walk(prefix + head, p)

    walk("", tree)
    return [p.replace(" ", "") for p in out if p]


def expand_use_aliased(tree):
    """Like expand_use, with the name each path is known by: [(alias, path)]."""
    out = []
    for part in expand_use(re.sub(r"\s+as\s+(\w+)", r"@\1", tree)):
        path, _, alias = part.partition("@")
        last = path.split("::")[-1]
        if last == "self":
            path = path.rsplit("::", 1)[0]
            last = path.split("::")[-1]
        out.append((alias or last, path))
    return out


class Crate:
    def __init__(self, src):
        self.src = src
        self.files = {}  # module path (tuple) -> cleaned text
        self.load((), os.path.join(src, "lib.rs"))
        self.defined = {m: set(ITEM.findall(t)) for m, t in self.files.items()}
        self.reexports = {m: self.read_reexports(m) for m in self.files}

    def load(self, module, path):
        with open(path, encoding="utf-8") as fh:
            raw = strip_comments_and_strings(fh.read())
        text = drop_cfg_test(raw)
        self.files[module] = text
        here = os.path.dirname(path)
        own_dir = here if os.path.basename(path) in ("lib.rs", "mod.rs") else os.path.join(here, os.path.basename(path)[:-3])
        for name in MOD_DECL.findall(text):
            for cand in (os.path.join(own_dir, name + ".rs"), os.path.join(own_dir, name, "mod.rs")):
                if os.path.exists(cand):
                    self.load(module + (name,), cand)
                    break

    def children(self, module):
        return {m[-1] for m in self.files if len(m) == len(module) + 1 and m[:-1] == module}

    def absolute(self, module, segs):
        """A path as written in `module` -> absolute segments, or None (an extern crate)."""
        segs = list(segs)
        if segs[0] == "crate":
            return segs[1:]
        if segs[0] in ("self", "super"):
            base = list(module)
            while segs and segs[0] in ("self", "super"):
                if segs.pop(0) == "super":
                    if not base:
                        return None
                    base.pop()
            return base + segs
        if segs[0] in self.children(module):
            return list(module) + segs
        if not module and segs[0] in self.children(()):
            return segs
        return None

    def read_reexports(self, module):
        """name -> absolute path of what `module` re-exports under that name; '*' -> globbed modules."""
        out = {"*": []}
        for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", self.files[module]):
            for p in expand_use(m.group(1)):
                segs = p.split("::")
                absolute = self.absolute(module, segs)
                if absolute is None:
                    continue
                if absolute[-1] == "*":
                    out["*"].append(tuple(absolute[:-1]))
                else:
                    out[absolute[-1]] = absolute
        return out

    def resolve(self, segs, seen=None):
        """Absolute segments -> the module that defines what they name."""
        mod = ()
        rest = list(segs)
        while rest and (mod + (rest[0],)) in self.files:
            mod += (rest.pop(0),)
        if not rest or rest[0] == "*":
            return mod
        name = rest[0]
        seen = seen or set()
        if (mod, name) in seen:
            return mod
        seen.add((mod, name))
        if name in self.defined.get(mod, ()):
            return mod
        target = self.reexports.get(mod, {}).get(name)
        if target is not None:
            return self.resolve(target, seen)
        for glob in self.reexports.get(mod, {}).get("*", []):
            found = self.resolve(list(glob) + [name], seen)
            if found != tuple(glob) or name in self.defined.get(found, ()):
                return found
        return mod

    def edges(self):
        out = set()
        for module, text in self.files.items():
            paths = []
            for m in USE.finditer(text):
                paths += [p.split("::") for p in expand_use(m.group(1))]
            body = USE.sub(" ", text)
            paths += [re.sub(r"\s+", "", p).split("::") for p in PATH.findall(body)]
            # Code that names a module by a name in scope: a child, or a
            # module a `use` brought in (`use crate::expose::{self, …}`).
            scope = {child: list(module) + [child] for child in self.children(module)}
            for m in USE.finditer(text):
                for alias, p in expand_use_aliased(m.group(1)):
                    absolute = self.absolute(module, p.split("::"))
                    if absolute is not None and tuple(absolute) in self.files:
                        scope[alias] = absolute
            for alias, target in scope.items():
                paths += [["crate"] + target + [s]
                          for s in re.findall(r"(?<![\w:])" + alias + r"\s*::\s*(\w+)", body)]
            for segs in paths:
                segs = [s for s in segs if s]
                if not segs:
                    continue
                absolute = self.absolute(module, segs)
                if absolute is None:
                    continue
                target = self.resolve(absolute)
                # A module may use what encloses it (`super::…`): its
                # parent holds it, so that is not an edge of the graph.
                if target in self.files and module[:len(target)] != target:
                    out.add((module, target))
        return out


def name(module):
    return "::".join(module) if module else "crate"


def main(argv):
    top = "--top" in argv
    args = [a for a in argv if a != "--top"]
    src = args[0] if args else "src"
    crate = Crate(src)
    edges = crate.edges()
    if top:
        edges = {(a[:1], b[:1]) for a, b in edges if a[:1] and b[:1] and a[:1] != b[:1]}
    for a, b in sorted(edges):
        print(name(a), name(b))


if __name__ == "__main__":
    main(sys.argv[1:])
