"""Every code block of README.md, of the reference pages in docs/ and of the man page's EXAMPLES
runs here (or in the test KNOWN names), and does what the text around it says.

KNOWN (support/doc_blocks.py) lists each block once: the test that runs it, or why it cannot run
here. A block that is in neither (a new one, or one edited past recognition) fails
test_every_block_is_run_or_listed, and so does an entry whose block is gone: the docs cannot drift
from what is tested.

The commands the examples name (llm, summarise, job, ask-local.sh…) are stand-ins: tiny scripts
that record that they ran, with LANELOCK_STATE and their arguments. /usr/local/bin/lanelock is
the console script next to this Python (what the user installed), and so is the venv's
/opt/lanelock/.venv/bin/lanelock the examples make for cron and services; other /usr/local/bin/NAME
paths are stand-ins. A busy lane is the conftest holder on another spelling of the same backend.
"""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.cli import TIMEOUT, environ
from support.kernel_locks import is_queued, is_waiting
from support.processes import read_line, wait_for
from support.doc_blocks import (KNOWN, MAN, NOT_RUN_INLINE, README, TOP, all_blocks, block,
                                 man_blocks)
from support.ports import free_port
from support.prometheus import tool

SCRIPT = Path(sys.executable).parent / "lanelock"      # the console script users run
CRON_PATH = "/usr/bin:/bin"                              # cron's PATH
BUSY_LINE = re.compile(r"^lanelock: local_backend_busy: .*$", re.M)


def test_every_block_is_run_or_listed():
    problems = []
    for candidate in all_blocks():
        entries = [entry.name for entry in KNOWN if entry.matches(candidate)]
        if len(entries) != 1:
            problems.append(f"{candidate}: matches {entries or 'no entry'} -- run it in "
                            f"tests/test_examples.py and add it to KNOWN (support/doc_blocks.py), "
                            f"or list it there with the reason it cannot run:\n{candidate.text}")
    for entry in KNOWN:
        count = sum(entry.matches(candidate) for candidate in all_blocks())
        if count != 1:
            problems.append(f"KNOWN {entry.name!r} matches {count} blocks (pattern "
                            f"{entry.pattern!r}): the docs changed, update the entry")
        assert entry.test or entry.not_run, entry
        if entry.test:
            module, _, name = entry.test.rpartition("::")
            source = (Path(__file__).parent / module).read_text() if module else \
                Path(__file__).read_text()
            if not re.search(rf"^def {re.escape(name)}\(", source, re.M):
                problems.append(f"KNOWN {entry.name!r}: no test {entry.test}")
    assert not problems, "\n\n".join(problems)


def test_what_is_not_run_is_still_there():
    for (name, snippet), reason in NOT_RUN_INLINE.items():
        assert snippet in (TOP / name).read_text(), f"gone from {name} (not run: {reason}): {snippet}"


@pytest.mark.skipif(shutil.which("groff") is None, reason="groff is not installed")
def test_man_examples_render_as_the_tests_read_them():
    """What man(1) shows for each example is the text these tests run."""
    rendered = subprocess.run(["groff", "-man", "-Tascii", "-P-cbou", str(MAN)],
                              capture_output=True, text=True, check=True,
                              env=environ({"GROFF_NO_SGR": "1"})).stdout
    shown = [line.strip() for line in rendered.splitlines()]
    for example in man_blocks():
        lines = [line.strip() for line in example.text.splitlines()]
        assert any(shown[i:i + len(lines)] == lines for i in range(len(shown))), \
            f"{example} renders differently:\n{example.text}"


# -- stand-ins ----------------------------------------------------------------------------------
@dataclass
class Ran:
    name: str
    state: str      # LANELOCK_STATE as the command saw it ('' outside a turn)
    held: str       # the lock file its turn holds (LANELOCK_HELD's name), '' when none
    args: list


class StandIns:
    """Commands that record each run in one log; the log path is written into each script, so
    they record under `env -i` too."""

    def __init__(self, root: Path):
        self.bin = root / "standins"
        self.bin.mkdir()
        self.log = root / "ran.log"

    def make(self, name: str, status: int = 0, directory: Path | None = None) -> Path:
        path = (directory or self.bin) / name
        path.write_text(
            "#!/bin/sh\n"
            f"# stand-in for {name}: record the run, exit {status}\n"
            f"{{ printf '%s\\037%s\\037%s' {shlex.quote(name)} \"${{LANELOCK_STATE-}}\" "
            "\"${LANELOCK_HELD##*/}\"\n"
            "  for word in \"$@\"; do printf '\\037%s' \"$word\"; done; echo; }"
            f" >> {shlex.quote(str(self.log))}\n"
            f"exit {status}\n")
        path.chmod(0o755)
        return path

    def runs(self) -> list[Ran]:
        if not self.log.exists():
            return []
        return [Ran(fields[0], fields[1], fields[2], fields[3:])
                for fields in (line.split("\x1f") for line in self.log.read_text().splitlines())]

    def clear(self):
        self.log.unlink(missing_ok=True)

    @property
    def path(self) -> str:
        return f"{self.bin}:{SCRIPT.parent}:{CRON_PATH}"


