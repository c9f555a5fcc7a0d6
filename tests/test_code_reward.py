"""The `code` reward of `oxrl-rewards` and `oxrl score` (the `Reward` interface, `oxrl_core.interfaces`).

- scoring: fenced-block extraction, `tests` (each assert counts) and `io` (stdin/stdout pairs)
  rows, partial credit, syntax errors, rows without test cases (scored 0 and counted), and the
  cheap reward hacks (exiting before the tests, rebinding builtins, printing fake results);
- the sandbox, through the real `oxrl score` CLI on one JSONL that mixes attacks and correct
  programs: an infinite loop, a fork bomb, a 10 GB allocation, writing outside the sandbox,
  reading an environment secret, connecting to a loopback listener, a `setsid` child, deleting a
  file of the working tree, printing 100 MB. Each scores its fair share (one harmless assert
  passes, the attack's assert fails), finishes within its limit and leaves nothing behind; the
  correct programs still score 1. Run with the Python guard and, where namespaces exist, without;
- `oxrl score`'s input checks and its output with a simple reward.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import oxrl, write_jsonl

from oxrl_core.interfaces import Reward
from oxrl_core.scoring.rewards import score_batch

#: short limits so the whole file stays fast
LIMITS = {"wall_s": 2.0, "cpu_s": 2, "memory_mb": 256, "output_bytes": 1 << 20, "scratch_mb": 16, "workers": 4}


def code_reward(temp_dir: Path, **options):
    from oxrl_core.plugins import discover

    cls = discover().load("reward", "code")
    return cls(cls.Config(**{**LIMITS, "temp_dir": str(temp_dir), **options}))


@pytest.fixture(scope="module")
def sandbox_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sandboxes")
    yield root
    assert list(root.iterdir()) == [], "a sandbox directory was left behind"


@pytest.fixture(scope="module")
def reward(sandbox_root):
    return code_reward(sandbox_root)


def details(r, completions: list[str], examples: list[dict]) -> list[dict]:
    """score_details, checked against score_batch (as a loop calls it): same scores, nothing failed."""
    rows = r.score_details([""] * len(completions), completions, examples)
    values, metrics = score_batch(r, [""] * len(completions), completions, examples)
    assert metrics["reward/errors"] == 0 and metrics["reward/timeouts"] == 0, metrics
    assert values == [row["score"] for row in rows]
    return rows


DOUBLE = "def double(x):\n    return 2 * x\n"
DOUBLE_TESTS = ["assert double(1) == 2", "assert double(2) == 4", "assert double(-3) == -6"]
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


# --------------------------------------------------------------------------------------------
# discovery and extraction
# --------------------------------------------------------------------------------------------


def test_code_is_an_entry_point_of_oxrl_rewards():
    from oxrl_core.plugins import discover

    rows = {r["name"]: r for r in discover().rows() if r["kind"] == "reward"}
    assert rows["code"]["package"] == "oxrl-rewards" and rows["code"]["plugin"] == "code"


def test_extract_code_takes_the_last_python_block_else_everything():
    from oxrl_rewards.code_exec import extract_code

    assert extract_code("no fences: x = 1") == "no fences: x = 1"
    assert extract_code("Try:\n```python\nx = 1\n```\nbetter:\n```py\nx = 2\n```\ndone") == "x = 2\n"
    assert extract_code("```\nplain = 1\n```") == "plain = 1\n"
    assert extract_code("```python3 title=a.py\nx = 3\n```") == "x = 3\n"
    # a shell block is not the program; the python block before it is
    assert extract_code("```python\nx = 4\n```\nrun it:\n```bash\npython a.py\n```") == "x = 4\n"
    # cut off by max_new_tokens: the unterminated last block runs to the end
    assert extract_code("```python\nx = 1\n```\nnow:\n```python\ny = 2\nz = 3") == "y = 2\nz = 3"
    assert extract_code("Use ```inline``` code") == "Use ```inline``` code"


def test_output_comparison_ignores_trailing_whitespace_and_blank_lines_only():
    from oxrl_rewards.code_exec import normalise_output

    assert normalise_output("3  \n4\t\n\n\n") == normalise_output("3\n4")
    assert normalise_output("\n3\n") != normalise_output("3\n")  # leading blank lines count
    assert normalise_output("3 4") != normalise_output("3  4")  # inner spaces count


# --------------------------------------------------------------------------------------------
# scoring
# --------------------------------------------------------------------------------------------


def test_tests_rows_score_the_fraction_of_asserts_passed(reward):
    completions = [
        f"Here it is:\n```python\n{DOUBLE}```",  # all 3
        "```python\ndef double(x):\n    return x + x if x > 0 else x\n```",  # 2 of 3 (not -3)
        "def double(x):\n    return 2 * x\n",  # no fence: the whole completion
        "```python\ndef double(x:\n```",  # syntax error
        "```python\ndef double(x):\n    return 1 / 0\n```",  # every test raises
    ]
    rows = details(reward, completions, [{"tests": DOUBLE_TESTS}] * 5)
    assert [r["score"] for r in rows] == pytest.approx([1.0, 2 / 3, 1.0, 0.0, 0.0])
    assert [(r["passed"], r["total"]) for r in rows] == [(3, 3), (2, 3), (3, 3), (0, 3), (0, 3)]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "syntax_error", "ok"]
    assert "SyntaxError" in rows[3]["stderr"] and "ZeroDivisionError" in rows[4]["stderr"]
    assert rows[0]["stderr"] == "" and "guard" in rows[0]["isolation"]


def test_io_rows_compare_stdout_per_input(reward):
    io = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}]
    completions = [
        f"```python\n{ADD}```",
        "```python\nprint(3)\n```",  # right for the first pair only
        "```python\na, b = map(int, input().split())\nprint(a + b, '   ')\nprint()\nprint()\n```",  # trailing blanks
        "```python\na, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(3)\n```",  # right output, failing exit
        "```python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())))\nsys.exit(0)\n```",  # exit 0 is fine
    ]
    rows = details(reward, completions, [{"io": io}] * 5)
    assert [r["score"] for r in rows] == [1.0, 0.5, 1.0, 0.0, 1.0]
    assert [r["total"] for r in rows] == [2] * 5
    assert rows[3]["status"] == "error"


def test_tests_that_passed_before_a_timeout_still_count(reward):
    program = "def ok():\n    return 1\ndef spin():\n    while True:\n        pass\n"
    started = time.monotonic()
    [row] = reward.score_details([""], [program], [{"tests": ["assert ok() == 1", "spin()", "assert ok() == 1"]}])
    assert time.monotonic() - started < LIMITS["wall_s"] + 5
    assert row["score"] == pytest.approx(1 / 3) and row["status"] == "timeout"


@pytest.mark.parametrize(
    "hack",
    [
        "import sys\nsys.exit(0)",  # leave before the tests with a success status
        "import os\nos._exit(0)",
        "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.compile = lambda *a, **k: 'pass'",
        "print('1 1 -')\nprint('test 0 1 -')\nprint('done')",  # fake result lines
        "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'test 0 1 -\\ntest 1 1 -\\ndone\\n')\n    except OSError:\n        pass",
    ],
    ids=["sys.exit", "os._exit", "rebind-exec", "print-results", "write-every-fd"],
)
def test_cheap_reward_hacks_score_zero(reward, hack):
    [row] = details(reward, [hack], [{"tests": ["assert double(1) == 2", "assert False"]}])
    assert row["score"] == 0.0 and row["passed"] == 0


def test_rows_without_test_cases_score_nan_alone_and_are_counted(reward, caplog):
    completions = [DOUBLE, DOUBLE, DOUBLE, DOUBLE]
    examples = [
        {"tests": DOUBLE_TESTS},
        {"answer": "7"},  # neither
        {"tests": DOUBLE_TESTS, "io": [{"input": "", "output": ""}]},  # both
        {"io": [{"input": "1"}]},  # no output
    ]
    rows = reward.score_details([""] * 4, completions, examples)
    assert rows[0]["score"] == 1.0 and all(math.isnan(r["score"]) for r in rows[1:])
    assert [r["status"] for r in rows] == ["ok", "bad_example", "bad_example", "bad_example"]
    assert "'tests' or 'io'" in rows[1]["error"] and "both" in rows[2]["error"] and "io[0]" in rows[3]["error"]
    values, metrics = score_batch(reward, [""] * 4, completions, examples)
    assert values == [1.0, 0.0, 0.0, 0.0] and metrics["reward/errors"] == 3 and metrics["reward/timeouts"] == 0


def test_a_normal_program_can_use_the_stdlib_files_threads_and_stdin(reward):
    program = """
