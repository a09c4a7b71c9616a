"""Helpers the Python suites share (tests/chart, tests/node): running a command and polling
with a deadline. Each suite's conftest.py puts this folder on sys.path and re-exports them."""

import shlex
import subprocess
import time


def run(args, env=None, check=True, timeout=300, input=None):
    """Runs `args` (paths allowed), capturing its output; with `check`, a non-zero exit fails
    with the command line and the end of what it printed."""
    proc = subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True,
                          timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"{shlex.join(map(str, args))} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def wait_until(what, predicate, timeout=60.0, interval=0.25):
    """Polls `predicate` until it returns something truthy; fails after `timeout`. An
    AssertionError raised by the predicate counts as not yet (and is the last value shown)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            last = predicate()
        except AssertionError as e:
            last = e
        if last and not isinstance(last, AssertionError):
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last}")
        time.sleep(interval)