@pytest.fixture
def standins(tmp_path) -> StandIns:
    assert SCRIPT.exists(), f"no lanelock console script next to {sys.executable}"
    return StandIns(tmp_path)


def localize(text: str, standins: StandIns) -> str:
    """Absolute paths of the examples made real: lanelock is the installed console script, any
    other /usr/local/bin/NAME a stand-in (made if the test has not made it)."""
    text = re.sub(r"\$\(command -v lanelock\)|/usr/local/bin/lanelock\b|/opt/lanelock/\.venv/bin/"
                  r"lanelock\b", "\0", text)

    def standin(match):
        path = standins.bin / match.group(1)
        return str(path if path.exists() else standins.make(match.group(1)))

    return re.sub(r"/usr/local/bin/([\w.-]+)", standin, text).replace("\0", str(SCRIPT))


# -- the quick start ----------------------------------------------------------------------------
def test_quickstart_duel(run_cmd):
    """"...runs the duel: ... it ends PASS or FAIL with the reason. No model server is needed.\""""
    command = re.search(r"\.venv/bin/(lanelock duel.*)$", block("quickstart").text, re.M).group(1)
    argv = shlex.split(command)
    done = run_cmd([SCRIPT, *argv[1:]])
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip().splitlines()[-1] == "PASS"


# -- What it is: run with a fallback, and the line it prints ------------------------------------
def sample_line_pattern() -> re.Pattern:
    """The README's sample deflection line, with what varies (pid, time, the argv's tail) open."""
    sample = block("busy-line").text.strip()
    sample = re.sub(r"(?<=pid )\d+", "<pid>", sample)
    sample = re.sub(r"(?<=held )[\d.]+(?=s)", "<seconds>", sample)
    sample = sample.replace("...", "<more>")
    pattern = re.escape(sample)
    for hole, regex in (("<pid>", r"\d+"), ("<seconds>", r"[\d.]+"), ("<more>", ".*")):
        pattern = pattern.replace(re.escape(hole), regex)
    return re.compile(pattern)


@pytest.mark.parametrize("spelling", ["localhost:8080", "[::1]:8080", "http://127.0.0.1:8080/v1"])
def test_run_with_a_fallback(spelling, standins, holder, run_cmd):
    """Free: the local command runs holding the lane. While another session holds the lane (any
    spelling of this machine), the fallback runs instead and one line says so."""
    command = block("run-with-fallback").text.strip()
    standins.make("llm")
    env = {"PATH": standins.path, "PROMPT": "say hi"}

    free = run_cmd(["bash", "-c", command], env=env)
    assert (free.returncode, free.stderr) == (0, "")
    assert [(r.name, r.state, r.args[:2]) for r in standins.runs()] == \
        [("llm", "held", ["-m", "local"])]
    assert standins.runs()[0].args[2:] == ["say hi"]

    standins.clear()
    held = holder("-b", spelling, "-s", "alice@pts/1", "-m", "qwen")
    busy = run_cmd(["bash", "-c", command], env=env)
    assert busy.returncode == 0, busy.stderr
    assert [(r.name, r.state, r.args[:2]) for r in standins.runs()] == \
        [("llm", "deflected", ["-m", "gpt-4o-mini"])]
    lines = busy.stderr.splitlines()
    assert len(lines) == 1 and sample_line_pattern().fullmatch(lines[0]), \
        f"the README's sample line:\n{block('busy-line').text}what lanelock printed:\n{busy.stderr}"
    assert f"pid {held.pid}," in lines[0]
    assert held.release() == 0


def test_the_fallback_gets_the_prompt(standins, holder, run_cmd):
    command = block("run-with-fallback").text.strip()
    standins.make("llm")
    held = holder("-b", "localhost:8080")
    busy = run_cmd(["bash", "-c", command], env={"PATH": standins.path, "PROMPT": "say hi"})
    assert held.release() == 0
    assert [r.args for r in standins.runs()] == [["-m", "gpt-4o-mini", "say hi"]], busy.stderr