import asyncio, collections, dataclasses, json, os, subprocess, tempfile, threading

@dataclasses.dataclass
class Point:
    x: int

def work():
    with open("data.json", "w") as f:  # the working directory is writable
        json.dump({"p": Point(3).x}, f)
    with tempfile.TemporaryDirectory() as d:  # so is TMPDIR
        with open(os.path.join(d, "t.txt"), "w") as f:
            f.write("ok")
    box = []
    t = threading.Thread(target=lambda: box.append(1))
    t.start(); t.join()
    async def coro():
        await asyncio.sleep(0)
        return 5
    return json.load(open("data.json"))["p"] + box[0] + asyncio.run(coro())
"""
    [row] = details(reward, [program], [{"tests": ["assert work() == 9"]}])
    assert row["score"] == 1.0, row


def test_workers_run_in_parallel_with_the_same_scores(sandbox_root):
    completions = [f"def double(x):\n    return {k} * x\n" for k in (2, 1, 2, 0)] * 3
    one = code_reward(sandbox_root, workers=1).score([""] * 12, completions, [{"tests": DOUBLE_TESTS}] * 12)
    many = code_reward(sandbox_root, workers=4).score([""] * 12, completions, [{"tests": DOUBLE_TESTS}] * 12)
    assert one == many == [1.0, 0.0, 1.0, 0.0] * 3


def test_namespaces_off_is_process_isolation_with_the_guard(sandbox_root):
    r = code_reward(sandbox_root, namespaces="off")
    [row] = details(r, [DOUBLE], [{"tests": DOUBLE_TESTS}])
    assert row["score"] == 1.0 and row["isolation"].startswith("process,") and row["isolation"].endswith(",guard")


def test_config_rejects_unknown_and_bad_options():
    from pydantic import ValidationError

    from oxrl_rewards.code_exec import CodeReward

    with pytest.raises(ValidationError, match="wurkers"):
        CodeReward.Config(wurkers=2)
    with pytest.raises(ValidationError, match="namespaces"):
        CodeReward.Config(namespaces="maybe")
    with pytest.raises(ValidationError, match="wall_s"):
        CodeReward.Config(wall_s=0)


# --------------------------------------------------------------------------------------------
# the sandbox under attack, through the real CLI
# --------------------------------------------------------------------------------------------

OK = "def ok():\n    return 1\n"


def attack_rows(tmp_path: Path, port: int, marker: str) -> tuple[list[dict], dict[str, str]]:
    """(rows, kind of each attack): every attack row is `ok()` + `attack()` with the tests
    ``assert ok() == 1`` (passes) and ``assert attack()`` (True only if the attack worked)."""
    outside, sentinel = tmp_path / "outside.txt", tmp_path / "tree" / "sentinel.txt"
    attacks = {
        "infinite_loop": ("cpu", "def attack():\n    while True:\n        pass\n"),
        "fork_bomb": (
            "cpu",
            """
