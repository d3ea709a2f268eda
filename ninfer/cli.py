"""``ninfer serve | generate | convert | info | plan | replay | bench | fleet``."""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from .config import add_serve_arguments, config_from_args
from .engine.kv_dtypes import CHOICES as KV_CHOICES
from .store.default_model import model_or_default


def _check_listen(host: str, port: int, flag: str | None = None) -> None:
    """Bind (and release) the listen address before the model loads, so that a port in use
    fails in a second with one line instead of after the load with a traceback.

    ``flag``: the option that sets this port; a port in use then names it as the way out.

    Raises:
        OSError: the address cannot be bound (errno kept; message names host:port).
    """
    import errno
    import socket

    try:
        family, stype, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:   # (a host name that does not resolve)
        raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on {host}:{port}: the host does "
                      f"not resolve ({getattr(exc, 'strerror', None) or exc}); --host takes "
                      "an address of this machine (127.0.0.1, 0.0.0.0, ::) or its name") \
            from None
    with socket.socket(family, stype, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn binds
        try:
            s.bind(addr)
        except OSError as exc:
            msg = f"cannot listen on {host}:{port}: {exc.strerror}"
            if flag and exc.errno == errno.EADDRINUSE:
                msg += f" (port {port} is in use: pass {flag} N to use another port)"
            raise OSError(exc.errno, msg) from None


def _cmd_serve(ns) -> int:
    import trio

    from .server import build_server, memory_line, serve

    config = config_from_args(ns)
    _check_listen(config.host, config.port, "--port")
    server = build_server(config)
    print(f"ninfer: {memory_line(server)}", file=sys.stderr, flush=True)
    print(f"ninfer: serving {server.runtime.model_id} ({server.runtime.path}) on "
          f"http://{config.host}:{config.port}", file=sys.stderr, flush=True)
    try:
        trio.run(functools.partial(serve, server, handle_signals=True))
    except KeyboardInterrupt:  # a signal before the handlers were installed
        pass
    print("ninfer: stopped", file=sys.stderr, flush=True)
    return 0


def _cmd_generate(ns) -> int:
    import secrets

    from .engine import kv_dtypes
    from .engine.engine import Engine, EngineConfig
    from .engine.requests import ErrorOutput, FinalOutput, Request, TokenOutput
    from .engine.sampling import SamplingParams
    from .events.bus import EventBus
    from .events.sinks import JsonlSink
    from .server import load_runtime

    rt = load_runtime(ns.model, ns.backend)
    bus = EventBus()
    if ns.request_log_jsonl:
        bus.add_sink(JsonlSink(ns.request_log_jsonl))
    messages = ([{"role": "system", "content": ns.system}] if ns.system else []) + \
        [{"role": "user", "content": ns.prompt}]
    prompt_ids = rt.tokenizer.encode(rt.template.render(messages, add_generation_prompt=True))
    n_ctx = ns.max_context or int(rt.artifact.config.get("max_position_embeddings", 8192))
    kv_dtype = kv_dtypes.resolve_for(ns.kv_dtype, rt.model)
    kv_dtypes.check_model(kv_dtype, rt.model)   # (as serve refuses them)
    engine = Engine(rt.model, rt.tokenizer, bus, EngineConfig(
        max_concurrency=1, max_context=n_ctx, kv_dtype=kv_dtype))
    result = {}

    def deliver(item):
        if isinstance(item, TokenOutput):
            sys.stdout.write(item.text)
            sys.stdout.flush()
        elif isinstance(item, FinalOutput):
            sys.stdout.write(item.text + "\n")
            result["final"] = item
        elif isinstance(item, ErrorOutput):
            result["error"] = item

    seed = ns.seed if ns.seed is not None else secrets.randbits(63)
    params = SamplingParams(temperature=ns.temperature, top_k=ns.top_k, top_p=ns.top_p,
                            min_p=ns.min_p, seed=seed)
    engine.submit(Request("generate-1", prompt_ids, params, ns.max_tokens, deliver))
    while engine.step():
        bus.flush()
    bus.flush()
    if "error" in result:
        print(f"ninfer: {result['error'].code}: {result['error'].message}", file=sys.stderr)
        return 1
    final = result["final"]
    if ns.verbose:
        t = final.timings
        rate = (final.completion_tokens - 1) / t["decode_s"] if t["decode_s"] > 0 else 0.0
        print(f"[{final.prompt_tokens} prompt tokens, {final.completion_tokens} generated, "
              f"ttft {t['ttft_s'] * 1000:.0f} ms, decode {rate:.1f} tok/s, "
              f"finish {final.engine_reason}]", file=sys.stderr)
    return 0


def _cmd_convert(ns) -> int:
    from pathlib import Path

    from .store.gguf_import import convert_gguf

    src = model_or_default(ns.src)
    # a destination that cannot be written fails now, not after the whole conversion (with the
    # temporary file's name in the message)
    dst = Path(ns.dst)
    if dst.is_dir():
        raise IsADirectoryError(f"{dst} is a folder: give the .ninfer file to write "
                                f"(e.g. {dst / (Path(src).name.split('.')[0] + '.ninfer')})")
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"{dst}: the folder {dst.parent} does not exist")
    if Path(src).is_dir():
        from .store.hf_import import convert_hf

        digest = convert_hf(src, ns.dst, ns.weights)
    else:
        digest = convert_gguf(src, ns.dst)
    print(f"{ns.dst}: sha256 {digest}")
    return 0


