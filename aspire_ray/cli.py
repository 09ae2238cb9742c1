"""Command line: ``aspire-ray generate --prompt ...`` prints a completion;
``aspire-ray serve`` runs the OpenAI-compatible server (uvicorn in this process, or Ray Serve
with ``--ray``)."""

from __future__ import annotations

import argparse
import json
import sys

from .config import SPEC_MODES


def _generate(args: argparse.Namespace) -> int:
    from . import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, spec_mode=args.spec_mode,
              tp_size=args.tp_size, load_format=args.load_format)
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], tokenize=False,
            add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    out = llm.generate([prompt], params)[0]
    print(out.text)
    if args.verbose:
        m = out.metrics
        print(json.dumps({"finish_reason": out.finish_reason, "tokens": len(out.token_ids),
                          "drafted": m.drafted, "accepted": m.accepted,
                          "mean_accepted_length": m.mean_accepted_length}), file=sys.stderr)
    llm.shutdown()
    return 0


def _serve_args(args: argparse.Namespace) -> tuple[dict, dict]:
    """(app args, http options): the config file's first application, then the flags."""
    app_args: dict = {"engine": {}, "server": {}, "deployment": {}}
    http = {"host": "127.0.0.1", "port": 8000}
    if args.config:
        import yaml

        with open(args.config) as f:
            config = yaml.safe_load(f) or {}
        http.update(config.get("http_options") or {})
        apps = config.get("applications") or [{}]
        for section, values in (apps[0].get("args") or {}).items():
            app_args.setdefault(section, {}).update(values or {})
    flags = {"engine": {"model": args.model, "spec_mode": args.spec_mode, "dtype": args.dtype,
                        "device": args.device, "tp_size": args.tp_size,
                        "load_format": args.load_format},
             "server": {"served_model_name": args.served_model_name, "api_key": args.api_key}}
    for section, values in flags.items():
        app_args[section].update({k: v for k, v in values.items() if v is not None})
    http.update({k: v for k, v in {"host": args.host, "port": args.port}.items()
                 if v is not None})
    return app_args, http


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from .serving.settings import AppArgs

    app_args, http = _serve_args(args)
    try:
        parsed = AppArgs.model_validate(app_args)
    except ValidationError as exc:
        print(f"invalid server configuration:\n{exc}", file=sys.stderr)
        return 2
    if args.ray:
        from ray import serve

        from .serving.deployment import build_app

        serve.start(http_options=http)
        serve.run(build_app(parsed.model_dump(mode="json")), name="aspire", route_prefix="/",
                  blocking=True)
        return 0
    import uvicorn

    from .serving.app import build_server

    app, engine = build_server(parsed)
    try:
        uvicorn.run(app, host=http["host"], port=int(http["port"]), log_level="info")
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aspire-ray")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print one completion")
    gen.add_argument("--model", default="smollm2-135m-instruct")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--spec-mode", choices=SPEC_MODES, default="aspire")
    gen.add_argument("--dtype", default="float32")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--tp-size", type=int, default=1)
    gen.add_argument("--load-format", default="auto")
    gen.add_argument("-v", "--verbose", action="store_true")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    srv.add_argument("--config", help="a Serve YAML (serve_configs/*.yaml); flags override it")
    srv.add_argument("--model", default=None)
    srv.add_argument("--spec-mode", choices=SPEC_MODES, default=None)
    srv.add_argument("--dtype", default=None)
    srv.add_argument("--device", default=None)
    srv.add_argument("--tp-size", type=int, default=None)
    srv.add_argument("--load-format", default=None)
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=None, help="default 8000")
    srv.add_argument("--ray", action="store_true",
                     help="run under Ray Serve (default: uvicorn in this process)")
    srv.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
