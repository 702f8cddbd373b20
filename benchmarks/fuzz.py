"""Fuzz mqbench with seeded random graphs: every graph x backend, prepared, calibrated, deployed, verified and
checked exactly as a user does it (tests/fuzz: the grammar and the harness).

Graph i is ``generate(seed + i, family)`` (family "all": image graphs for even seeds, sequence graphs
for odd ones), so a case reproduces with ``--graphs 1 --seed S``. Cases run in worker processes
(``--workers``, default 2) that are restarted after a crash of the process itself (a segfault in a
runtime), after ``--case-timeout`` seconds on one case, and every ``--cases-per-worker`` cases;
such a case is a ``crash``. Prints one table per backend (cases, ok, clear error, crash, verify
failed, silent) and the failures grouped by their normalized message, each with the smallest graph
that shows it; writes benchmarks/results/fuzz.json (host facts, every case's status and message).

Run: .venv/bin/python benchmarks/fuzz.py --graphs 40 --seed 0 [--backends tensorrt,qdq]
     [--family image|sequence|all] [--time-limit 600]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import select
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))  # the fuzz package and its helpers live with the tests

from _timing import print_table, write_json  # noqa: E402
from fuzz.harness import MAX_RELATIVE  # noqa: E402
from mqbench.backends import ParamsTable  # noqa: E402

STATUSES = ("ok", "clear_error", "crash", "verify_failed", "silent")
RESULT_PREFIX = "FUZZ-RESULT "
FAILURES = ("crash", "verify_failed", "silent", "clear_error")


# -- the worker: runs the cases it is sent, one JSON line per case -------------------------------------
def worker() -> None:
    import torch

    from fuzz.grammar import generate
    from fuzz.harness import run_case

    torch.set_num_threads(1)  # two workers share the cores
    # Results go to a copy of the pipe; anything else written to stdout (the exporter prints whole graphs on
    # some errors) goes where stderr goes, so the parent never waits on a line stuck behind it.
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    for line in sys.stdin:
        seed_text, family, backend = line.split()
        try:
            graph = generate(int(seed_text), family)
        except Exception as error:  # a fault of the grammar, not of mqbench: reported as its own stage
            case = {**_crash((int(seed_text), family, backend), f"the grammar failed: {error}"), "stage": "generate"}
            case["error_type"] = type(error).__name__
        else:
            case = run_case(graph, backend).to_dict()
            case["lines"] = graph.source.count("\n")
            case["tags"] = sorted(graph.tags)
        print(RESULT_PREFIX + json.dumps(case), file=results, flush=True)


# -- the parent: worker slots, each one process at a time ---------------------------------------------
Task = tuple[int, str, str]  # seed, family, backend


def _family_of(seed: int, family: str) -> str:
    return ("image", "sequence")[seed % 2] if family == "all" else family


def _crash(task: Task, message: str) -> dict[str, Any]:
    seed, family, backend = task
    return {
        "seed": seed,
        "family": _family_of(seed, family),
        "backend": backend,
        "status": "crash",
        "stage": "process",
        "error_type": "WorkerDied",
        "message": message,
        "location": "",
        "seconds": 0.0,
        "warnings": [],
    }


class Slot(threading.Thread):
    """Feeds tasks to one worker process and collects its results; restarts it when needed."""

    def __init__(self, tasks: queue.Queue, results: list, deadline: float, case_timeout: float, per_worker: int):
        super().__init__(daemon=True)
        self.tasks, self.results = tasks, results
        self.deadline, self.case_timeout, self.per_worker = deadline, case_timeout, per_worker
        self.process: subprocess.Popen | None = None
        self.done_here = 0

    def _start(self) -> subprocess.Popen:
        self.done_here = 0
        return subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )

    def _stop(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            self.process = None

    def _result(self, task: Task) -> dict[str, Any]:
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(" ".join(map(str, task)) + "\n")
        self.process.stdin.flush()
        until = time.monotonic() + self.case_timeout
        while True:
            left = until - time.monotonic()
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, left))
            if not ready:
                self._stop()
                return _crash(task, f"no result after {self.case_timeout:.0f} s (killed)")
            line = self.process.stdout.readline()
            if not line:  # the process ended mid-case
                code = self.process.wait()
                self.process = None
                return _crash(task, f"the worker process died (exit status {code}) during the case")
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])

    def run(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                try:
                    task = self.tasks.get_nowait()
                except queue.Empty:
                    return
                if self.process is None or self.done_here >= self.per_worker:
                    self._stop()
                    self.process = self._start()
                self.results.append(self._result(task))
                self.done_here += 1
        finally:
            self._stop()


# -- the report -----------------------------------------------------------------------------------------
def normalize(message: str) -> str:
    """A message with its particulars (names, numbers, paths) masked, so one defect is one group."""
    text = message.strip().splitlines()[0] if message.strip() else ""
    text = re.sub(r"(/[\w.\-]+)+", "<path>", text)
    while re.search(r"\([^()]*\)", text):  # the particulars in parentheses (op lists, shapes, tensors)
        text = re.sub(r"\([^()]*\)", "<...>", text)
    text = re.sub(r"(?<!\w)'[^']*'|\"[^\"]*\"", "'_'", text)
    names = r"t|x|ids|conv|deconv|fc|bn|act|q|k|v|o|ln|gate|emb|pos|pool|gap|up|shared|scale|weight|bias|drop"
    text = re.sub(rf"\b({names})\d+\b", "<name>", text)  # the grammar's layer and value names
    text = re.sub(r"\b([a-z]+)_\d+\b", r"\1", text)  # fx node names: add_3 -> add
    text = re.sub(r"\b\d+(\.\d+)?(e[-+]?\d+)?%?", "N", text)
    return text[:240]


def backend_rows(cases: list[dict[str, Any]], backends: Sequence[str]) -> list[list[object]]:
    rows = []
    for backend in [*backends, "all"]:
        mine = [c for c in cases if backend in ("all", c["backend"])]
        counts = Counter(c["status"] for c in mine)
        total = len(mine) or 1
        rows.append([backend, len(mine), *(f"{counts[s]} ({counts[s] / total:.0%})" for s in STATUSES)])
    return rows


def failure_groups(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for case in cases:
        if case["status"] != "ok":
            key = (case["status"], case["stage"], case["error_type"], normalize(case["message"]))
            groups[key].append(case)
    out: list[dict[str, Any]] = []
    for (status, stage, error_type, message), members in groups.items():
        smallest = min(members, key=lambda c: (c.get("lines", 0), c["seed"]))
        out.append(
            {
                "status": status,
                "stage": stage,
                "error_type": error_type,
                "message": message,
                "count": len(members),
                "backends": sorted({c["backend"] for c in members}),
                "seeds": sorted({c["seed"] for c in members}),
                "example": {
                    "seed": smallest["seed"],
                    "family": smallest["family"],
                    "backend": smallest["backend"],
                    "message": smallest["message"][:500],
                    "location": smallest.get("location", ""),
                },
            }
        )
    out.sort(key=lambda g: (FAILURES.index(g["status"]), -g["count"]))
    return out


def source_state() -> dict[str, Any]:
    """The commit measured and whether the package's sources differed from it (uncommitted edits)."""
    root = TESTS.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "src_edited": bool(git("status", "--porcelain", "src"))}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fuzz.py", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--graphs", type=int, default=10, help="how many graphs (seeds seed .. seed + graphs - 1)")
    parser.add_argument("--seed", type=int, default=0, help="the first graph's seed")
    parser.add_argument("--backends", default="", help="comma-separated backend names (default: every registered)")
    parser.add_argument("--family", default="all", choices=["image", "sequence", "all"])
    parser.add_argument("--workers", type=int, default=2, help="worker processes run at once")
    parser.add_argument("--time-limit", type=float, default=600.0, help="seconds; no new case starts after it")
    parser.add_argument("--case-timeout", type=float, default=180.0, help="seconds one case may take")
    parser.add_argument("--cases-per-worker", type=int, default=60, help="cases before a worker is restarted")
    parser.add_argument("--output", default="fuzz", help="name of the JSON file in benchmarks/results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.backend_list = [b for b in args.backends.split(",") if b] or list(ParamsTable)
    unknown = [b for b in args.backend_list if b not in ParamsTable]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; registered: {sorted(ParamsTable)}")
    if args.graphs < 1 or args.workers < 1 or args.cases_per_worker < 1:
        parser.error("--graphs, --workers and --cases-per-worker must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker()
        return
    tasks: queue.Queue = queue.Queue()
    planned = [(s, args.family, b) for s in range(args.seed, args.seed + args.graphs) for b in args.backend_list]
    for task in planned:
        tasks.put(task)
    results: list[dict[str, Any]] = []
    start = time.monotonic()
    slots = [
        Slot(tasks, results, start + args.time_limit, args.case_timeout, args.cases_per_worker)
        for _ in range(args.workers)
    ]
    for slot in slots:
        slot.start()
    for slot in slots:
        slot.join()
    elapsed = time.monotonic() - start
    results.sort(key=lambda c: (c["seed"], args.backend_list.index(c["backend"])))
    print(f"{len(results)} of {len(planned)} cases in {elapsed:.0f} s ({args.workers} workers)\n")
    print_table(["backend", "cases", *STATUSES], backend_rows(results, args.backend_list))
    checked = [c["check_relative"] for c in results if c.get("check_relative") is not None]
    if checked:
        print(
            f"\nindependent check: the largest output difference of a passing case is {max(checked):.2%} of its "
            f"range (median {statistics.median(checked):.2g}; a case is silent beyond {MAX_RELATIVE:.0%})"
        )
    groups = failure_groups(results)
    print(f"\n{len(groups)} failure group(s) (reproduce: benchmarks/fuzz.py --graphs 1 --seed S --backends B)")
    for group in groups:
        example = group["example"]
        print(
            f"- {group['status']} at {group['stage']} x{group['count']} on {','.join(group['backends'])}: "
            f"{group['error_type'] + ': ' if group['error_type'] else ''}{group['message']}\n"
            f"    e.g. seed {example['seed']} ({example['family']}) on {example['backend']}"
        )
    path = write_json(
        args.output,
        {
            "source": source_state(),
            "arguments": {k: v for k, v in vars(args).items() if k not in ("worker", "backend_list")},
            "backends": args.backend_list,
            "planned": len(planned),
            "completed": len(results),
            "seconds": elapsed,
            "check_relative_max": max(checked, default=None),
            "groups": groups,
            "cases": results,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