def _cmd_info(ns) -> int:
    from .store.artifact import describe

    print(describe(model_or_default(ns.file)))
    return 0


def _unreadable(path: str, want_dir: bool) -> str | None:
    """Why ``path`` cannot be read as ``replay``'s log file (``want_dir``: its session
    directory), in one line naming it, or None when it can be."""
    import os

    if not os.path.exists(path):
        return f"no such {'directory' if want_dir else 'file'}: {path}"
    if os.path.isdir(path) != want_dir:
        return f"{path} is {'not a directory' if want_dir else 'a directory'}"
    if not os.access(path, os.R_OK):
        return f"cannot read {path}: permission denied"
    return None


def _cmd_replay(ns) -> int:
    import json

    path = ns.execute or ns.log
    why = _unreadable(path, bool(ns.execute)) if path else None
    if why:   # (one line before anything loads, not an errno)
        print(f"ninfer replay: {why}", file=sys.stderr)
        return 2
    if ns.execute:
        from .server import load_runtime
        from .replay import execute_sessions

        if not any(Path(ns.execute).glob("*.json")):   # (before the model loads)
            print(f"ninfer replay: no session files in {ns.execute}", file=sys.stderr)
            return 2
        rt = load_runtime(ns.model, "numpy")
        sessions, divergences = execute_sessions(ns.execute, rt)
        for d in divergences:
            print(f"DIVERGED {d.request_id} {d.what} at position {d.position}: recorded "
                  f"{d.recorded}, replayed {d.replayed}")
        print(f"{len(sessions)} sessions, {len(divergences)} divergences")
        return 1 if divergences else 0
    if not ns.log:
        print("ninfer replay: give a LOG.jsonl, or --execute DIR", file=sys.stderr)
        return 2
    if ns.requests:   # the lines `serve` printed per request, from the log
        from .replay import replay_request_lines

        lines, res = replay_request_lines(ns.log)
        if res.records == 0:
            print(f"ninfer replay: no ninfer records in {ns.log} (invalid_log)", file=sys.stderr)
            return 2
        sys.stdout.writelines(line + "\n" for line in lines)
        if res.malformed_lines:   # (their requests' lines are missing or partial)
            print(f"ninfer replay: skipped {res.malformed_lines} malformed record(s) of "
                  f"{ns.log}", file=sys.stderr)
        return 0
    from .replay import replay_report

    text, snapshot, res = replay_report(ns.log)
    if res.records == 0:   # as POST /dashboard/replay: not a log, rather than an empty report
        print(f"ninfer replay: no ninfer records in {ns.log} (invalid_log)", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    print("# telemetry")
    print(json.dumps(snapshot, indent=1))
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class UsageError(SystemExit):
    """A command-line mistake argparse found (exit code 2): ``main`` says it in one line."""

    def __init__(self, parser: argparse.ArgumentParser, message: str):
        super().__init__(2)
        self.parser, self.message = parser, message


class Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too) raising ``UsageError`` for a mistake instead of
    printing the whole usage block before it."""

    def error(self, message: str):
        raise UsageError(self, message)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="ninfer", description="LLM inference server")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    # (no abbreviations: llama-server's --model would otherwise be taken as --model-id)
    s = sub.add_parser("serve", help="serve the OpenAI- and Anthropic-compatible HTTP API",
                       allow_abbrev=False)
    add_serve_arguments(s)
    s.set_defaults(fn=_cmd_serve, parser=s)

    g = sub.add_parser("generate", help="answer one prompt with the chat template applied")
    g.add_argument("model", nargs="?", default=None,
                   help=".ninfer or GGUF file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--prompt", required=True, help="the user message")
    g.add_argument("--system", default=None, help="an optional system message")
    g.add_argument("--max-tokens", type=_positive_int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--backend", default="auto", choices=("auto", "cupy", "numpy"))
    g.add_argument("--kv-dtype", default="auto", choices=KV_CHOICES,
                   help="how the KV cache stores K and V (as serve's --kv-dtype; auto: fp16 "
                   "on the GPU, fp32 on the numpy backend)")
    g.add_argument("--max-context", type=_positive_int, default=None,
                   help="tokens of prompt and answer (default: the model's trained context)")
    g.add_argument("--request-log-jsonl", default=None)
    g.add_argument("-v", "--verbose", action="store_true", help="print timings to stderr")
    g.set_defaults(fn=_cmd_generate)

    c = sub.add_parser("convert", help="convert a GGUF file or a HuggingFace Qwen3.5 "
                       "checkpoint folder to a .ninfer artifact")
    c.add_argument("src", nargs="?", default=None,
                   help="GGUF file or checkpoint folder (default: SmolLM2-135M-Instruct; "
                   "`ninfer convert OUT.ninfer` converts that)")
    c.add_argument("dst", help="the .ninfer file to write")
    c.add_argument("--weights", default="bf16", choices=("bf16", "int8", "int4", "f32"),
                   help="weight scheme for a checkpoint folder (GGUF keeps its own)")
    c.set_defaults(fn=_cmd_convert)

    r = sub.add_parser("replay", help="fold a JSONL log into /metrics and /telemetry, or "
                       "re-execute recorded sessions")
    r.add_argument("log", nargs="?", default=None, help="a --request-log-jsonl file")
    r.add_argument("--execute", metavar="DIR", default=None,
                   help="re-run the sessions recorded with --record-sessions DIR")
    r.add_argument("--model", default=None, help="model for --execute (default SmolLM2)")
    r.add_argument("--requests", action="store_true",
                   help="print the one line per request that serve prints on stderr (its "
                   "--log-requests), folded from the log, instead of /metrics and /telemetry")
    r.set_defaults(fn=_cmd_replay)

    i = sub.add_parser("info", help="describe a .ninfer or GGUF file")
    i.add_argument("file", nargs="?", default=None,
                   help=".ninfer or GGUF file (default: SmolLM2-135M-Instruct)")
    i.set_defaults(fn=_cmd_info)

    from .plan import add_parser as add_plan_parser
    add_plan_parser(sub)

    from .bench.cli import add_parser as add_bench_parser
    add_bench_parser(sub)

    from .fleet import add_parser as add_fleet_parser
    add_fleet_parser(sub)
    return p


def _refuse(parser: argparse.ArgumentParser, lines: list[str], flags: list[str], root: str):
    """Exit 2 saying ``lines`` as ``parser``'s error, then a hint for each of ``flags`` that is
    an option of the command's peer tools (``llamacpp_flags.PEERS``), and where --help is."""
    from .llamacpp_flags import hints
    command = parser.prog.removeprefix(root).strip()   # "serve", "bench perplexity"
    lines = lines[:1] + hints(flags, command) + lines[1:]
    parser.exit(2, f"{parser.prog}: error: " + "\n  ".join(lines)
                + f"\n  ({parser.prog} --help lists every option)\n")


