"""Shared helpers of the process-level tests: named checks with a closing summary line, and the
worker processes still running."""
import subprocess
import sys


class Checks:
    def __init__(self):
        self.passed = 0
        self.failures = []

    def __call__(self, cond, what):
        if cond:
            self.passed += 1
            print(f"ok: {what}")
        else:
            self.failures.append(what)
            print(f"FAIL: {what}")

    def finish(self):
        print(f"{self.passed} passed, {len(self.failures)} failed")
        sys.exit(1 if self.failures else 0)


def workers_running(worker):
    out = subprocess.run(["pgrep", "-f", worker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]
