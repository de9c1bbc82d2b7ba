#!/usr/bin/env python3
"""Cuts a copy of a Go module's source down to what the test environment runs, before
scripts/testenv-build.sh builds it, so that the build compiles (and downloads) only that:

  testenv-trim.py coredns SRC PLUGIN,...   CoreDNS with only these plugins, as its own
      plugin.cfg mechanism does (core/plugin/zplugin.go, generated from plugin.cfg, imports every
      plugin; the imports of the others are dropped; the directive order stays).
  testenv-trim.py keda SRC TRIGGER,...     KEDA's operator and adapter with only these scalers:
      the other cases of the trigger switch in pkg/scaling/scalers_builder.go are dropped, and
      with them the files of pkg/scalers that nothing kept reaches (each brings its own client
      SDK: Elasticsearch, Kafka, MongoDB, the clouds'...).

Fails, naming what is missing, when the source no longer has the shape this expects (a new
release), so that a pin bump is noticed rather than built whole or broken.
"""
import os
import re
import shutil
import subprocess
import sys


def fail(msg):
    sys.exit(f"testenv-trim: {msg}")


def coredns(src, keep):
    path = os.path.join(src, "core/plugin/zplugin.go")
    lines = open(path).read().splitlines()
    plugin = re.compile(r'\t_ "github.com/coredns/coredns/plugin/(\w+)"$')
    found = {m.group(1) for m in map(plugin.match, lines) if m}
    if not keep <= found:
        fail(f"{path} imports no plugin {sorted(keep - found)}")
    kept = [l for l in lines if not plugin.match(l) or plugin.match(l).group(1) in keep]
    with open(path, "w") as f:
        f.write("\n".join(kept) + "\n")


def top_level_names(text):
    """The names a Go file declares at package level (functions, types, vars, consts; methods
    are reached through their types)."""
    names = set(re.findall(r"(?m)^(?:func|type|var|const) ([A-Za-z_]\w*)", text))
    for block in re.findall(r"(?ms)^(?:var|const|type) \((.*?)^\)", text):
        names |= set(re.findall(r"(?m)^\t([A-Za-z_]\w*)", block))
    return names


def keda(src, keep):
    builder = os.path.join(src, "pkg/scaling/scalers_builder.go")
    text = open(builder).read()
    try:
        start = text.index("\tswitch triggerType {\n", text.index("// TRIGGERS-START"))
        end = text.index("\tdefault:\n", start)
    except ValueError:
        fail(f"{builder} has no trigger switch between TRIGGERS-START and its default")
    head, *cases = re.split(r"(?m)^(?=\tcase )", text[start:end])
    kept = [c for c in cases if keep & set(re.findall(r'"([^"]+)"', c.split("\n", 1)[0]))]
    found = {n for c in kept for n in re.findall(r'"([^"]+)"', c.split("\n", 1)[0])}
    if not keep <= found:
        fail(f"{builder} has no trigger {sorted(keep - found)}")
    with open(builder, "w") as f:
        f.write(text[:start] + head + "".join(kept) + text[end:])

    # The files of package scalers that the kept cases reach: their constructors' files, then the
    # files declaring what the compiler finds undefined, until the package builds.
    pkg = os.path.join(src, "pkg/scalers")
    stash = os.path.join(src, ".trimmed-scalers")
    os.makedirs(stash, exist_ok=True)
    wanted = set(re.findall(r"scalers\.([A-Za-z_]\w*)", "".join(kept)))
    declares = {}
    for f in os.listdir(pkg):
        if not f.endswith(".go"):
            continue
        if f.endswith("_test.go"):
            os.remove(os.path.join(pkg, f))
            continue
        names = top_level_names(open(os.path.join(pkg, f)).read())
        if f != "scaler.go" and not names & wanted:
            os.rename(os.path.join(pkg, f), os.path.join(stash, f))
            declares[f] = names
    while True:
        # -trimpath as the binaries' build, which then finds these packages compiled.
        out = subprocess.run(["go", "build", "-trimpath", "-gcflags=-e", "./pkg/scalers"],
                             cwd=src, capture_output=True, text=True)
        if out.returncode == 0:
            break
        undefined = set(re.findall(r"undefined: ([A-Za-z_]\w*)", out.stderr))
        back = {f for f, names in declares.items() if names & undefined}
        if not back:
            fail(f"pkg/scalers does not build with the kept scalers:\n{out.stderr}")
        for f in back:
            os.rename(os.path.join(stash, f), os.path.join(pkg, f))
            del declares[f]
    shutil.rmtree(stash)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("coredns", "keda"):
        fail("usage: testenv-trim.py coredns|keda SRC NAME,...")
    what, src, keep = sys.argv[1], sys.argv[2], set(sys.argv[3].split(","))
    (coredns if what == "coredns" else keda)(src, keep)


if __name__ == "__main__":
    main()
