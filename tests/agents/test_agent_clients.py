"""Real coding-agent CLIs against a real ninfer serving SmolLM2 (issue 28, Tests).

The CLIs come from npm at the versions pinned by ``tests/agents/package-lock.json``
(``npm install --prefix tests/agents --no-audit --no-fund``: not ``npm ci``, which insists on
OpenCode's other-platform binaries that the registry lacks; both ship their native binary in a
per-platform optional package, so nothing is downloaded at run time):

- ``claude -p`` (Claude Code) on the Anthropic route ``/v1/messages``, with its real system
  prompt and tools;
- ``opencode run`` (OpenCode) on the OpenAI route ``/v1/chat/completions``, one turn and a
  three-turn session (``--continue``, then ``--session ID``) whose later turns must reuse the
  prefix the earlier ones left in a lane (``cached_tokens``).

Each completes its turns: exit 0, a non-empty answer, every request it made ``request.finished``
in the server's JSONL log, no ``request.error`` / ``request.failed`` / ``request.cancelled`` /
``request.rejected``.

Hermetic: the server and the CLIs run in a private network namespace (``unshare -rn``: only a
loopback interface), with HOME / XDG dirs in a temporary directory, telemetry, update checks,
nonessential traffic and npm lookups turned off by environment, and HTTP(S) proxies pointing at a
dead loopback port (``NO_PROXY`` for 127.0.0.1). Where user namespaces are not permitted the
namespace is skipped and the environment alone keeps the CLIs local (checked with strace: with
these settings neither connects anywhere but 127.0.0.1).

Output is capped on the client side (``CLAUDE_CODE_MAX_OUTPUT_TOKENS``, OpenCode's model
``limit.output``): SmolLM2 rarely stops on its own at temperature 1 and the CPU decodes a few
tokens a second. Claude Code takes an answer cut at its cap as an error (after three retries
that ask it to continue), so its server decodes greedily the requests that name no temperature
(Claude Code names none) and the prompt asks for one word.

Skipped when the CLIs are not installed locally; under CI (``CI`` or ``NINFER_REQUIRE_MODEL``
set) that is a failure instead, as for the model (tests/conftest.py).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ninfer.ports import free_ports

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
BIN = HERE / "node_modules" / ".bin"
MODEL_ID = "SmolLM2-135M-Instruct"
REQUIRED = bool(os.environ.get("CI") or os.environ.get("NINFER_REQUIRE_MODEL"))
API_KEY = "sk-ninfer-test"  # the server runs without --api-key; the CLIs insist on some key
MAX_OUTPUT_TOKENS = 24  # OpenCode: an answer cut at the cap is still an answer
CLAUDE_MAX_OUTPUT_TOKENS = 64  # Claude Code: one cut at the cap is an error (after 3 retries)
# The server's sampling default for requests that name no temperature (Claude Code, OpenCode)
GREEDY_DEFAULT = ("--temperature", "0")
CONTEXT = 8192
CLI_TIMEOUT_S = 900
DEAD_PROXY = "http://127.0.0.1:9"  # discard port: nothing listens, a proxied request fails fast

# Runs as the namespace holder: bring ``lo`` up (no iproute2 needed), say so, then wait for
# stdin to close. nsenter puts the server and the CLIs into this process's namespaces.
_HOLDER = r"""
import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))
print("ready", flush=True)
sys.stdin.read()
"""

_PROBE = r"""
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=2).read()
except Exception:
    sys.exit(1)
