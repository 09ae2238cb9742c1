"""Command line: ``aspire-ray generate --prompt ...`` prints a completion."""

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
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