# -- cron ---------------------------------------------------------------------------------------
@pytest.fixture
def default_root_lane(lanelock):
    """127.0.0.1:PORT on the default lock root (as cron and every session compute it), on a port
    nobody uses; its files are removed afterwards."""
    backend = f"127.0.0.1:{free_port()}"   # a lane nobody else uses; no server is asked
    yield backend
    where = lanelock("where", "--json", "-b", backend,
                     env={"LANELOCK_DIR": None, "LANELOCK_SYSTEM_CONFIG": None})
    lock = json.loads(where.stdout)["lock_path"]
    for suffix in (".lock", ".json", ".journal", ".counts"):
        Path(lock[: -len(".lock")] + suffix).unlink(missing_ok=True)


def _cron_job_still_gets_its_turn(cron, command, standins, holder, procs, tmp_path, session,
                                  lane):
    """The README's words: with --priority batch and a --wait, a cron job that finds the lane
    busy waits; a chat turn (--priority interactive) that comes after it goes first, and then the
    cron job runs locally -- not the cloud."""
    import psutil

    assert re.search(r"--wait \S+", command), "without --wait the class changes nothing"
    lock = Path(json.loads(subprocess.run(
        [str(SCRIPT), "where", "--json", "-b", lane], capture_output=True, text=True,
        env=environ(session), timeout=TIMEOUT).stdout)["lock_path"])

    def queued(proc) -> bool:   # the turn's wrapper, under env and sh
        try:
            tree = [proc.pid] + [child.pid for child in
                                 psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return False
        return any(is_queued(lock, pid) for pid in tree)

    held = holder("-b", lane.replace("127.0.0.1", "localhost"), env=session)
    job = procs.start(cron, cwd=tmp_path, stderr=subprocess.PIPE)
    # Waiting in the kernel, nothing reports: its queue entry is what says it waits.
    wait_for(lambda: queued(job), what="the cron job to wait")
    chat = procs.start([SCRIPT, "run", "--priority", "interactive", "--wait", "-b", lane, "--",
                        standins.make("chat")], env=environ(session), stderr=subprocess.PIPE)
    wait_for(lambda: queued(chat), what="the chat turn to wait")
    assert held.release() == 0
    assert chat.wait(timeout=TIMEOUT) == 0 and job.wait(timeout=TIMEOUT) == 0, \
        (chat.stderr.read(), job.stderr.read())
    runs = [(ran.name, ran.state, ran.args) for ran in standins.runs()]
    assert runs == [("chat", "held", []), ("summarise", "held", ["--local"])], runs


@pytest.mark.parametrize("name", ["cron", "man-cron"])
def test_cron_line(name, standins, holder, run_cmd, procs, default_root_lane, tmp_path):
    """The crontab line, run as cron runs it (sh -c, PATH=/usr/bin:/bin and nothing else): the
    local command when the lane is free, the cloud one when an interactive session (its own
    HOME and XDG variables) holds it -- one gate, with no LANELOCK_DIR anywhere. The README's
    line waits as a batch turn: its words (it still gets its turn) are proven too."""
    entry = block(name).text.strip()
    assert "\n" not in entry
    fields = entry.split(None, 5)
    assert len(fields) == 6, entry
    command = fields[5]
    assert "%" not in command, "cron turns % into a newline: escape it"
    command = localize(command, standins).replace("127.0.0.1:8080", default_root_lane)
    first = shlex.split(command)[0]
    assert os.path.isabs(first), f"cron's PATH is {CRON_PATH}: {first} must be an absolute path"
    cron = ["env", "-i", f"PATH={CRON_PATH}", "sh", "-c", command]

    free = run_cmd(cron, cwd=tmp_path)
    assert free.returncode == 0, free.stderr
    local = standins.runs()
    assert len(local) == 1 and local[0].state == "held" and local[0].args == ["--local"], local

    standins.clear()
    (tmp_path / "home").mkdir()
    session = {"LANELOCK_DIR": None, "LANELOCK_SYSTEM_CONFIG": None,
               "HOME": tmp_path / "home", "XDG_RUNTIME_DIR": tmp_path / "home"}
    if "--priority batch" in command:
        _cron_job_still_gets_its_turn(cron, command, standins, holder, procs, tmp_path, session,
                                      default_root_lane)
        # ... unless the lane stays busy for all of its --wait: then the cloud (a short wait here)
        cron[-1] = re.sub(r"--wait \S+", "--wait 1", command)
        standins.clear()
    held = holder("-b", default_root_lane.replace("127.0.0.1", "localhost"), env=session)
    busy = run_cmd(cron, cwd=tmp_path)
    assert busy.returncode == 0, busy.stderr
    cloud = standins.runs()
    assert len(cloud) == 1 and cloud[0].state == "deflected" and cloud[0].args == ["--cloud"], cloud
    assert len(BUSY_LINE.findall(busy.stderr)) == 1 and f"pid {held.pid}," in busy.stderr
    assert held.release() == 0


@pytest.fixture
def promtool() -> str:
    return tool("promtool")


def test_metrics_textfile_cron_line(default_root_lane, standins, holder, run_cmd, promtool,
                                    lanelock, tmp_path):
    """The textfile line, run as cron runs it: DIR/lanelock.prom appears, promtool accepts it, and
    it shows the lanes of the default root -- one held by a session with its own environment."""
    from prometheus_client.parser import text_string_to_metric_families
    entry = block("metrics-cron").text.strip()
    fields = entry.split(None, 5)
    assert len(fields) == 6 and "%" not in fields[5], entry
    textfiles = tmp_path / "node-exporter"
    textfiles.mkdir()
    command = localize(fields[5], standins).replace("/var/lib/prometheus/node-exporter",
                                                    str(textfiles))
    assert os.path.isabs(shlex.split(command)[0])
    (tmp_path / "home").mkdir()
    held = holder("-b", default_root_lane,
                  env={"LANELOCK_DIR": None, "LANELOCK_SYSTEM_CONFIG": None,
                       "HOME": tmp_path / "home", "XDG_RUNTIME_DIR": tmp_path / "home"})
    done = run_cmd(["env", "-i", f"PATH={CRON_PATH}", "sh", "-c", command], cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), done
    assert sorted(path.name for path in textfiles.iterdir()) == ["lanelock.prom"]
    text = (textfiles / "lanelock.prom").read_text()
    checked = run_cmd([promtool, "check", "metrics"], input=text)
    assert (checked.returncode, checked.stderr) == (0, ""), checked
    held_gauges = {sample.labels["lane"]: sample.value
                   for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == "lanelock_lane_held"}
    lane = json.loads(lanelock("where", "--json", "-b", default_root_lane).stdout)["lane"]
    assert held_gauges[lane] == 1.0, held_gauges
    assert held.release() == 0


def test_scrape_config(promtool, run_cmd, tmp_path):
    """The scrape config is valid for Prometheus and names the proxy's default address."""
    from lanelock.settings import SETTINGS
    config = tmp_path / "prometheus.yml"
    config.write_text(block("scrape-config").text)
    checked = run_cmd([promtool, "check", "config", config])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    default = SETTINGS["proxy_listen"].default
    assert f'"{default}"' in block("scrape-config").text


def test_alert_rule(promtool, lanelock, run_cmd, tmp_path):
    """The alert rule is valid, and fires on what `lanelock metrics` really says of a root no turn
    can lock -- and not on a healthy one (promtool's rule unit test, fed the two scrapes)."""
    from prometheus_client.parser import text_string_to_metric_families

    rules = tmp_path / "lanelock-rules.yml"
    rules.write_text(block("alert-rule").text)
    checked = run_cmd([promtool, "check", "rules", rules])
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (tmp_path / "file").write_text("")
    roots = {"healthy": tmp_path / "locks", "broken": tmp_path / "file" / "locks"}
    series = []
    for instance, root in roots.items():
        done = lanelock("metrics", env={"LANELOCK_DIR": root})
        assert done.returncode == 0, done
        for family in text_string_to_metric_families(done.stdout):
            for sample in family.samples:
                if sample.name in ("lanelock_gate_available", "lanelock_store_available"):
                    labels = ", ".join(f'{name}="{value}"' for name, value in
                                       sorted({**sample.labels, "instance": instance}.items()))
                    series.append({"series": f"{sample.name}{{{labels}}}",
                                   "values": f"{int(sample.value)}x10"})
    assert len(series) == 4, series
    summary = "lanelock cannot take its gate on broken: turns run ungated"
    description = "Run `lanelock status` (and `lanelock where`) there for the reason."
    expected = [{"exp_labels": labels, "exp_annotations": {"summary": summary,
                                                            "description": description}}
                for labels in ({"instance": "broken", "lane": "localhost:8080"},
                               {"instance": "broken"})]
    unit = tmp_path / "lanelock-rules.test.yml"
    unit.write_text(json.dumps({   # JSON is YAML
        "rule_files": [str(rules)], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": "3m", "alertname": "LanelockGateUnavailable", "exp_alerts": []},
            {"eval_time": "10m", "alertname": "LanelockGateUnavailable",
             "exp_alerts": expected}]}]}))
    tested = run_cmd([promtool, "test", "rules", unit])
    assert tested.returncode == 0, tested.stdout + tested.stderr


