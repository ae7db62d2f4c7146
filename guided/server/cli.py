"""`guided serve | generate | bench`: the command line (also `python -m guided.server.cli`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import runpy
import sys
from pathlib import Path

from guided.config import EngineConfig

logger = logging.getLogger("guided.server")


def _parse_optional(kind):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else kind(text)

    parse.__name__ = kind.__name__
    return parse


def add_engine_flags(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> None:
    """Every EngineConfig field as --field-name (bools as --flag / --no-flag)."""
    group = parser.add_argument_group("engine options (EngineConfig)")
    group.add_argument("--model", default=None,
                       help=EngineConfig.__dataclass_fields__["model"].metadata["help"])
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" or f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        type_text = str(f.type)
        optional = "None" in type_text
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r})"
        if "bool" in type_text:
            group.add_argument(flag, dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
            continue
        kind = int if "int" in type_text else float if "float" in type_text else str
        group.add_argument(flag, dest=f.name, default=None,
                           type=_parse_optional(kind) if optional else kind, help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="guided", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: the model's own name)")
    serve.add_argument("--reasoning-parser", default=None,
                       choices=["think", "deepseek_r1", "qwen3"],
                       help="the model reasons in <think> ... </think> first: the constraint "
                            "applies after it, which comes back as reasoning_content")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template (a file, or the template itself) in place of "
                            "the model's; its tool-call format (Hermes, Llama 3, Mistral) is "
                            "the one tool_choice auto then takes")
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"],
                       help="what the server logs (default: info)")
    serve.add_argument("--api-key", default=os.environ.get("GUIDED_API_KEY"),
                       help="require `Authorization: Bearer <key>` on every route but /health "
                            "(default: $GUIDED_API_KEY; none: open)")
    serve.add_argument("--enable-cache-report", "--enable-prompt-tokens-details",
                       action="store_true",
                       help="report usage.prompt_tokens_details.cached_tokens: prompt tokens "
                            "served from the prefix cache (SGLang's and vLLM's flags)")
    serve.add_argument("--drain-timeout", type=float, default=10.0,
                       help="seconds in-flight requests may finish at shutdown (default: 10)")
    add_engine_flags(serve)

    gen = sub.add_parser("generate", help="generate offline for one prompt")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    constraint = gen.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE")
    constraint.add_argument("--json-object", action="store_true")
    constraint.add_argument("--regex")
    constraint.add_argument("--choice", help="comma-separated options")
    constraint.add_argument("--grammar", metavar="FILE", help="an EBNF grammar file")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--log-level", default="warning",
                     choices=["debug", "info", "warning", "error"])
    add_engine_flags(gen, skip=frozenset({"seed"}))  # --seed is the sampling seed here

    bench = sub.add_parser("bench", help="run a script of benchmarks/ (e.g. `guided bench "
                                         "bfcl_eval --limit 20`)")
    bench.add_argument("name", nargs="?", help="benchmark script name (without .py)")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"serve": serve, "generate": generate, "bench": bench}[args.command](args)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from guided.errors import InvalidRequestError
    from guided.server.app import create_app
    from guided.server.door import HeaderTimeoutProtocol
    from guided.serving.client import EngineClient

    _setup_logging(args.log_level)
    try:
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
        chat_template = _chat_template(args.chat_template)
    except (InvalidRequestError, OSError) as e:
        print(f"guided serve: {e}", file=sys.stderr)
        return 2
    engine = EngineClient(config, log_level=args.log_level)
    _log_startup(engine.engine, f"http://{args.host}:{args.port}")
    app = create_app(engine, served_model_name=args.served_model_name,
                     drain_timeout=args.drain_timeout, api_key=args.api_key,
                     reasoning_parser=args.reasoning_parser,
                     chat_template=chat_template, cache_report=args.enable_cache_report)
    # uvicorn's own grace period only backs up the engine's drain (which ends every stream).
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port,
                                    log_level=args.log_level, timeout_graceful_shutdown=
                                    int(args.drain_timeout) + 5, http=HeaderTimeoutProtocol)
    asyncio.run(_draining_server(uvicorn_config, engine, args.drain_timeout).serve())
    return 0


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the template given inline (vLLM's convention)."""
    if value is None or any(c in value for c in "{}\n"):
        return value
    return Path(value).read_text()


def _draining_server(config, engine, drain_timeout: float):
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """On SIGTERM / SIGINT, drains the engine while uvicorn waits for connections: requests
        finish, or end with finish_reason "abort" at the deadline, and the process exits 0."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after a graceful stop (exit status -15 / 130);
            # a drained shutdown is a clean exit.
            getattr(self, "_captured_signals", []).clear()

        async def shutdown(self, sockets=None) -> None:
            drain = asyncio.ensure_future(engine.shutdown(drain_timeout))
            await super().shutdown(sockets)
            await drain

    return DrainingServer(config)


def _log_startup(info, url: str) -> None:
    config, blocks = info.config, info.initial_stats.kv_blocks_total
    logger.info("model %s (%s) on %s, dtype %s", info.model_name, config.model, info.device,
                info.dtype.removeprefix("torch."))
    logger.info("KV cache: %d blocks x %d tokens = %d tokens; max_model_len %d; max_num_seqs %d",
                blocks, config.block_size, blocks * config.block_size, info.max_model_len,
                config.max_num_seqs)
    logger.info("serving on %s (OpenAI API at %s/v1)", url, url)


def generate(args: argparse.Namespace) -> int:
    from guided.llm import LLM
    from guided.params import SamplingParams

    _setup_logging(args.log_level)
    try:
        constraint = _constraint(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed, **constraint)
        llm = LLM(**engine_kwargs(args))
        if args.chat:
            [out] = llm.chat([[{"role": "user", "content": args.prompt}]], params)
        else:
            [out] = llm.generate([args.prompt], params)
    except (ValueError, OSError) as e:  # a bad constraint, flag or file: its message, status 2
        print(f"guided generate: {e}", file=sys.stderr)
        return 2
    if out.finish_reason == "error":  # e.g. a regex that does not compile
        print(f"guided generate: {out.error}", file=sys.stderr)
        return 2
    print(out.text)
    m = out.metrics
    print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, "
          f"forward_passes={m.forward_passes}, jump_forward_tokens={m.jump_forward_tokens}]",
          file=sys.stderr)
    return 0


def _constraint(args: argparse.Namespace) -> dict:
    """SamplingParams' constraint kwargs from the flags (a bad file: OSError / ValueError)."""
    if args.json_schema:
        try:
            return {"json_schema": json.loads(Path(args.json_schema).read_text())}
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.json_schema} is not valid JSON: {e}") from None
    if args.json_object:
        return {"json_object": True}
    if args.regex:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": [c for c in args.choice.split(",") if c]}
    if args.grammar:
        return {"grammar": Path(args.grammar).read_text()}
    return {}


def bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    scripts = sorted(p.stem for p in root.glob("*.py")) if root.is_dir() else []
    if not args.name:
        print("usage: guided bench NAME [ARGS...]; available: " + (", ".join(scripts) or
                                                                  "none (no benchmarks/ here)"))
        return 2
    if args.name not in scripts:
        print(f"guided bench: no benchmark {args.name!r} in {root}; available: "
              f"{', '.join(scripts) or 'none'}", file=sys.stderr)
        return 2
    sys.argv = [str(root / f"{args.name}.py"), *args.rest]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
