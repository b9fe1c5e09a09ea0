#!/usr/bin/env python3
"""Reads a nonstop event journal (docs/journal.md) for shell scripts.

    journal.py last-step JOURNAL          the highest completed step (-1: none)
    journal.py world JOURNAL              the newest plan's world size (0: no plan yet)
    journal.py count JOURNAL EVENT        how many records of EVENT
    journal.py field JOURNAL EVENT FIELD  FIELD of the last EVENT record ("" if none)
    journal.py losses JOURNAL             "step loss" per step record, in journal order (repr: every bit)

A journal that does not exist yet reads as empty, and a line cut short (a
record being written) is skipped: a script polling a running job's journal
sees what is complete. Only the standard library: any python3 runs it.
"""
import json
import sys


def records(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if isinstance(r, dict):
                    yield r
    except FileNotFoundError:
        return


def main(argv):
    usage = __doc__.split("\n\n")[1]
    if len(argv) < 3:
        sys.exit("usage:\n" + usage)
    what, path, rest = argv[1], argv[2], argv[3:]
    if what == "last-step":
        print(max((r["step"] for r in records(path) if r.get("event") == "step" and isinstance(r.get("step"), int)),
                  default=-1))
    elif what == "world":
        world = 0
        for r in records(path):
            if r.get("event") == "plan" and isinstance(r.get("members"), list):
                world = len(r["members"])
        print(world)
    elif what == "count" and len(rest) == 1:
        print(sum(1 for r in records(path) if r.get("event") == rest[0]))
    elif what == "field" and len(rest) == 2:
        value = ""
        for r in records(path):
            if r.get("event") == rest[0]:
                value = r.get(rest[1], "")
        print(value)
    elif what == "losses":
        for r in records(path):
            if r.get("event") == "step" and "step" in r and "loss" in r:
                print(r["step"], repr(r["loss"]))
    else:
        sys.exit(f"journal.py: unknown command {' '.join(argv[1:2] + rest)!r}; usage:\n" + usage)


if __name__ == "__main__":
    main(sys.argv)