# -- the shell script ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["shell-fallback", "man-shell-fallback"])
def test_shell_script(name, standins, holder, run_cmd, tmp_path):
    """The cloud only when the lane is busy; otherwise the script ends with ask-local's status
    (0 or not), and -q keeps lanelock silent."""
    text = block(name).text
    script = tmp_path / "ask.sh"
    script.write_text(text)
    script.chmod(0o755)
    run = [script] if text.startswith("#!") else ["sh", script]
    args = ["one", "two words"]
    env = {"PATH": standins.path}

    for status in (0, 3):
        standins.clear()
        standins.make("ask-local.sh", status, directory=tmp_path)
        standins.make("ask-cloud.sh", 9, directory=tmp_path)
        done = run_cmd([*run, *args], cwd=tmp_path, env=env)
        assert (done.returncode, done.stderr) == (status, "")
        assert [(r.name, r.state, r.args) for r in standins.runs()] == \
            [("ask-local.sh", "held", args)]

    standins.clear()
    standins.make("ask-cloud.sh", 5, directory=tmp_path)
    held = holder("-b", "127.0.0.1:8080")
    busy = run_cmd([*run, *args], cwd=tmp_path, env=env)
    assert (busy.returncode, busy.stderr) == (5, "")
    assert [(r.name, r.args) for r in standins.runs()] == [("ask-cloud.sh", args)]
    assert held.release() == 0


