"""The shape of the code that issue 35 (the round protocol as one typed state machine) sets
bars for, recounted from the source with `ast`, so anyone can check them:

- classes with more than 20 attributes (outside the config dataclasses), and with more than
  25 public methods;
- non-test files over 500 lines (the config schema excepted);
- string-key reads of records in `pipelines/` and `resources/`: `x["key"]` and
  `x.get("key")` with a literal string key (what typed records replace).

    python benchmarks/code_shape.py            # prints the figures and the worst offenders
    python benchmarks/code_shape.py --json     # the same as JSON
    git worktree add /tmp/base 83a0f02 && python benchmarks/code_shape.py --root /tmp/base
"""

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("diloco_core", "pipelines", "resources")
RECORD_READERS = ("pipelines", "resources")
CONFIG_MODULES = {"diloco_core/config.py"}
SCHEMA_FILES = {"diloco_core/config.py", "pipelines/config_schema.py"}
MAX_ATTRIBUTES, MAX_PUBLIC_METHODS, MAX_LINES = 20, 25, 500


def _files(root: Path, packages) -> list[Path]:
    return sorted(p for pkg in packages for p in (root / pkg).rglob("*.py"))


def _is_class_var(annotation: ast.expr) -> bool:
    """`ClassVar[...]`: a constant of the class (a record's KIND, its field checks), not an
    attribute its instances carry."""
    node = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    return (isinstance(node, ast.Name) and node.id == "ClassVar") or (
        isinstance(node, ast.Attribute) and node.attr == "ClassVar")


def _attributes(cls: ast.ClassDef) -> set[str]:
    """Annotated class fields (not `ClassVar` constants) plus every `self.x = ...` target in
    its methods."""
    names = {n.target.id for n in cls.body
             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
             and not _is_class_var(n.annotation)}
    for node in ast.walk(cls):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
        for t in targets:
            for leaf in ast.walk(t):
                if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                        and leaf.value.id == "self"):
                    names.add(leaf.attr)
    return names


def _public_methods(cls: ast.ClassDef) -> list[str]:
    return [n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and not n.name.startswith("_")]


def _string_key_reads(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        subscript = (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
                     and isinstance(node.slice, ast.Constant)
                     and isinstance(node.slice.value, str))
        get = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr == "get" and bool(node.args)
               and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))
        count += subscript or get
    return count


def measure(root: Path = REPO) -> dict:
    big_classes, busy_classes, long_files, reads = [], [], [], {}
    for path in _files(root, PACKAGES):
        rel = path.relative_to(root).as_posix()
        source = path.read_text()
        tree = ast.parse(source)
        lines = source.count("\n") + 1
        if lines > MAX_LINES and rel not in SCHEMA_FILES:
            long_files.append({"file": rel, "lines": lines})
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            attrs, methods = _attributes(cls), _public_methods(cls)
            if len(attrs) > MAX_ATTRIBUTES and rel not in CONFIG_MODULES:
                big_classes.append({"class": f"{rel}:{cls.name}", "attributes": len(attrs)})
            if len(methods) > MAX_PUBLIC_METHODS:
                busy_classes.append({"class": f"{rel}:{cls.name}",
                                     "public_methods": len(methods)})
        if rel.split("/")[0] in RECORD_READERS:
            reads[rel] = _string_key_reads(tree)
    top = sorted(reads.items(), key=lambda kv: -kv[1])[:10]
    return {"classes_over_20_attributes": big_classes,
            "classes_over_25_public_methods": busy_classes,
            "files_over_500_lines": sorted(long_files, key=lambda f: -f["lines"]),
            "string_key_reads": sum(reads.values()),
            "string_key_reads_top": [{"file": f, "reads": n} for f, n in top]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--root", type=Path, default=REPO,
                        help="a checkout to measure (e.g. a worktree of an older commit)")
    args = parser.parse_args()
    shape = measure(args.root)
    if args.json:
        json.dump(shape, sys.stdout, indent=1)
        print()
        return
    print(f"string-key reads in pipelines/ and resources/: {shape['string_key_reads']}")
    for row in shape["string_key_reads_top"]:
        print(f"  {row['reads']:4d}  {row['file']}")
    for key, unit in (("classes_over_20_attributes", "attributes"),
                      ("classes_over_25_public_methods", "public_methods"),
                      ("files_over_500_lines", "lines")):
        print(f"{key.replace('_', ' ')}: {len(shape[key])}")
        for row in shape[key]:
            print(f"  {row[unit]:4d}  {row.get('class') or row.get('file')}")


if __name__ == "__main__":
    main()
