#!/usr/bin/env python3
"""The per-kernel table of a profiled decode: reads the CSV that
`ncu --csv --print-units base --metrics gpu__time_duration.sum` wrote (scripts/gpu-check.sh
--profile) and prints, per kernel name, launches and device time per step, largest first, with the
step's total. Usage: ncu_table.py CSV STEPS [TITLE]"""
import csv
import re
import sys
from collections import defaultdict

path, steps = sys.argv[1], int(sys.argv[2])
title = sys.argv[3] if len(sys.argv) > 3 else path
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
         "second": 1e6, "s": 1e6}
rows = [line for line in open(path, encoding="utf-8", errors="replace") if line.startswith('"')]
total = defaultdict(float)
count = defaultdict(int)
for r in csv.DictReader(rows):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = r["Kernel Name"]
    # "void ns::(anon)::Kernel<T, 8>(args...)" -> "Kernel<T, 8>"
    name = re.sub(r"\(.*\)$", "", name)
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\b[A-Za-z_]\w*::", "", name).replace("(anonymous namespace)::", "")
    value = float(r["Metric Value"].replace(",", ""))
    total[name[:70]] += value * scale.get(r.get("Metric Unit", "nsecond"), 1e-3)
    count[name[:70]] += 1
step_us = sum(total.values()) / max(steps, 1)
print(f"--- {title}: {sum(count.values()) / max(steps, 1):.0f} kernels, "
      f"{step_us:.1f} us of device time per step")
print(f"{'kernel':70} {'per step':>8} {'us/step':>9} {'share':>6} {'us each':>8}")
for name in sorted(total, key=total.get, reverse=True):
    per = total[name] / steps
    print(f"{name:70} {count[name] / steps:8.1f} {per:9.1f} {100 * per / step_us:5.1f}% "
          f"{total[name] / count[name]:8.2f}")