"""


PINNED = json.loads((HERE / "package.json").read_text())["dependencies"]
PACKAGES = {"claude": "@anthropic-ai/claude-code", "opencode": "opencode-ai"}
# README's command: npm ci fails, the registry lacks some of OpenCode's other-platform binaries
INSTALL = "npm install --prefix tests/agents --no-audit --no-fund"


def _agent_binary(name: str) -> Path:
    """The CLI's native binary, at the version package.json pins (skipped when absent, failed
    under CI)."""
    path = BIN / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        msg = f"{name} is not installed: {INSTALL}"
        if REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
    want = PINNED[PACKAGES[name]]
    with tempfile.TemporaryDirectory() as home:
        done = subprocess.run([str(path), "--version"], env=base_env(Path(home)),
                              capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or want not in done.stdout:
        # npm's install scripts put the platform package's binary in place of a stub
        pytest.fail(f"{path} --version gave {done.returncode} {done.stdout!r} "
                    f"{done.stderr[-500:]!r}, expected {want}: {INSTALL} "
                    "(with its install scripts)")
    return path


def test_install_hint_is_the_readme_command(tmp_path, monkeypatch):
    """A missing CLI's message gives README's install command (not ``npm ci``, which fails)."""
    readme = (HERE.parent.parent / "README.md").read_text()
    assert INSTALL in readme
    monkeypatch.setattr(sys.modules[__name__], "BIN", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "REQUIRED", False)
    with pytest.raises(pytest.skip.Exception, match="npm install --prefix tests/agents"):
        _agent_binary("opencode")


class Sandbox:
    """Where the server and the CLIs run: a private network namespace holding only loopback
    (``unshare -rn``), entered with ``nsenter``; or, where user namespaces are not permitted,
    the host's network with the environment alone keeping the clients local."""

    def __init__(self) -> None:
        self.holder: subprocess.Popen | None = None
        self.note = ""

    def start(self) -> None:
        if not (shutil.which("unshare") and shutil.which("nsenter")):
            self.note = "unshare / nsenter not found"
            return
        p = subprocess.Popen(["unshare", "-rn", sys.executable, "-c", _HOLDER],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        if p.stdout.readline().strip() == "ready":
            self.holder = p
            return
        self.note = f"unshare -rn failed: {self._end(p).strip()}"

    @staticmethod
    def _end(p: subprocess.Popen) -> str:
        p.stdin.close()  # the holder exits at end of input
        p.wait(timeout=10)
        err = p.stderr.read()
        p.stdout.close()
        p.stderr.close()
        return err

    def stop(self) -> None:
        if self.holder is not None:
            self._end(self.holder)
            self.holder = None

    def argv(self, argv: list[str]) -> list[str]:
        if self.holder is None:
            return argv
        return ["nsenter", "-t", str(self.holder.pid), "-U", "-n", "--preserve-credentials",
                "--", *argv]

    def describe(self) -> str:
        return "private network namespace" if self.holder else f"host network ({self.note})"


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


class Ninfer:
    """A real ``ninfer serve`` process on SmolLM2 inside the sandbox, logging to JSONL."""

    def __init__(self, sandbox: Sandbox, model: Path, backend: str, workdir: Path,
                 *flags: str) -> None:
        self.sandbox = sandbox
        self.port = free_ports()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "ninfer.jsonl"
        self.stderr_path = workdir / "ninfer.stderr"
        ninfer = Path(sys.executable).parent / "ninfer"
        argv = [str(ninfer), "serve", str(model), "--backend", backend, "--port", str(self.port),
                "--max-context", str(CONTEXT), "--seed", "0",
                "--request-log-jsonl", str(self.log), *flags]
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(sandbox.argv(argv), stdout=self._stderr,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"ninfer serve exited {self.proc.returncode}:\n"
                                     + self.stderr_path.read_text()[-4000:])
            probe = subprocess.run(sandbox.argv([sys.executable, "-c", _PROBE,
                                                 self.url + "/health"]))
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError("ninfer serve did not answer /health in 180 s:\n"
                                     + self.stderr_path.read_text()[-4000:])
            time.sleep(0.5)

    def records(self) -> list[dict]:
        return read_log(self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: ninfer fails what is in flight and exits 0
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()


@pytest.fixture
def claude_bin() -> Path:
    return _agent_binary("claude")


@pytest.fixture
def opencode_bin() -> Path:
    return _agent_binary("opencode")


@pytest.fixture
def sandbox():
    box = Sandbox()
    box.start()
    yield box
    box.stop()


@pytest.fixture
def ninfer_server(sandbox, smollm2_gguf, backend, tmp_path):
    server = Ninfer(sandbox, smollm2_gguf, backend, tmp_path)
    yield server
    server.stop()


@pytest.fixture
def greedy_ninfer_server(sandbox, smollm2_gguf, backend, tmp_path):
    """Requests that leave the temperature out are decoded greedily: Claude Code sends none
    (1.0 by default), and at 1.0 SmolLM2 runs past the output cap on most answers, which
    Claude Code reports as an error after retrying; greedily it answers and stops."""
    server = Ninfer(sandbox, smollm2_gguf, backend, tmp_path, *GREEDY_DEFAULT)
    yield server
    server.stop()


def base_env(home: Path) -> dict[str, str]:
    """A clean environment (nothing of the caller's: no API keys, proxies or npm settings):
    HOME and the XDG dirs in the test's temporary directory, proxies at a dead port."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TMPDIR": str(home / "tmp"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = DEAD_PROXY
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return env


def run_cli(sandbox: Sandbox, argv: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(sandbox.argv(argv), env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S)
    print(f"$ {' '.join(argv[:2])} ... -> exit {done.returncode} in "
          f"{time.monotonic() - started:.1f} s ({sandbox.describe()})")
    return done


def check_requests(records: list[dict], protocol: str) -> list[dict]:
    """Every request the client made was served to the end; returns the request.finished
    records (in log order)."""
    bad = [r for r in records if r["kind"] in ("request.error", "request.failed",
                                                "request.cancelled", "request.rejected")]
    assert not bad, f"requests that did not finish: {json.dumps(bad, indent=1)}"
    received = [r for r in records if r["kind"] == "request.received"]
    finished = {r["request_id"]: r for r in records if r["kind"] == "request.finished"}
    assert received, "the client made no generation request"
    for r in received:
        assert r["protocol"] == protocol, r
        assert r["request_id"] in finished, f"request {r['request_id']} never finished: {r}"
        print(f"  {r['request_id']}: prompt {r['prompt_tokens']} tokens, max_tokens "
              f"{r['max_tokens']} ({r['max_tokens_source']}), cached "
              f"{finished[r['request_id']]['cached_tokens']}, ignored {r.get('ignored_fields')}")
    return [finished[r["request_id"]] for r in received]


# --- Claude Code on /v1/messages -------------------------------------------------------------


def test_claude_code_print_mode(claude_bin, greedy_ninfer_server, sandbox, tmp_path):
    ninfer_server = greedy_ninfer_server
    # a short working directory: Claude Code writes it into the prompt's environment block,
    # which SmolLM2 tends to recite (a pytest path makes that recital longer than the cap)
    home, project = tmp_path / "home", Path(tempfile.mkdtemp(prefix="cc", dir="/tmp"))
    env = base_env(home) | {
        "ANTHROPIC_BASE_URL": ninfer_server.url,
        "ANTHROPIC_API_KEY": API_KEY,
        "ANTHROPIC_MODEL": MODEL_ID,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL_ID,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL_ID,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(CLAUDE_MAX_OUTPUT_TOKENS),
        # no telemetry, error reporting, update checks, /api/hello probe, feature-flag fetches
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    try:
        done = run_cli(sandbox, [str(claude_bin), "-p", "Say hello in one word.",
                                 "--model", MODEL_ID, "--max-turns", "1",
                                 "--output-format", "json"], env, project)
    finally:
        shutil.rmtree(project, ignore_errors=True)
    assert done.returncode == 0, f"claude exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    result = json.loads(done.stdout)
    assert result["is_error"] is False and result["subtype"] == "success", result
    assert isinstance(result["result"], str) and result["result"].strip(), result
    check_requests(ninfer_server.records(), "anthropic_messages")


# --- OpenCode on /v1/chat/completions --------------------------------------------------------


def opencode_setup(server: Ninfer, tmp_path: Path) -> tuple[dict, Path]:
    home, project = tmp_path / "home", tmp_path / "project"
    project.mkdir()
    config = {
        "autoupdate": False,
        "share": "disabled",
        "model": f"ninfer/{MODEL_ID}",
        "small_model": f"ninfer/{MODEL_ID}",
        "provider": {"ninfer": {
            # bundled in the opencode binary: nothing is installed at run time
            "npm": "@ai-sdk/openai-compatible",
            "name": "ninfer",
            "options": {"baseURL": server.url + "/v1", "apiKey": API_KEY},
            "models": {MODEL_ID: {"name": MODEL_ID, "tool_call": True,
                                  "limit": {"context": CONTEXT, "output": MAX_OUTPUT_TOKENS}}},
        }},
    }
    (project / "opencode.json").write_text(json.dumps(config, indent=2))
    env = base_env(home) | {
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # no models.dev catalogue
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        # opencode installs @opencode-ai/plugin into its config dir with a built-in npm:
        # offline, it gives up without asking the registry (and the registry is a dead port)
        "npm_config_offline": "true",
        "npm_config_registry": DEAD_PROXY + "/",
    }
    return env, project


def opencode_turn(opencode: Path, sandbox: Sandbox, env: dict, project: Path, message: str,
                  *extra: str) -> tuple[str, str]:
    """One ``opencode run --format json`` turn -> (answer text, session id).

    A new session is given a ``--title``: without one OpenCode asks the model for a title in
    the background and ``opencode run`` exits as soon as the answer is complete, abandoning
    that request mid-generation (``request.cancelled`` ``client_disconnected``: the client's
    choice, but then not every request it made finishes)."""
    done = run_cli(sandbox, [str(opencode), "run", "--format", "json", *extra, message],
                   env, project)
    assert done.returncode == 0, (f"opencode exited {done.returncode}:\n{done.stdout}\n"
                                  f"{done.stderr[-4000:]}")
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    errors = [e for e in events if e.get("type") == "error"]
    assert not errors, errors
    text = "".join(e["part"]["text"] for e in events
                   if e.get("type") == "text" and e.get("part", {}).get("text"))
    sessions = {e["sessionID"] for e in events if e.get("sessionID")}
    assert len(sessions) == 1, f"expected one session id in {events}"
    return text, sessions.pop()


def test_opencode_run(opencode_bin, ninfer_server, sandbox, tmp_path):
    env, project = opencode_setup(ninfer_server, tmp_path)
    answer, _ = opencode_turn(opencode_bin, sandbox, env, project,
                              "Say hello in one short sentence.", "--title", "ninfer one turn")
    assert answer.strip()
    check_requests(ninfer_server.records(), "openai_chat_completions")


def opencode_session(opencode_bin, ninfer_server, sandbox, env, project) -> list[list[dict]]:
    """Three turns of one OpenCode session -> each turn's request.finished records."""
    turns = [
        ("Say hello in one short sentence.", ("--title", "ninfer multi-turn")),
        ("Now say goodbye in one short sentence.", ("--continue",)),
        ("Thank you. One more short sentence, please.", None),  # --session <id of turn 1>
    ]
    session = None
    per_turn: list[list[dict]] = []
    for message, extra in turns:
        before = len(ninfer_server.records())
        if extra is None:
            extra = ("--session", session)
        answer, sid = opencode_turn(opencode_bin, sandbox, env, project, message, *extra)
        assert answer.strip()
        assert session in (None, sid), f"turn continued {sid}, not {session}"
        session = sid
        per_turn.append(check_requests(ninfer_server.records()[before:],
                                       "openai_chat_completions"))
    return per_turn


def test_opencode_multi_turn_session_reuses_prefix(opencode_bin, ninfer_server, sandbox,
                                                   tmp_path):
    env, project = opencode_setup(ninfer_server, tmp_path)
    # OpenCode's system prompt holds today's date (local time, as the CLI reads it): a session
    # that spans midnight changes its prompt there (a real miss, ~2,000 tokens in), so it is
    # run again, once; a second midnight cannot come within minutes.
    for _ in range(2):
        day = time.strftime("%Y-%m-%d")
        per_turn = opencode_session(opencode_bin, ninfer_server, sandbox, env, project)
        if time.strftime("%Y-%m-%d") == day:
            break
        print(f"the session spanned midnight ({day}): run again")
    check_requests(ninfer_server.records(), "openai_chat_completions")
    # The turn's main request (the longest prompt; turn 1 also asks for a title) extends the
    # previous turn's conversation, retained in a lane: at least that prompt is reused.
    for k in range(1, len(per_turn)):
        previous = max(per_turn[k - 1], key=lambda r: r["prompt_tokens"])
        main = max(per_turn[k], key=lambda r: r["prompt_tokens"])
        assert main["cached_tokens"] >= previous["prompt_tokens"], (
            f"turn {k + 1} reused {main['cached_tokens']} of its {main['prompt_tokens']} prompt "
            f"tokens; turn {k} prompt was {previous['prompt_tokens']}")
