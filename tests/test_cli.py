"""The command line as a user runs it: generate, convert, info (real SmolLM2, subprocesses)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow


def _ninfer(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "ninfer", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_answers_with_the_chat_template(smollm2_gguf):
    r = _ninfer("generate", str(smollm2_gguf), "--prompt", "What is the capital of France?",
                "--max-tokens", "24", "-v")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "prompt tokens" in r.stderr and "finish stop_token" in r.stderr


def test_generate_with_an_int8_kv_cache_and_a_short_context(smollm2_gguf):
    """``generate --kv-dtype int8 --max-context 256``: the answer as serve would give it; a
    prompt and answer past the context is refused, not cut."""
    r = _ninfer("generate", str(smollm2_gguf), "--prompt", "What is the capital of France?",
                "--max-tokens", "24", "--kv-dtype", "int8", "--max-context", "256")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    r = _ninfer("generate", str(smollm2_gguf), "--prompt", "hi " * 300, "--max-context", "256")
    assert r.returncode == 1 and "ninfer: " in r.stderr and "Traceback" not in r.stderr


def test_convert_then_info_then_generate_from_the_artifact(smollm2_gguf, tmp_path):
    out = tmp_path / "smollm2.ninfer"
    r = _ninfer("convert", str(smollm2_gguf), str(out))
    assert r.returncode == 0, r.stderr
    import hashlib
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert digest in r.stdout
    r = _ninfer("info", str(out))
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and digest in r.stdout
    r = _ninfer("generate", str(out), "--prompt", "What is the capital of France?",
                "--max-tokens", "24")
    assert r.returncode == 0 and "Paris" in r.stdout


def test_bad_model_files_give_one_clear_error(tmp_path):
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"definitely not a model")
    for args in (("info", str(bad)), ("generate", str(bad), "--prompt", "hi"),
                 ("info", str(tmp_path / "missing.gguf"))):
        r = _ninfer(*args, timeout=120)
        assert r.returncode == 2
        assert r.stderr.startswith("ninfer: ") and "Traceback" not in r.stderr
        assert ("bad.ninfer" in r.stderr) or ("missing.gguf" in r.stderr)


def test_serve_on_a_port_in_use_fails_in_one_line_before_loading(tmp_path):
    """The listen address is checked before the model loads (the model path here does not even
    exist): exit 2, one ``ninfer:`` line naming host:port and the way out (--port), no
    traceback."""
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _ninfer("serve", str(tmp_path / "absent.gguf"), "--port", str(port), timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("ninfer: ") and "Traceback" not in r.stderr
    assert r.stderr == (f"ninfer: cannot listen on 127.0.0.1:{port}: Address already in use "
                        f"(port {port} is in use: pass --port N to use another port)\n")
    # a host that does not resolve is named as such, with what --host takes
    r = _ninfer("serve", str(tmp_path / "absent.gguf"), "--host", "999.1.1.1", timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("ninfer: cannot listen on 999.1.1.1:8080: the host does not "
                               "resolve (")
    assert r.stderr.endswith("--host takes an address of this machine (127.0.0.1, 0.0.0.0, ::) "
                             "or its name\n")


def test_serve_refuses_a_config_that_does_not_fit_before_listening(smollm2_gguf):
    """The memory budget is checked before the socket opens: exit status 2, one line naming the
    byte deficit (capacity injected with --memory-capacity-bytes, 1,000 bytes short)."""
    from ninfer.engine.memory import plan_memory
    from ninfer.server import load_runtime
    rt = load_runtime(str(smollm2_gguf), "numpy")
    plan = plan_memory(rt.model, max_concurrency=3, max_context=4096, page_size=16,
                       prefill_chunk=512)
    r = _ninfer("serve", str(smollm2_gguf), "--backend", "numpy", "--port", "0",
                "--max-concurrency", "3", "--max-context", "4096",
                "--memory-capacity-bytes", str(plan.total_bytes - 1000), timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ninfer: not enough host memory")
    assert "short by 1000 bytes" in lines[0] and f"needs {plan.total_bytes} bytes" in lines[0]
    assert "serving" not in r.stderr and "Traceback" not in r.stderr


def test_spec_mtp_on_a_model_without_an_mtp_head_fails_before_listening(smollm2_gguf):
    r = _ninfer("serve", str(smollm2_gguf), "--spec", "mtp", "--port", "0", timeout=300)
    assert r.returncode == 2
    assert r.stderr.startswith("ninfer: --spec mtp needs a model with an MTP head")
    from ninfer.config import ServeConfig
    from dataclasses import fields
    spec_help = next(f for f in fields(ServeConfig) if f.name == "spec").metadata["help"]
    assert "decode normally" not in spec_help and "refuses a model without a head" in spec_help


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_cleanly_on_sigterm_and_sigint_with_a_connection_open(smollm2_gguf,
                                                                          tmp_path, sig):
    """A signal while a client connection is open (sent, response unread) stops the server
    gracefully: exit status 0, no traceback, and ``server.stopping`` names the signal."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "log.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "ninfer", "serve", str(smollm2_gguf),
                             "--backend", "numpy", "--port", str(port),
                             "--request-log-jsonl", str(log)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # never read
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    stops = [json.loads(line) for line in log.read_text().splitlines()
             if '"server.stopping"' in line]
    assert [r["reason"] for r in stops] == [f"signal {signal.Signals(sig).name}"]