# -- systemd ------------------------------------------------------------------------------------
def unit_file(name: str, standins: StandIns, directory: Path) -> Path:
    path = directory / f"lanelock-{name}.service"
    path.write_text(localize(block(name).text, standins))
    return path


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not found")
@pytest.mark.parametrize("name", ["systemd-run", "proxy-unit", "man-systemd", "watch-unit"])
def test_systemd_units_verify(name, standins, run_cmd, tmp_path):
    """systemd-analyze verify: no error and no warning (an unknown key or section is a warning,
    a command that is not executable an error)."""
    unit = unit_file(name, standins, tmp_path)
    checked = run_cmd(["systemd-analyze", "verify", "--man=no", unit], cwd=tmp_path)
    assert (checked.returncode, checked.stderr) == (0, ""), checked.stderr


@pytest.mark.parametrize("name", ["systemd-run", "man-systemd"])
def test_systemd_unit_command(name, standins, holder, run_cmd, tmp_path):
    """ExecStart as systemd runs it (its words, no shell): the job on a free lane, `job --cloud`
    on a busy one."""
    unit = unit_file(name, standins, tmp_path).read_text()
    command = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    assert not re.search(r"[$|&;<>`]", command.replace("'", "")), "systemd would not run a shell"
    argv = shlex.split(command)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

    assert run_cmd(argv, env=env).returncode == 0
    assert [(r.state, r.args) for r in standins.runs()] == [("held", [])]
    standins.clear()
    held = holder("-b", "localhost:8080")
    busy = run_cmd(argv, env=env)
    assert busy.returncode == 0 and len(BUSY_LINE.findall(busy.stderr)) == 1, busy.stderr
    assert [(r.state, r.args) for r in standins.runs()] == [("deflected", ["--cloud"])]
    assert held.release() == 0


def test_systemd_run_unit_note_on_the_default_root(lanelock):
    """The unit's comment: "PrivateTmp=yes would hide /tmp/lanelock ...; the default root is
    /run/lock/lanelock" -- whenever /run/lock is root-owned, sticky and world-writable (the
    README's rule), which `where` follows."""
    assert "the default root is /run/lock/lanelock" in block("systemd-run").text
    where = lanelock("where", "--json", env={"LANELOCK_DIR": None, "LANELOCK_SYSTEM_CONFIG": None})
    info = json.loads(where.stdout)
    if info["root_source"] != "default":
        pytest.skip(f"this machine's system config sets the root ({info['root_detail']})")
    run_lock = os.stat("/run/lock") if os.path.isdir("/run/lock") else None
    sound = run_lock is not None and run_lock.st_uid == 0 and run_lock.st_mode & 0o1002 == 0o1002
    assert info["root"] == ("/run/lock/lanelock" if sound else "/tmp/lanelock")


# -- Python -------------------------------------------------------------------------------------
PYTHON_PRELUDE = '''\
import atexit, json, os
ran = []       # (which model, the turn's state and proceed as the call saw them)
prompt = "hello"
def ask_local(*args):
    ran.append(["local", turn.state, turn.proceed, turn.reason])
    if os.environ.get("ASK_LOCAL_RAISES"):
        raise RuntimeError("the engine fell over")
    return "local answer"
def ask_cloud(*args):
    ran.append(["cloud", turn.state, turn.proceed, turn.reason])
    return "cloud answer"
@atexit.register
def report():
    from lanelock import Gate as _Gate
    try:
        free = not _Gate("127.0.0.1:8080").busy()   # asked while this process still runs
    except Exception as error:
        free = repr(error)
    print(json.dumps({"ran": ran, "free_at_exit": free}))
'''