def main(argv: list[str] | None = None) -> int:
    from .store.artifact import ArtifactError

    p = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    # argparse reads llama-server's -hf REPO as -h given the value "f" (an error about -h):
    # such tokens are set aside and refused below as the unknown options they are
    glued = {a for a in args if a.startswith("-h") and len(a) > 2 and a[2] != "-"}
    try:
        ns, unknown = p.parse_known_args([a for a in args if a not in glued])
    except UsageError as exc:   # (and any other tool's options given: what ninfer calls them)
        _refuse(exc.parser, [exc.message], [a for a in args if a.startswith("-")], p.prog)
    unknown = [a for a in args if a in glued or a in unknown]
    if unknown:   # (llama-server's options: say what ninfer calls them)
        parser = getattr(ns, "parser", p)
        lines = [f"unrecognized arguments: {' '.join(unknown)}"]
        model = getattr(ns, "model", None)
        before = args[args.index(model) - 1] if model in args[1:] else None
        if before in unknown:   # a refused option's value became the positional model
            lines.append(f"{model!r} (after {before}) was read as the model path")
        _refuse(parser, lines, unknown, p.prog)
    ns.argv = args  # `ninfer bench` records its command
    try:
        return ns.fn(ns)
    except SystemExit:
        raise
    except (ArtifactError, FileNotFoundError, ValueError, OSError) as exc:
        # (an OSError of ours, naming what failed, without its "[Errno N]" prefix)
        mine = isinstance(exc, OSError) and exc.filename is None and exc.strerror
        print(f"ninfer: {exc.strerror if mine else exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:   # a size the host cannot hold (numpy: "Unable to allocate ...")
        print(f"ninfer: out of memory: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