def test_llama_server_options_are_named_in_ninfers_terms(capsys):
    """A llama-server user's options fail with serve's usage and what ninfer calls each; other
    unknown options and other commands fail as before (exit 2, argparse's message)."""
    from ninfer.cli import main
    from ninfer.llamacpp_flags import FLAGS
    with pytest.raises(SystemExit) as exc:
        main(["serve", "-c", "4096", "--cache-type-k=q8_0", "--bogus"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "ninfer serve: error: unrecognized arguments: -c --cache-type-k=q8_0 --bogus" in err
    assert f"-c is llama-server's; ninfer serve: {FLAGS['-c']}" in err
    assert f"--cache-type-k is llama-server's; ninfer serve: {FLAGS['--cache-type-k']}" in err
    assert "--bogus is" not in err
    assert "'4096' (after -c) was read as the model path" in err and "usage:" not in err
    with pytest.raises(SystemExit):   # not an abbreviation of --model-id
        main(["serve", "--model", "m.gguf"])
    assert "--model is llama-server's; ninfer serve: the model path" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["info", "-c"])
    assert exc.value.code == 2 and "ninfer: error: unrecognized arguments: -c" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit) as exc:   # vLLM's names too
        main(["serve", "--kv-cache-dtype=fp8", "--gpu-memory-utilization=0.9"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "--kv-cache-dtype is vLLM's; ninfer serve: --kv-dtype (" in err and "fp8: int8" in err
    assert "--gpu-memory-utilization is vLLM's; ninfer serve: --gpu-memory SIZE" in err
    with pytest.raises(SystemExit):   # vLLM's switch for its request log: ours is on by default
        main(["serve", "--disable-log-requests"])
    assert "--disable-log-requests is vLLM's; ninfer serve: --no-log-requests" in (
        capsys.readouterr().err)


def test_llama_perplexity_options_are_named_for_bench_perplexity(capsys):
    """llama-perplexity's options given to ``ninfer bench perplexity`` are named in its terms
    (not serve's)."""
    from ninfer.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["bench", "perplexity", "--text", "a.txt", "-c", "512", "-f", "b.txt",
              "--chunks", "4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "ninfer bench perplexity: error: unrecognized arguments: -c -f b.txt --chunks 4" in err
    assert "-c is llama-perplexity's; ninfer bench perplexity: --ctx N" in err
    assert "-f is llama-perplexity's; ninfer bench perplexity: --text FILE" in err
    assert "--chunks is llama-perplexity's; ninfer bench perplexity: --windows N" in err
    assert "llama-server" not in err and "'512' (after -c) was read as the model path" in err


@pytest.mark.parametrize("argv, lines", [
    (["bench", "perplexity", "-f", "a.txt", "-c", "512"],
     ["ninfer bench perplexity: error: the following arguments are required: --text",
      "  -f is llama-perplexity's; ninfer bench perplexity: --text FILE",
      "  -c is llama-perplexity's; ninfer bench perplexity: --ctx N"]),
    (["bench", "prefill", "--behind", "256", "--behind-delay", "-1"],
     ["ninfer bench prefill: error: argument --behind-delay: expected seconds >= 0, got '-1'"]),
    (["serve", "--max-prefill-lanes", "abc"],
     ["ninfer serve: error: argument --max-prefill-lanes: invalid int value: 'abc'"]),
    ([], ["ninfer: error: the following arguments are required: COMMAND"]),
    (["bench"], ["ninfer bench: error: the following arguments are required: KIND"])],
    ids=["missing --text, llama-perplexity's -f given", "negative delay", "not an int",
         "no command", "no bench kind"])
def test_a_usage_mistake_is_said_in_a_line_or_two(argv, lines, capsys):
    """A mistake argparse finds (a missing required option, a value of the wrong type or range)
    is said without argparse's usage block, with another tool's options named in ninfer's
    terms, nothing run; the message names the option, not argparse's internal names."""
    from ninfer.cli import main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    prog = lines[0].split(": error:")[0]
    assert exc.value.code == 2
    assert err.splitlines() == [*lines, f"  ({prog} --help lists every option)"]


@pytest.mark.parametrize("command", [
    ["serve"], ["generate"], ["convert"], ["replay"], ["info"], ["plan"], ["fleet"],
    ["bench", "decode"], ["bench", "prefill"], ["bench", "serve"], ["bench", "perplexity"]],
    ids=" ".join)
def test_every_commands_help_prints(command, capsys):
    """``--help`` of every command prints its options (argparse formats each option's help:
    a stray percent sign in one would turn the whole page into a traceback)."""
    from ninfer.cli import main
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert out.startswith(f"usage: ninfer {' '.join(command)}") and "--help" in out


def test_llama_servers_hf_option_is_named_not_read_as_help(capsys):
    """``-hf REPO`` (llama-server's download option) is refused as llama-server's, with the
    repo named as the model it became (argparse alone took it for ``-h`` with the value "f")."""
    from ninfer.cli import main
    from ninfer.llamacpp_flags import FLAGS
    with pytest.raises(SystemExit) as exc:
        main(["serve", "-hf", "ggml-org/SmolLM2-135M-GGUF", "-c", "4096"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "ninfer serve: error: unrecognized arguments: -hf -c 4096" in err
    assert f"-hf is llama-server's; ninfer serve: {FLAGS['-hf']}" in err
    assert "'ggml-org/SmolLM2-135M-GGUF' (after -hf) was read as the model path" in err
    assert "-h/--help" not in err


def test_a_size_the_host_cannot_allocate_is_one_line(monkeypatch, capsys):
    """``serve --max-concurrency 100000`` on the numpy backend asked for a 391 GiB KV pool: numpy's
    MemoryError is one line, not a traceback."""
    from ninfer import cli

    def serve(ns):
        raise MemoryError("Unable to allocate 391. GiB for an array with shape "
                          "(51200000, 16, 2, 64) and data type float32")

    monkeypatch.setattr(cli, "_cmd_serve", serve)
    assert cli.main(["serve"]) == 2
    assert capsys.readouterr().err == ("ninfer: out of memory: Unable to allocate 391. GiB for "
                                       "an array with shape (51200000, 16, 2, 64) and data "
                                       "type float32\n")


def test_send_timeout_is_zero_or_at_least_five_seconds():
    """Below ~5 s the kernel's backed-off zero-window probes reset clients that do read; a
    value under 1 ms would become 0 ms, which the kernel reads as "never"."""
    from ninfer.config import ServeConfig
    assert ServeConfig(send_timeout_s=0).send_timeout_s == 0
    assert ServeConfig(send_timeout_s=5).send_timeout_s == 5
    for bad in (0.0004, 1.0, 4.9, -1, 86401, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="send-timeout-s"):
            ServeConfig(send_timeout_s=bad)


def test_a_second_signal_during_the_graceful_stop_exits_at_once(smollm2_gguf, tmp_path):
    """SIGTERM and SIGINT arrive together (sent while the process is stopped, so that both are
    pending when it resumes): the first starts the graceful stop, the second ends the process
    at once with status 128 + its number and one stderr line naming it (it used to die by
    SIGTERM with no message, or end in a KeyboardInterrupt)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ninfer", "serve", str(smollm2_gguf),
                             "--backend", "numpy", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
        proc.send_signal(signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = err.strip().splitlines()
    first = [ln for ln in lines if "received, shutting down" in ln]
    assert len(first) == 1, err
    second = signal.SIGTERM if "SIGINT received" in first[0] else signal.SIGINT
    assert proc.returncode == 128 + second, err
    assert lines[-1].startswith(f"ninfer: second signal ({second.name}) during the graceful "
                                "stop: exiting now"), err
    assert "Traceback" not in err and "ninfer: stopped" not in err, err


def test_convert_to_a_folder_or_a_missing_folder_fails_first(smollm2_gguf, tmp_path):
    """The destination is checked before converting: a folder, or a file in a folder that does
    not exist, is one line naming it (it used to fail after converting, naming the temporary
    file), and nothing is written."""
    r = _ninfer("convert", str(tmp_path))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"ninfer: {tmp_path} is a folder: give the .ninfer file to "
                                f"write (e.g. {tmp_path / 'SmolLM2-135M-Instruct.ninfer'})")
    r = _ninfer("convert", str(tmp_path / "no" / "x.ninfer"))
    assert r.returncode == 2
    assert r.stderr.strip() == (f"ninfer: {tmp_path / 'no' / 'x.ninfer'}: the folder "
                                f"{tmp_path / 'no'} does not exist")
    assert list(tmp_path.iterdir()) == []


def test_convert_and_info_without_a_path_use_the_bundled_model(smollm2_gguf, tmp_path):
    """As ``serve`` and ``generate``: ``ninfer info`` describes SmolLM2, ``ninfer convert OUT``
    converts it (the README's commands, run as written)."""
    r = _ninfer("info")
    assert r.returncode == 0, r.stderr
    assert str(smollm2_gguf) in r.stdout and "llama" in r.stdout
    out = tmp_path / "smollm2.ninfer"
    r = _ninfer("convert", str(out))
    assert r.returncode == 0, r.stderr
    import hashlib
    assert hashlib.sha256(out.read_bytes()).hexdigest() in r.stdout
