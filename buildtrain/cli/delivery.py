"""The commands that use a built plan's weights: `bt export` (copy its package out, signed on
request), `bt eval` (one suite, ad hoc) and `bt sample` (generate text). Each names its plan as
`bt run` does (`commands.one_plan`) and calls one executor entry point."""

from __future__ import annotations

import argparse
from pathlib import Path

from buildtrain.cli.commands import one_plan
from buildtrain.cli.common import err, store_of
from buildtrain.errors import ExitCode, UsageError


def cmd_export(args: argparse.Namespace) -> int:
    from buildtrain.executor.adhoc.deliver import export_plan, sign_package

    store = store_of(args)
    destination = export_plan(store, one_plan(args, store), Path(args.dest) if args.dest else None)
    print(destination)
    if args.sign:
        signature = sign_package(destination, Path(args.sign))
        err(
            f"bt export: signed in the OpenSSF model-signing format: {signature} (check it with: "
            f"model_signing verify key {destination} --signature {signature} --public_key PUBLIC.pem)"
        )
    return ExitCode.OK


def _prompt(text: str) -> str:
    """The prompt as given, refused when the command line did not hold UTF-8 text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        byte = ord(text[exc.start]) & 0xFF
        raise UsageError(
            f"--prompt is not UTF-8 text (byte 0x{byte:02x} at position {exc.start}); give the prompt in UTF-8"
        ) from None
    return text


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from buildtrain.executor.adhoc.score import evaluate

    store = store_of(args)
    done = evaluate(store, one_plan(args, store), args.suite, args.subset, args.update)
    print(
        json.dumps(
            {
                "suite": done.suite,
                "weights": done.weights,
                "cached": done.cached,
                "key": done.key,
                "result": done.result,
            },
            sort_keys=True,
        )
    )
    how = "found in the store, no model loaded" if done.cached else "computed and stored"
    err(f"bt eval: {done.suite} on the {done.weights} weights: {how} (evals/{done.key[:12]}…)")
    return ExitCode.OK


def cmd_sample(args: argparse.Namespace) -> int:
    from buildtrain.executor.adhoc.deliver import sample_text

    store = store_of(args)
    result = sample_text(
        store,
        one_plan(args, store),
        prompt=_prompt(args.prompt),
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k or 0,
        seed=args.seed,
    )
    print(args.prompt + result.text, flush=True)
    if result.stop == "end of document":
        err(f"bt sample: stopped at an end-of-document token after {result.tokens} of {args.tokens} tokens")
    elif result.stop == "context":
        err(
            f"bt sample: stopped at the model's context of {result.context} tokens "
            f"({result.prompt_tokens} of prompt, {result.tokens} generated; --tokens asked for {args.tokens})"
        )
    return ExitCode.OK
