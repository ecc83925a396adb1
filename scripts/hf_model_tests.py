"""transformers' own model tests, run twice: with transformers' default attention and with
attnkit as the default (:func:`attnkit.interop.use_by_default`). Prints, per model file, the
passed / failed / skipped counts of each run and every test that fails only with attnkit.

A developer tool, not part of CI: transformers' model tests are not on PyPI. Point it at a
directory that holds transformers' ``tests/`` package (``tests/test_modeling_common.py``,
``tests/models/<model>/test_modeling_<model>.py``, ...) at the installed transformers'
version; it downloads nothing and runs nothing but pytest on the files named::

    python scripts/hf_model_tests.py /path/to/checkout llama qwen3 --timeout 900
    python scripts/hf_model_tests.py /path/to/checkout llama -k "attention or loss"

Each run is ``python -m pytest -p no:cacheprovider -v -rfE tests/models/M/test_modeling_M.py``
in that directory, in a fresh process, with this file loaded as a pytest plugin; under
``ATTNKIT_HF_DEFAULT=attnkit`` the plugin calls ``use_by_default(instead_of=("sdpa",
"eager"))`` before the tests are collected: every model whose layers call the attention
interface and that is loaded without a name gets attnkit, the models without sdpa (Gemma 2,
gpt-oss) too. Slow and GPU tests stay skipped as transformers skips them (``RUN_SLOW`` unset).
``--json PATH`` writes every test's outcome in both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

MODE_VARIABLE = "ATTNKIT_HF_DEFAULT"
MODES = ("default", "attnkit")
_RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
# the short summary; a failed subtest (``self.subTest``) is ``SUBFAILED[name] nodeid``, and its
# test's own -v line says PASSED: the test counts as failed
_REASON = re.compile(r"^(SUBFAILED|FAILED|ERROR)(\[[^\]]*\])? (\S+::\S+)(?: - (.*))?$")
_FAILING = ("FAILED", "ERROR")


_HANDLE: list[object] = []


def pytest_configure(config: object) -> None:
    """The plugin half: make attnkit transformers' default in the attnkit run."""
    if os.environ.get(MODE_VARIABLE) == "attnkit":
        import attnkit.interop

        # eager too: Gemma 2 and gpt-oss have no sdpa, and attnkit computes them
        _HANDLE.append(attnkit.interop.use_by_default(instead_of=("sdpa", "eager")))


def pytest_terminal_summary(terminalreporter: object) -> None:
    """Say how many models got attnkit by default (0 would mean the run tested nothing)."""
    for handle in _HANDLE:
        print(f"\nattnkit default: {getattr(handle, 'applied', 0)} models got attnkit")


@dataclass
class Run:
    """One pytest run of one model file: each test's outcome and each failure's reason."""

    outcomes: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    timed_out: bool = False
    returncode: int | None = None
    applied: int | None = None  # models that got attnkit by default (the attnkit run)

    def count(self, *outcomes: str) -> int:
        return sum(1 for o in self.outcomes.values() if o in outcomes)

    def summary(self) -> str:
        text = (
            f"{self.count('PASSED', 'XPASS')} passed, {self.count(*_FAILING)} failed, "
            f"{self.count('SKIPPED', 'XFAIL')} skipped"
        )
        if self.applied is not None:
            text += f"; {self.applied} models got attnkit by default"
        return text + (" (timed out: partial)" if self.timed_out else "")


def parse(output: str) -> Run:
    """Read pytest's ``-v`` lines and its ``-rfE`` short summary."""
    run = Run()
    for line in output.splitlines():
        found = _RESULT.match(line)
        if found:
            run.outcomes[found[1]] = found[2]
            continue
        found = _REASON.match(line)
        if found:
            test = found[3]
            run.outcomes[test] = "ERROR" if found[1] == "ERROR" else "FAILED"
            reason = f"{found[2] or ''} {found[4] or ''}".strip()
            run.reasons[test] = "; ".join(r for r in (run.reasons.get(test), reason) if r)
    return run


def model_test_file(root: Path, model: str) -> Path:
    """``tests/models/<model>/test_modeling_<model>.py`` under ``root``."""
    return root / "tests" / "models" / model / f"test_modeling_{model}.py"


def run_file(root: Path, model: str, mode: str, timeout: float, select: str | None) -> Run:
    """One model file in one mode, in a fresh Python process."""
    scripts = str(Path(__file__).resolve().parent)
    paths = [scripts, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, MODE_VARIABLE: mode, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    env["COLUMNS"] = "400"  # pytest cuts the short summary's messages to the terminal's width
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "hf_model_tests"]
    command += ["-v", "-rfE", "--tb=line", "-W", "ignore::DeprecationWarning"]
    command += [str(model_test_file(root, model).relative_to(root))]
    if select:
        command += ["-k", select]
    try:
        done = subprocess.run(
            command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        run = parse(out)
        run.timed_out = True
        return run
    run = parse(done.stdout)
    run.returncode = done.returncode
    applied = re.search(r"attnkit default: (\d+) models", done.stdout)
    run.applied = int(applied[1]) if applied else None
    if not run.outcomes and done.returncode not in (0, 5):
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        run.outcomes["<collection>"] = "ERROR"
        run.reasons["<collection>"] = " | ".join(tail)
    return run


def only_with_attnkit(default: Run, attnkit: Run) -> list[str]:
    """Tests that fail with attnkit as the default and pass (or skip) with transformers'."""
    return sorted(
        t
        for t, o in attnkit.outcomes.items()
        if o in _FAILING and default.outcomes.get(t) not in (*_FAILING, None)
    )


def report(model: str, runs: dict[str, Run]) -> list[str]:
    """The lines printed for one model file."""
    lines = [f"## {model}"]
    lines += [f"  {mode:8} {runs[mode].summary()}" for mode in MODES]
    regressions = only_with_attnkit(runs["default"], runs["attnkit"])
    fixed = only_with_attnkit(runs["attnkit"], runs["default"])
    lines.append(f"  fail only with attnkit: {len(regressions)}")
    for test in regressions:
        lines.append(f"    {test.split('::', 1)[1]}: {runs['attnkit'].reasons.get(test, '')[:200]}")
    if fixed:
        lines.append(f"  fail only with transformers' default: {len(fixed)}")
        lines += [f"    {t.split('::', 1)[1]}" for t in fixed]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path, help="directory holding transformers' tests/ package")
    parser.add_argument("models", nargs="+", help="model folders under tests/models (llama, ...)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per file and run")
    parser.add_argument("-k", dest="select", help="pytest -k expression, the same for both runs")
    parser.add_argument("--json", type=Path, help="write every test's outcome here")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    missing = [m for m in args.models if not model_test_file(root, m).is_file()]
    if missing:
        parser.error(f"no {', '.join(str(model_test_file(root, m)) for m in missing)}")
    results: dict[str, dict[str, Run]] = {}
    total = 0
    for model in args.models:
        results[model] = {m: run_file(root, model, m, args.timeout, args.select) for m in MODES}
        print("\n".join(report(model, results[model])), flush=True)
        total += len(only_with_attnkit(results[model]["default"], results[model]["attnkit"]))
    if args.json:
        data = {
            model: {
                m: {"outcomes": r.outcomes, "reasons": r.reasons, "timed_out": r.timed_out}
                for m, r in runs.items()
            }
            for model, runs in results.items()
        }
        args.json.write_text(json.dumps(data, indent=1, sort_keys=True))
    print(f"tests failing only with attnkit: {total}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