def attack():
    import os, time
    forked = 0
    for _ in range(2000):  # bounded: harmless even if every layer failed
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(5)
            os._exit(0)
        forked += 1
    return forked == 2000
""",
        ),
        "allocate_10GB": ("cpu", "def attack():\n    blob = bytearray(10 * 2**30)\n    return len(blob) > 0\n"),
        "print_100MB": (
            "cpu",
            "def attack():\n    import sys\n    for _ in range(100):\n        sys.stdout.write('x' * 2**20)\n    return True\n",
        ),
        "write_outside": ("files", f"def attack():\n    open({str(outside)!r}, 'w').write('pwned')\n    return True\n"),
        "delete_tree": (
            "files",
            f"""
def attack():
    import os, shutil
    os.remove({str(sentinel)!r})
    shutil.rmtree({str(sentinel.parent)!r})
    return True
""",
        ),
        "read_trainer_file": ("files", f"def attack():\n    return 'oxrl' in open({__file__!r}).read()\n"),
        "env_secret": (
            "proc",
            """
def attack():
    import os
    data = repr(dict(os.environ))
    paths = ['/proc/%d/environ' % os.getppid(), '/proc/1/environ', '/proc/self/environ']
    try:
        paths += ['/proc/%s/environ' % p for p in os.listdir('/proc') if p.isdigit()]
    except OSError:
        pass
    for path in paths:
        try:
            data += open(path, 'rb').read().decode('latin-1')
        except OSError:
            pass
    return 'OXRL_TEST_SECRET' in data
