"""How fast the command line answers: help and a refused option, as whole processes, this checkout against a
baseline one (issue 30: each ≤ 0.5 s wall and ≤ 80 MB peak).

    python benchmarks/startup.py [--baseline PATH] [--repeats 7]

``--baseline`` is another checkout (e.g. ``git worktree add /tmp/baseline 2411d36``); each runs with
``PYTHONPATH`` at its ``src``, through the installed ``ghostlayers`` script. Runs alternate between the two
checkouts so that both see the same load on a shared machine. Each run's wall time, CPU time (user + system)
and peak RSS come from ``os.wait4`` on that one process; medians go to ``benchmarks/results/startup.json``
and, as a table, ``startup.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMANDS = {
    "ghostlayers --help": (["--help"], 0),
    "ghostlayers prune --help": (["prune", "--help"], 0),
    "ghostlayers prune --alpha 7 --output x": (["prune", "--alpha", "7", "--output", "x"], 2),
}


def entry() -> list[str]:
    """The installed console script beside this Python (not a pyenv shim, whose own start would count)."""
    script = Path(sys.executable).parent / "ghostlayers"
    return [sys.executable, str(script)] if script.is_file() else [sys.executable, "-m", "ghostlayers"]


def measure(argv: list[str], code: int, cwd: str, checkout: Path | None = None) -> dict[str, float]:
    """One whole process: wall seconds, CPU seconds and peak RSS (MiB) of that process alone."""
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")} if checkout else None
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    with process.stderr:
        errors = process.stderr.read().decode()
    if process.returncode != code:
        raise SystemExit(f"{checkout}: {' '.join(argv)} exited {process.returncode}, not {code}:\n{errors}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_mib": usage.ru_maxrss / 1024}


def table(results: dict) -> str:
    names = list(results["checkouts"])
    head = " | ".join(f"{n} wall s | {n} CPU s | {n} peak MiB" for n in names)
    lines = [
        f"Medians of {results['repeats']} runs each, {results['machine']}; the interpreter alone (`python -c pass`) "
        f"takes {results['python']['wall_s']:.2f} s wall, {results['python']['cpu_s']:.2f} s CPU here\n",
        f"| command | {head} |",
        "|---|" + "---:|" * 3 * len(names),
    ]
    for command in COMMANDS:
        cells = [results["checkouts"][n][command] for n in names]
        row = " | ".join(f"{c['wall_s']:.2f} | {c['cpu_s']:.2f} | {c['peak_mib']:.0f}" for c in cells)
        lines.append(f"| `{command}` | {row} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to compare with (its src is used)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "startup.json", help="and .md beside it")
    args = parser.parse_args()
    checkouts = ({"baseline": args.baseline.resolve()} if args.baseline else {}) | {"new": HERE.parent}
    runs: dict[str, dict[str, list]] = {name: {c: [] for c in COMMANDS} for name in checkouts}
    bare = []
    with tempfile.TemporaryDirectory() as cwd:  # where a refused --output x would go (it must not appear)
        for _ in range(args.repeats):
            bare.append(measure([sys.executable, "-c", "pass"], 0, cwd))
            for command, (argv, code) in COMMANDS.items():
                for name, checkout in checkouts.items():
                    runs[name][command].append(measure([*entry(), *argv], code, cwd, checkout))
        assert not os.listdir(cwd), "a refused command wrote a file"
    results = {
        "repeats": args.repeats,
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "python": {k: statistics.median(r[k] for r in bare) for k in bare[0]},
        "checkouts": {
            name: {c: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for c, rs in per.items()}
            for name, per in runs.items()
        },
        "paths": {name: str(path) for name, path in checkouts.items()},
        "runs": runs,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    args.json.with_suffix(".md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
