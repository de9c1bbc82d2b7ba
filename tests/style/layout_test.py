#!/usr/bin/env python3
"""The tree as a newcomer reads it: every source folder (a folder under src/ or tests/, and a
top-level folder with sources) has a row in the README's layout table, and nothing a test run writes
(Testing/, build outputs) is tracked. The libraries' C++ lives under src/ (bench/ keeps scripts
only, so no binary reaches up into it), and the model and its backends read no environment: every
setting comes through a binary's contract table (api/worker_env.h)."""
import os
import re
import subprocess
import sys

ROOT = sys.argv[1]
readme = open(os.path.join(ROOT, "README.md")).read()
table = readme[readme.index("## Layout"):]
table = table[:table.index("\n\n", table.index("| path |"))]
listed = set(re.findall(r"`([^`]+/)`", table))
tracked = subprocess.run(["git", "-C", ROOT, "ls-files"], capture_output=True, text=True,
                         check=True).stdout.split()
folders = set()
for path in tracked:
    parts = path.split("/")
    if parts[0] in ("src", "tests") and len(parts) > 2:
        folders.add(parts[0] + "/" + parts[1] + "/")
    elif len(parts) > 1 and parts[-1].endswith((".cc", ".h", ".rs", ".go", ".py")):
        folders.add(parts[0] + "/")
missing = sorted(f for f in folders if f not in listed and not f.startswith("."))
written = sorted(p for p in tracked if p.startswith(("Testing/", "build/")))
outside_src = sorted(p for p in tracked
                     if p.startswith("bench/") and p.endswith((".cc", ".h", ".cu")))
reads_env = []
for path in tracked:
    if path.startswith(("src/model/", "src/backend/")) and path.endswith((".cc", ".h", ".cu", ".cuh")):
        text = open(os.path.join(ROOT, path), errors="replace").read()
        if re.search(r"\bgetenv\s*\(", text):
            reads_env.append(path)
ok = True
if outside_src:
    print("C++ outside src/ under bench/ (it belongs in src/bench/):", ", ".join(outside_src))
    ok = False
if reads_env:
    print("reads the environment (a setting belongs in a contract table, api/worker_env.h):",
          ", ".join(reads_env))
    ok = False
if missing:
    print("source folders without a row in the README's layout table:", ", ".join(missing))
    ok = False
if written:
    print("test or build outputs tracked:", ", ".join(written[:5]))
    ok = False
print("1 passed, 0 failed" if ok else "0 passed, 1 failed")
sys.exit(0 if ok else 1)