""",
        ),
        "connect_loopback": (
            "net",
            f"""
def attack():
    import socket
    with socket.create_connection(('127.0.0.1', {port}), timeout=1):
        return True
""",
        ),
        "setsid_child": (
            "proc",
            f"""
def attack():
    import os, time
    if os.fork() == 0:
        try:
            os.setsid()
            os.execv('/bin/sh', ['sh', '-c', 'sleep 30; : {marker}'])
        finally:
            time.sleep(30)
            os._exit(0)
    time.sleep(0.5)  # let the child detach before the program ends
    return False  # whether it survives is checked from outside
""",
        ),
    }
    rows = [
        {"name": name, "completion": f"```python\n{OK}{code}\n```", "tests": ["assert ok() == 1", "assert attack()"]}
        for name, (_, code) in attacks.items()
    ]
    rows += [
        {"name": "correct_tests", "completion": f"```python\n{DOUBLE}```", "tests": DOUBLE_TESTS},
        {
            "name": "correct_io",
            "completion": f"```python\n{ADD}```",
            "io": [{"input": "2 3", "output": "5"}, {"input": "-1 1", "output": "0"}],
        },
    ]
    return rows, {name: kind for name, (kind, _) in attacks.items()}


def processes_mentioning(*needles: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if any(n.encode() in text for n in needles):
            found.append(f"{pid}: {text[:120]!r}")
    return found


def os_layers_mode() -> str | None:
    """The namespace mode the OS layers use here, or None when this machine has none."""
    import tempfile

    from oxrl_rewards.sandbox import SandboxError, choose_mode

    try:
        return choose_mode("on", tempfile.gettempdir())
    except SandboxError:
        return None


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "os-layers-only"])
def test_attacks_through_oxrl_score_are_contained(tmp_path, guard):
    mode = os_layers_mode()
    if not guard and mode is None:
        pytest.skip("no user/pid/net namespaces here: without the Python guard nothing would contain the attacks")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    marker = f"oxrl-marker-{secrets.token_hex(6)}"
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    (tmp_path / "tree").mkdir()
    (tmp_path / "tree" / "sentinel.txt").write_text("keep me")
    rows, kinds = attack_rows(tmp_path, listener.getsockname()[1], marker)
    if not guard and mode != "root":  # the trainer's uid: files are the guard's job (see oxrl_rewards.sandbox)
        rows = [r for r in rows if kinds.get(r["name"]) != "files"]
    data = write_jsonl(tmp_path / "attacks.jsonl", rows)
    options = [f"{k}={v}" for k, v in LIMITS.items()] + [f"temp_dir={sandboxes}", f"python_guard={str(guard).lower()}"]
    if not guard:
        options.append("namespaces=on")

    started = time.monotonic()
    proc = oxrl(
        "score",
        "--reward",
        "code",
        "--data",
        str(data),
        "--output",
        str(tmp_path / "scores.jsonl"),
        *[a for o in options for a in ("--set", o)],
        env={"OXRL_TEST_SECRET": secrets.token_hex(8)},
        timeout=120,
    )
    elapsed = time.monotonic() - started

    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 60, f"took {elapsed:.1f}s"
    scored = {
        rows[i]["name"]: json.loads(line) for i, line in enumerate((tmp_path / "scores.jsonl").read_text().splitlines())
    }
    assert len(scored) == len(rows)
    for name, result in scored.items():
        expected = 1.0 if name.startswith("correct") else 0.5
        assert result["score"] == expected, (name, result)
    assert scored["infinite_loop"]["status"] == "timeout"
    assert scored["allocate_10GB"]["status"] == "memory"
    assert scored["print_100MB"]["status"] == "output_limit"
    assert "errors 0, timeouts 0" in " ".join(proc.stderr.split())

    # nothing got out, nothing was changed, nothing is left behind
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()
    assert (tmp_path / "tree" / "sentinel.txt").read_text() == "keep me"
    assert not (tmp_path / "outside.txt").exists()
    assert list(sandboxes.iterdir()) == []
    deadline = time.monotonic() + 3
    while processes_mentioning(marker, str(sandboxes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(marker, str(sandboxes)) == []


def test_nothing_survives_a_killed_trainer(tmp_path):
    """SIGKILL the process that scores (no cleanup can run): its sandboxed program dies with it."""
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    script = (
        "from oxrl_rewards.sandbox import Limits, Sandbox\n"
        f"Sandbox(Limits(wall_s=60, cpu_s=60), temp_dir={str(sandboxes)!r})"
        ".run('import time\\ntime.sleep(60)', tests=['assert True'])\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 30
        while not processes_mentioning(str(sandboxes)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_mentioning(str(sandboxes)), "the sandboxed program never started"
        time.sleep(0.5)  # the program is sleeping now
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 5
    while processes_mentioning(str(sandboxes)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_mentioning(str(sandboxes)) == []


def test_userns_mode_mechanics(sandbox_root):
    """The non-root namespace mode (user + mount + net + pid + ipc, own /proc, no capabilities),
    checked here even when the suite runs as root; its file isolation is the guard's job."""
    from oxrl_rewards.sandbox import Limits, Sandbox, probe

    if probe("userns", str(sandbox_root)) is not None:
        pytest.skip(f"unprivileged user namespaces are not available: {probe('userns', str(sandbox_root))}")
    box = Sandbox(
        Limits(wall_s=5, cpu_s=2, memory_mb=256), python_guard=False, temp_dir=str(sandbox_root), mode="userns"
    )
    program = """
import os, socket
def pids():
    return [p for p in os.listdir('/proc') if p.isdigit()]
def cap_eff():
    return [l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1]
def network():
    try:
        socket.create_connection(('127.0.0.1', 9), timeout=1)
    except OSError as exc:
        return exc.errno
"""
    result = box.run(
        program,
        tests=[
            "assert pids() == ['1']",
            "assert int(cap_eff(), 16) == 0",
            "assert os.getpid() == 1",
            "import errno; assert network() in (errno.ENETUNREACH, errno.ECONNREFUSED)",
        ],
    )
    assert result.status == "ok" and result.tests == [True] * 4, result