def run_python(code: str, run_cmd, env=None) -> tuple[subprocess.CompletedProcess, dict]:
    done = run_cmd([sys.executable, "-c", code], env=env)
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    return done, json.loads(lines[-1])


@pytest.mark.parametrize("name", ["python-loop", "man-python"])
def test_python_api(name, holder, run_cmd, tmp_path):
    """turn.proceed: the local model when held, ungated, and when the gate fails open (a broken
    gate never blocks a turn); the cloud only when deflected; the lane is let go after the
    block, also on an exception."""
    code = PYTHON_PRELUDE + block(name).text

    done, held = run_python(code, run_cmd)
    assert done.returncode == 0, done.stderr
    assert held == {"ran": [["local", "held", True, None]], "free_at_exit": True}

    broken = tmp_path / "a-file-not-a-directory"
    broken.write_text("")
    done, fail_open = run_python(code, run_cmd, env={"LANELOCK_DIR": broken})
    assert done.returncode == 0, done.stderr
    assert [call[:3] for call in fail_open["ran"]] == [["local", "fail-open", True]]
    assert done.stderr.count("lanelock: warning: ") == 1, done.stderr

    config = tmp_path / "gate-never.toml"
    config.write_text('gate = "never"\n')
    done, ungated = run_python(code, run_cmd, env={"LANELOCK_CONFIG": config})
    assert done.returncode == 0, done.stderr
    assert ungated == {"ran": [["local", "ungated", True, None]], "free_at_exit": True}

    done, raised = run_python(code, run_cmd, env={"ASK_LOCAL_RAISES": "1"})
    assert done.returncode == 1 and "the engine fell over" in done.stderr
    assert raised == {"ran": [["local", "held", True, None]], "free_at_exit": True}

    other = holder("-b", "localhost:8080")
    done, deflected = run_python(code, run_cmd)
    assert done.returncode == 0, done.stderr
    assert deflected == {"ran": [["cloud", "deflected", False, "local_backend_busy"]],
                         "free_at_exit": False}    # the other session still holds it
    assert other.release() == 0


ASYNC_PRELUDE = '''\
import asyncio, atexit, json, os, time
ran, ticks = [], [0]
async def ask_local(prompt):
    ran.append("local")
    return "local answer"
async def ask_cloud(prompt):
    ran.append("cloud")
    return "cloud answer"
# The loop keeps running other tasks while a turn waits: a ticker beside the example's coroutine.
_run, _started = asyncio.run, time.monotonic()
async def _with_ticker(main):
    async def tick():
        while True:
            await asyncio.sleep(0.01)
            ticks[0] += 1
            os.write(2, b"tick\\n")
    ticker = asyncio.ensure_future(tick())
    try:
        return await main
    finally:
        ticker.cancel()
asyncio.run = lambda main: _run(_with_ticker(main))
atexit.register(lambda: print(json.dumps({"ran": ran, "ticks": ticks[0],
                                         "seconds": time.monotonic() - _started})))
'''


def drain(stream) -> None:
    """Read what a pipe holds now, without waiting for more."""
    while select.select([stream], [], [], 0)[0]:
        if not os.read(stream.fileno(), 65536):
            return


