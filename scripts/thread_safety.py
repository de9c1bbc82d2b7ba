#!/usr/bin/env python3
"""Clang's thread-safety analysis over the sources (STYLE.md: annotations a compiler checks).

The shipped build is g++, which ignores ABSL_GUARDED_BY and friends; this pass runs clang's
-Wthread-safety in syntax-only mode over every translation unit of the build (its
compile_commands.json) that includes a file using absl::Mutex (from the build's own dependency
records, `ninja -t deps`), and fails on any finding. It first analyzes
tests/style/unguarded_probe.cc and requires a finding there, so a pass that checks nothing fails.

usage: thread_safety.py BUILD_DIR [--jobs N]
"""
import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = os.path.join(ROOT, "tests", "style", "unguarded_probe.cc")
FLAGS = ["-fsyntax-only", "-Wno-everything", "-Wthread-safety", "-Werror=thread-safety"]
# g++ options clang does not take (scheduling flags of the CPU kernels).
GCC_ONLY = {"-fschedule-insns", "-fsched-pressure"}


def clang_args(command, source):
    """The build's compile command as a clang syntax-only analysis of `source`."""
    args, out, skip = shlex.split(command)[1:], [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
        elif a in ("-c", "-MD", "-MMD") or a in GCC_ONLY or a.startswith("-O") or a == source:
            continue
        else:
            out.append(a)
    return out + FLAGS + [source]


def lock_users(build):
    """Sources and headers of this tree that use a mutex, and each object's dependencies."""
    listed = subprocess.run(["git", "-C", ROOT, "grep", "-l", "-e", "absl::Mutex", "--",
                             "*.h", "*.cc"], capture_output=True, text=True, check=True)
    users = {os.path.join(ROOT, f) for f in listed.stdout.split()}
    deps, current = {}, None
    text = subprocess.run(["ninja", "-C", build, "-t", "deps"], capture_output=True, text=True,
                          check=True).stdout
    for line in text.splitlines():
        if line and not line.startswith(" "):
            current = os.path.normpath(os.path.join(build, line.split(":")[0]))
            deps[current] = set()
        elif line.strip() and current:
            deps[current].add(os.path.normpath(os.path.join(build, line.strip())))
    return users, deps


def analyze(clang, entry_dir, args):
    p = subprocess.run([clang] + args, cwd=entry_dir, capture_output=True, text=True)
    return p.returncode, p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    opts = ap.parse_args()
    build = os.path.abspath(opts.build)
    clang = shutil.which("clang++")
    if clang is None:
        sys.exit("thread_safety: clang++ is missing (scripts/setup.sh installs Debian's clang)")
    with open(os.path.join(build, "compile_commands.json")) as f:
        entries = [e for e in json.load(f) if e["file"].endswith(".cc")]
    users, deps = lock_users(build)

    # The probe, with the flags of any C++ unit of the build: it must be reported.
    base = entries[0]
    rc, err = analyze(clang, base["directory"], clang_args(base["command"].replace(
        base["file"], PROBE), PROBE))
    if rc == 0 or "requires holding mutex" not in err:
        sys.exit("thread_safety: the analysis did not report the probe's unguarded access:\n" + err)

    todo = []
    for e in entries:
        words = shlex.split(e["command"])
        obj = os.path.normpath(os.path.join(e["directory"], words[words.index("-o") + 1]))
        if e["file"] in users or deps.get(obj, set()) & users:
            todo.append(e)
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(opts.jobs) as pool:
        results = pool.map(lambda e: (e["file"], *analyze(clang, e["directory"],
                                                          clang_args(e["command"], e["file"]))),
                           todo)
        for source, rc, err in results:
            if rc != 0:
                failed += 1
                print(f"--- {os.path.relpath(source, ROOT)}\n{err}", end="")
    print(f"thread_safety: {len(todo)} of {len(entries)} translation units use a mutex; "
          f"{failed} with findings")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
