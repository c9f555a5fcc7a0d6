"""`code`: the fraction of an example's test cases that the completion's program passes.

The program is the last fenced block of the completion whose info string is ``python``, ``py``,
``python3`` or empty (an unterminated last block runs to the end of the completion), else the
whole completion. It runs in `oxrl_rewards.sandbox` (separate process, resource limits,
namespaces when available, the Python guard; read that module for the layers and their limits),
under the limits of `CodeReward.Config`. The example carries its test cases in one of two fields:

- ``tests``: a list of Python statements (typically ``assert``), run one after the other in the
  program's namespace after the program itself, in one run; each counts separately (a test that
  raises fails; tests reported before a timeout still count, later ones fail).
- ``io``: a list of ``{"input": str, "output": str}`` pairs; each pair is one run of the program
  with ``input`` on stdin. It passes when the run exits with status 0 and its stdout equals
  ``output`` after dropping trailing whitespace on every line and trailing blank lines.

``score = passed / total``. A row with neither field, with both, or with malformed test cases
scores NaN — which `score_batch` turns into a counted 0 (``reward/errors``) without costing the
other rows of the batch their (parallel) runs — and the reason is logged and put in its details.
`score_details` adds, per row: ``passed``, ``total``, ``status`` (``ok``, or the first of
``error``/``syntax_error``/``timeout``/``memory``/``output_limit``/``skipped`` among its runs;
``bad_example``; ``sandbox_error`` when the sandbox itself failed, which also scores NaN),
``isolation`` (the sandbox layers used), ``stderr`` (a short tail from the first run that did not
pass) and, for a row scored NaN, ``error``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator

from oxrl_core import Reward, StrictModel, row_number
from oxrl_rewards._common import MissingFieldError
from oxrl_rewards.sandbox import Limits, RunResult, Sandbox, SandboxError

log = logging.getLogger("oxrl.rewards")

# An opening fence at the start of a line, its info string, the body, then a closing fence at the
# start of a line or the end of the text.
_FENCE = re.compile(r"^```[ \t]*([^\n`]*)\n(.*?)(?:^```|\Z)", re.DOTALL | re.MULTILINE)
_PYTHON = {"", "python", "py", "python3"}
STDERR_TAIL = 400


def extract_code(completion: str) -> str:
    """The last python/py/python3/plain fenced block, else the whole completion."""
    blocks = [body for info, body in _FENCE.findall(completion) if info.strip().split(" ")[0].lower() in _PYTHON]
    return blocks[-1] if blocks else completion


def normalise_output(text: str) -> list[str]:
    """Lines without trailing whitespace, trailing blank lines dropped."""
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def read_test_cases(example: dict, reward: str = "code") -> tuple[str, list]:
    """``("tests", [statement, ...])`` or ``("io", [(stdin, expected), ...])``; a MissingFieldError
    (a ValueError) naming the field when the example has neither, both, or malformed ones."""
    has = [name for name in ("tests", "io") if isinstance(example, dict) and example.get(name) is not None]
    if len(has) != 1:
        found = (
            sorted(k for k in example if not k.startswith("_")) if isinstance(example, dict) else type(example).__name__
        )
        what = "both 'tests' and 'io'" if len(has) == 2 else f"neither (it has {found})"
        raise MissingFieldError(
            f"reward '{reward}' needs the field 'tests' or 'io' in every example; this one has {what}"
        )
    name = has[0]
    cases = example[name]
    if not isinstance(cases, (list, tuple)) or not cases:
        raise MissingFieldError(f"reward '{reward}': the field '{name}' must be a non-empty list, got {cases!r:.80}")
    if name == "tests":
        if not all(isinstance(t, str) for t in cases):
            raise MissingFieldError(f"reward '{reward}': every item of 'tests' must be a string of Python code")
        return name, list(cases)
    pairs = []
    for i, pair in enumerate(cases):
        if (
            not isinstance(pair, dict)
            or not isinstance(pair.get("output"), str)
            or not isinstance(pair.get("input", ""), str)
        ):
            raise MissingFieldError(
                f'reward \'{reward}\': io[{i}] must be {{"input": str, "output": str}}, got {pair!r:.80}'
            )
        pairs.append((pair.get("input", ""), pair["output"]))
    return name, pairs


class CodeReward(Reward):
    name = "code"
    #: the whole score() call (score_batch's limit). A batch takes about
    #: runs x time per run / workers; raise it with `reward.timeout_s` for big batches of slow tests.
    timeout_s = 600.0

    class Config(StrictModel):
        wall_s: float = Field(5.0, gt=0, le=600)
        """Wall-clock seconds per program run (one run for all of a row's `tests`, one per `io` pair)."""
        cpu_s: int = Field(5, ge=1, le=600)
        """CPU seconds per run (RLIMIT_CPU)."""
        memory_mb: int = Field(512, ge=64)
        """Address space per process, MiB (RLIMIT_AS): a bigger allocation is a MemoryError."""
        output_bytes: int = Field(1 << 20, ge=1024)
        """Cap on stdout, stderr and on every file the program writes, bytes (RLIMIT_FSIZE)."""
        scratch_mb: int = Field(64, ge=1)
        """Size of the tmpfs root the program runs in (its working dir and /tmp; root namespace mode), MiB."""
        max_processes: int = Field(32, ge=1)
        """Processes + threads per run (RLIMIT_NPROC; with namespaces only: without, the guard refuses forks)."""
        max_open_files: int = Field(64, ge=16)
        """Open files per process (RLIMIT_NOFILE)."""
        workers: int = Field(0, ge=0, le=1024)
        """Programs run at the same time; 0 = one per CPU."""
        namespaces: Literal["auto", "on", "off"] = "auto"
        """Namespace isolation: `auto` uses it when this machine allows it, `on` requires it, `off` never."""
        python_guard: bool = True
        """The in-process audit-hook guard (turn off only to test the OS layers alone)."""
        temp_dir: str = ""
        """Where each run's temporary directory is made; empty = the system temp dir."""

        @field_validator("namespaces", mode="before")
        @classmethod
        def _yaml_booleans(cls, value: Any) -> Any:
            """``--set namespaces=on`` arrives as True (YAML 1.1 reads on/off as booleans)."""
            return {True: "on", False: "off"}[value] if isinstance(value, bool) else value

    def __init__(self, config: "CodeReward.Config | None" = None):
        super().__init__(config)
        c = self.config
        limits = Limits(
            wall_s=c.wall_s,
            cpu_s=c.cpu_s,
            memory_mb=c.memory_mb,
            output_bytes=c.output_bytes,
            max_processes=c.max_processes,
            max_open_files=c.max_open_files,
            scratch_mb=c.scratch_mb,
        )
        self.sandbox = Sandbox(
            limits, namespaces=c.namespaces, python_guard=c.python_guard, temp_dir=c.temp_dir or None
        )
        self.workers = c.workers or os.cpu_count() or 1

    def score(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[float]:
        return [row["score"] for row in self.score_details(prompts, completions, examples)]

    def score_details(self, prompts: list[Any], completions: list[str], examples: list[dict]) -> list[dict]:
        rows, jobs = self._plan(completions, examples)
        for job, result in zip(jobs, self._run_all(jobs)):
            _add_run(rows[job.row], job, result)
        for row in rows:
            if "error" in row:
                row["score"] = math.nan  # score_batch: a counted 0
            elif row["total"]:
                row["score"] = row["passed"] / row["total"]
        return rows

    def _plan(self, completions: list[str], examples: list[dict]) -> tuple[list[dict], list[_Job]]:
        """One details dict per row and the program runs they need (one for `tests`, one per `io` pair)."""
        rows: list[dict] = []
        jobs: list[_Job] = []
        for i, (completion, example) in enumerate(zip(completions, examples, strict=True)):
            row = {
                "score": 0.0,
                "passed": 0,
                "total": 0,
                "status": "ok",
                "isolation": self.sandbox.isolation,
                "stderr": "",
            }
            rows.append(row)
            try:
                kind, cases = read_test_cases(example, self.name)
            except MissingFieldError as exc:
                log.warning("reward '%s': row %s: %s; it scores 0", self.name, row_number(examples, i), exc)
                row.update(status="bad_example", error=str(exc))
                continue
            code = extract_code(completion)
            row["total"] = len(cases)
            if kind == "tests":
                jobs.append(_Job(i, code, tests=cases, label=row_number(examples, i)))
            else:
                jobs.extend(
                    _Job(i, code, stdin=stdin, expected=expected, label=row_number(examples, i))
                    for stdin, expected in cases
                )
        return rows, jobs

    def _run_all(self, jobs: list[_Job]) -> list[RunResult]:
        """Every run, ``workers`` at a time; none is started after this call's ``timeout_s``."""
        deadline = time.monotonic() + float(self.timeout_s)

        def run(job: _Job) -> RunResult:
            if time.monotonic() > deadline:  # score_batch has stopped waiting: start nothing new
                return RunResult(status="skipped", exit_code=None)
            try:
                return self.sandbox.run(job.code, tests=job.tests, stdin=job.stdin)
            except SandboxError as exc:  # the sandbox failed, not the program: the row is an error
                log.warning("reward '%s': row %s: %s", self.name, job.label, exc)
                return RunResult(status="sandbox_error", exit_code=None, stderr=str(exc))

        with ThreadPoolExecutor(
            max_workers=min(self.workers, max(len(jobs), 1)), thread_name_prefix="code-reward"
        ) as pool:
            return list(pool.map(run, jobs))


@dataclass
class _Job:
    """One run of a row's program: with its ``tests``, or on one io pair's ``stdin``."""

    row: int
    code: str
    tests: list[str] | None = None
    stdin: str = ""
    expected: str = ""
    label: int = 0  #: the row's number in messages (1-based, its data file's row when known)


def _add_run(row: dict, job: _Job, result: RunResult) -> None:
    """Fold one run into its row's details."""
    if job.tests is not None:
        passed, runs_tests = sum(result.tests), len(job.tests)
    else:
        passed = int(result.status == "ok" and normalise_output(result.stdout) == normalise_output(job.expected))
        runs_tests = 1
    row["passed"] += passed
    if result.status != "ok" and row["status"] == "ok":
        row["status"] = result.status
    if passed < runs_tests and not row["stderr"]:
        row["stderr"] = result.stderr[-STDERR_TAIL:]
    if result.status == "sandbox_error":
        row["error"] = result.stderr