def test_asyncio_agents(holder, procs, run_cmd, lock_dir):
    """Free: the local model. Busy, then freed while the task waits: the local model, and the
    loop ran meanwhile. Busy for the whole 5 s: the cloud, after waiting 5 s."""
    example = block("asyncio").text
    wait = float(re.search(r"wait=(\d+)", example).group(1))
    code = ASYNC_PRELUDE + example

    done, free = run_python(code, run_cmd)
    assert done.returncode == 0 and free["ran"] == ["local"], done.stderr

    other = holder("-b", "localhost:8080")
    waiting = procs.start([sys.executable, "-c", code], env=environ(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lock = lock_dir / "localhost-8080.lock"
    wait_for(lambda: is_waiting(lock, waiting.pid), what="the task to wait for the lane")
    drain(waiting.stderr)
    assert read_line(waiting.stderr) == "tick\n"      # the loop runs while the turn waits
    assert other.release() == 0
    out, err = waiting.communicate(timeout=TIMEOUT)
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert waiting.returncode == 0 and report["ran"] == ["local"], err

    other = holder("-b", "localhost:8080")
    done, deflected = run_python(code, run_cmd)
    assert other.release() == 0
    assert done.returncode == 0 and deflected["ran"] == ["cloud"], done.stderr
    assert deflected["seconds"] >= wait and deflected["ticks"] > 10


@pytest.mark.parametrize("name", ["nested", "man-nested"])
def test_nested_turns(name, standins, holder, run_cmd, tmp_path, lock_dir):
    """The subagent handed turn.env runs as part of the turn (held, one turn in the journal);
    with the lane busy the block does not run it."""
    standins.make("subagent.sh", directory=tmp_path)
    env = {"PATH": standins.path}
    code = block(name).text
    done = run_cmd([sys.executable, "-c", code], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert [(r.name, r.state, r.held) for r in standins.runs()] == \
        [("subagent.sh", "held", "localhost-8080.lock")]
    journal = (lock_dir / "localhost-8080.journal").read_text().splitlines()
    assert [json.loads(line)["event"] for line in journal] == ["acquired", "released"]
    standins.clear()
    other = holder("-b", "localhost:8080")
    done = run_cmd([sys.executable, "-c", code], cwd=tmp_path, env=env)
    assert done.returncode == 0 and standins.runs() == [], done.stderr
    assert other.release() == 0


# -- the proxy ----------------------------------------------------------------------------------
def test_proxy_recipe(procs, tmp_path):
    """The command as written starts (its --fallback-key-env variable set), says where it
    listens, and the clients' base URL in its comment reaches it."""
    pytest.importorskip("aiohttp")
    text = block("proxy").text
    joined = text.replace("\\\n", " ")      # the command's continuation lines
    argv = shlex.split(re.search(r"^lanelock proxy .*$", joined, re.M).group(0))
    base = re.search(r"OPENAI_BASE_URL=(\S+)", text).group(1)
    host, port = re.match(r"http://([\d.]+):(\d+)/v1$", base).groups()
    with socket.socket() as probe:
        # As the proxy binds (aiohttp sets SO_REUSEADDR): a previous run's TIME_WAIT is no user.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, int(port)))
        except OSError:
            pytest.skip(f"{host}:{port} is in use here")
    key_env = argv[argv.index("--fallback-key-env") + 1]
    proxy = procs.start([SCRIPT, *argv[1:]], env=environ({key_env: "sk-test"}),
                        stderr=subprocess.PIPE)
    line = re.sub(r"^\S+ ", "", read_line(proxy.stderr))   # its time first
    assert line.strip() == (f"lanelock: proxy listening on http://{host}:{port} for "
                            "http://127.0.0.1:8080 (lane localhost:8080): 1 seat, not pinned"), line
    with urllib.request.urlopen(base.rsplit("/v1", 1)[0] + "/lanelock/status",
                                timeout=TIMEOUT) as answer:
        lanes = json.loads(answer.read())["lanes"]
    assert [lane["lane"] for lane in lanes] == ["localhost:8080"]
    proxy.send_signal(signal.SIGTERM)
    assert proxy.wait(timeout=TIMEOUT) == 0


@pytest.mark.parametrize("name", ["turn-headers", "man-turn-headers"])
def test_turn_headers_through_the_proxy(name, procs, holder, run_cmd, tmp_path, lock_dir):
    """The turn's own request through the proxy (a stand-in engine on 127.0.0.1:8080, the proxy
    on the block's base URL) is part of the turn: answered by the engine, one turn in the journal,
    the block's. With the lane busy the block asks nothing."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("openai")
    code = block(name).text
    port = int(re.search(r'base_url="http://127\.0\.0\.1:(\d+)/v1"', code).group(1))
    _stand_in_on(8080, procs, tmp_path, "llama.cpp")
    proxy = procs.start([SCRIPT, "proxy", "-b", "127.0.0.1:8080", "--listen", f"127.0.0.1:{port}"],
                        stderr=subprocess.PIPE)
    line = read_line(proxy.stderr)
    if "cannot listen" in line:
        pytest.skip(f"127.0.0.1:{port} is in use here")
    assert "proxy listening on" in line, line
    done = run_cmd([sys.executable, "-c", code])
    assert (done.returncode, done.stdout) == (0, "answer from stand-in\n"), done.stderr
    journal = [json.loads(line) for line in
               (lock_dir / "localhost-8080.journal").read_text().splitlines()]
    assert [(event["event"], event["session"]) for event in journal] == \
        [("acquired", "agent"), ("released", "agent")]
    other = holder("-b", "localhost:8080")
    done = run_cmd([sys.executable, "-c", code])
    assert (done.returncode, done.stdout) == (0, ""), done.stderr
    assert other.release() == 0


def _stand_in_on(port: int, procs, tmp_path, kind: str) -> subprocess.Popen:
    port_file = tmp_path / f"engine-{kind}.port"
    engine = procs.start([sys.executable, "-m", "lanelock.testing", "serve", "--port", str(port),
                          "--delay", "0.5", "--kind", kind, "--port-file", str(port_file)],
                         stderr=subprocess.PIPE)
    wait_for(lambda: port_file.exists() or engine.poll() is not None, "the stand-in to listen")
    if engine.poll() is not None:
        pytest.skip(f"127.0.0.1:{port} is in use here")
    return engine


def test_watch_unit_and_its_unseen_line(standins, procs, tmp_path):
    """The unit's ExecStart, run as systemd runs it, watches the engine on 127.0.0.1:8080 (a
    stand-in there), says the README's lines for a request sent straight to it, and ends at
    once on SIGTERM (KillSignal) with 0; an engine it cannot witness is exit 69, which
    RestartPreventExitStatus names."""
    unit = unit_file("watch-unit", standins, tmp_path).read_text()
    argv = shlex.split(re.search(r"^ExecStart=(.*)$", unit, re.M).group(1))
    assert re.search(r"^RestartPreventExitStatus=69$", unit, re.M)
    assert re.search(r"^KillSignal=SIGTERM$", unit, re.M)
    engine = _stand_in_on(8080, procs, tmp_path, "llama.cpp")
    watch = procs.start(argv, stderr=subprocess.PIPE)
    assert read_line(watch.stderr).strip() == ("lanelock: watching the engine at "
                                               "http://127.0.0.1:8080 (llama.cpp, /slots) for "
                                               "lane localhost:8080 every 0.25 s")
    request = urllib.request.Request("http://127.0.0.1:8080/v1/chat/completions",
                                     data=b'{"messages": []}')
    with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
        answer.read()
    # The line when first seen and the line when it ended, their numbers (the clock, the
    # seconds, the tokens: 1 token) this run's own.
    for shown in block("unseen-line").text.strip().splitlines():
        said = read_line(watch.stderr).strip()
        pattern = re.sub(r"\d+", r"\\d+", re.escape(shown)).replace("tokens", "tokens?")
        assert re.fullmatch(pattern, said), (said, shown)
    began = time.monotonic()
    watch.send_signal(signal.SIGTERM)
    assert watch.wait(timeout=TIMEOUT) == 0 and time.monotonic() - began < 1.0
    engine.kill()
    engine.wait(TIMEOUT)
    _stand_in_on(8080, procs, tmp_path, "ollama")
    done = subprocess.run(argv, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 69 and "Ollama reports no work in flight" in done.stderr


# -- inline recipes -----------------------------------------------------------------------------
def test_wait_recipe(standins, holder, procs, lock_dir):
    """`lanelock run --wait 30 -- CMD` blocks in the kernel until the lane frees, then runs."""
    recipe = re.search(r"`(lanelock run --wait (\d+) -- CMD)`", README.read_text())
    assert recipe, "the --wait recipe changed: update this test"
    standins.make("CMD")
    other = holder("-b", "localhost:8080")
    argv = shlex.split(recipe.group(1))
    waiting = procs.start([SCRIPT, *argv[1:]], env=environ({"PATH": standins.path}),
                          stderr=subprocess.PIPE)
    wait_for(lambda: is_waiting(lock_dir / "localhost-8080.lock", waiting.pid),
             what="the --wait turn to block in flock")
    assert standins.runs() == []
    started = time.monotonic()
    assert other.release() == 0
    assert waiting.wait(timeout=TIMEOUT) == 0, waiting.stderr.read()
    assert time.monotonic() - started < float(recipe.group(2))
    assert [(r.name, r.state) for r in standins.runs()] == [("CMD", "held")]


def test_fallback_chain_recipe(standins, holder, run_cmd, tmp_path):
    """`-f '@127.0.0.1:8081 ./ask-small-local.sh' -f './ask-cloud.sh'`: the second local lane
    when it is free, the cloud when it is busy too."""
    recipe = re.search(r"`(-f '@127\.0\.0\.1:8081 [^`]+)`", README.read_text())
    assert recipe, "the fallback chain recipe changed: update this test"
    for name in ("ask-local.sh", "ask-small-local.sh", "ask-cloud.sh"):
        standins.make(name, directory=tmp_path)
    argv = [SCRIPT, "run", "-b", "127.0.0.1:8080", *shlex.split(recipe.group(1)), "--",
            "./ask-local.sh"]
    env = {"PATH": standins.path}

    first = holder("-b", "localhost:8080")
    assert run_cmd(argv, cwd=tmp_path, env=env).returncode == 0
    assert [(r.name, r.state, r.held) for r in standins.runs()] == \
        [("ask-small-local.sh", "deflected", "localhost-8081.lock")]
    standins.clear()
    second = holder("-b", "localhost:8081")
    assert run_cmd(argv, cwd=tmp_path, env=env).returncode == 0
    assert [(r.name, r.state, r.held) for r in standins.runs()] == \
        [("ask-cloud.sh", "deflected", "")]
    assert second.release() == 0 and first.release() == 0