# --------------------------------------------------------------------------------------------
# oxrl score: input checks, a simple reward, failures of the reward
# --------------------------------------------------------------------------------------------


def assert_clean_failure(proc, *needles: str) -> str:
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, text
    assert "Traceback" not in text, text
    for needle in needles:
        assert needle in text, (needle, text)
    return text


def test_score_rejects_a_row_without_completion(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", [{"completion": "a", "answer": "a"}, {"prompt": "p", "answer": "a"}])
    assert_clean_failure(
        oxrl("score", "--reward", "exact_match", "--data", str(data)), str(data), "row 2", "'completion'"
    )


def test_score_rejects_an_unknown_reward_and_an_unknown_option(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", [{"completion": "a", "answer": "a"}])
    assert_clean_failure(
        oxrl("score", "--reward", "exakt_match", "--data", str(data)), "unknown reward 'exakt_match'", "exact_match"
    )
    assert_clean_failure(
        oxrl("score", "--reward", "code", "--data", str(data), "--set", "wurkers=4"), "reward.wurkers", "workers"
    )
    assert_clean_failure(
        oxrl("score", "--reward", "code", "--data", str(data), "--set", "workers=-1"), "reward.workers"
    )


def test_score_with_exact_match_writes_one_object_per_row(tmp_path):
    rows = [
        {"completion": "Paris", "answer": "paris"},
        {"completion": "Lyon", "answer": "Paris"},
        {"completion": "<answer>Rome.</answer>", "answer": "rome"},
    ]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    proc = oxrl("score", "--reward", "exact_match", "--data", str(data))
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [
        {"row": 1, "score": 1.0},
        {"row": 2, "score": 0.0},
        {"row": 3, "score": 1.0},
    ]
    assert "3 rows" in proc.stderr and "mean 0.6667" in proc.stderr

    out = tmp_path / "out" / "scores.jsonl"
    proc = oxrl("score", "-r", "exact_match", "-d", str(data), "-o", str(out), "--set", "case_sensitive=true")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["score"] for line in out.read_text().splitlines()] == [0.0, 0.0, 0.0]


REWARDS_PY = """
import time
from oxrl_core.interfaces import Reward

class Picky(Reward):
    name = "picky"
    def score(self, prompts, completions, examples):
        if "boom" in completions:
            raise ValueError("cannot score boom")
        return [float(len(c)) for c in completions]

class Slow(Reward):
    name = "slow"
    def score(self, prompts, completions, examples):
        time.sleep(5)
        return [1.0] * len(completions)
"""


def test_score_file_applies_the_training_safety_rules(tmp_path):
    from oxrl_core.scoring.offline import score_file

    module = tmp_path / "my_rewards.py"
    module.write_text(REWARDS_PY)
    data = write_jsonl(tmp_path / "rows.jsonl", [{"completion": "ab"}, {"completion": "boom"}, {"completion": "abc"}])
    out = tmp_path / "picky.jsonl"
    summary = score_file(f"{module}:Picky", data, out, [])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["score"] for r in rows] == [2.0, 0.0, 3.0]
    assert "error" not in rows[0] and "cannot score boom" in rows[1]["error"]
    assert summary == {"rows": 3, "mean": pytest.approx(5 / 3), "errors": 1, "timeouts": 0}

    summary = score_file(f"{module}:Slow", data, tmp_path / "slow.jsonl", ["timeout_s=0.2"])
    rows = [json.loads(line) for line in (tmp_path / "slow.jsonl").read_text().splitlines()]
    assert [r["score"] for r in rows] == [0.0] * 3 and all("timeout" in r["error"] for r in rows)
    assert summary["timeouts"] == 3


def test_score_details_defaults_to_the_score():
    class Length(Reward):
        name = "length"

        def score(self, prompts, completions, examples):
            return [float(len(c)) for c in completions]

    assert Length().score_details(["", ""], ["a", "abc"], [{}, {}]) == [{"score": 1.0}, {"score": 3.0}]


def test_score_does_not_import_torch(tmp_path):
    data = write_jsonl(tmp_path / "rows.jsonl", [{"completion": "a", "answer": "a"}])
    code = (
        "import sys\nfrom oxrl_core.scoring.offline import score_file\n"
        f"score_file('exact_match', {str(data)!r}, {str(tmp_path / 'o.jsonl')!r}, [])\n"
        "assert 'torch' not in sys.modules\nprint('LIGHT')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "LIGHT", proc.stderr
