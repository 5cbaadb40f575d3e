"""The `bt` argument parser: every command, its options and the help that teaches them."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable

from buildtrain import __version__
from buildtrain.cli import commands, delivery, queries, team, trust, upkeep
from buildtrain.cli.arguments import (
    add_executor,
    add_world_size,
    fraction,
    output_file,
    positive,
    seed,
    temperature,
    thread_count,
)
from buildtrain.errors import ExitCode

EPILOG = """\
exit codes:
  0  success                      4  not reproduced (bt verify found a difference)
  1  a step failed (NaN, OOM)     5  corrupt object in the store (bt fsck)
  2  usage or preset error        6  plan compiled for another toolchain or machine
  3  interrupted, resumable       7  step locked by another bt (with --no-wait)
                                  8  --executor cannot run a step (not installed, unreachable, too small)
  (bt push: 4 when the remote holds a different result: non-determinism; bt pull: 4 when a step
   has fewer trusted signers than --min-attestations, 5 when the remote's copy is damaged)

examples:
  bt run $(bt plan presets/tiny.toml)
  bt plan presets/tiny.toml --set train.lr=3e-4 --set model.n_layers=6
  bt diff 3fa9c1 8e02d4
  bt verify 3fa9c1 --resume-at 50,120
  bt run 3fa9c1 --nproc 2                   (train on 2 processes through torchrun)
  bt verify 3fa9c1 --nproc 2                (re-execute at another world size and compare)
  bt run 3fa9c1 --remote s3://team/bt       (pull what a colleague built, push what is built here)
"""


PLAN_OR_PRESET = "plan hash or prefix, or a preset path (planned first, as bt run does)"


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line like every other error of bt (no usage block)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(ExitCode.USAGE, f"{self.prog}: {message}; see {self.prog} --help\n")


# Adds one command's subparser (with --store) and returns it; each _add_NAME fills in its arguments.
Command = Callable[[str, str, str], argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="bt",
        description="buildtrain: compile training presets into content-hashed plans and run them "
        "reproducibly. Identical plan hashes reproduce identical weights, bit for bit.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--store", metavar="DIR", help="store directory (default: $BT_STORE or ./.bt)")
    parser.add_argument("--version", action="version", version=f"bt (buildtrain) {__version__}")
    subcommands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, help_text: str, description: str) -> argparse.ArgumentParser:
        sub = subcommands.add_parser(
            name,
            help=help_text,
            description=description,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument(
            "--store",
            metavar="DIR",
            default=argparse.SUPPRESS,
            help="store directory (default: $BT_STORE or ./.bt)",
        )
        return sub

    _add_plan(command)
    _add_run(command)
    _add_verify(command)
    _add_fsck(command)
    _add_show(command)
    _add_why(command)
    _add_diff(command)
    _add_ls(command)
    _add_report(command)
    _add_sample(command)
    _add_eval(command)
    _add_gc(command)
    _add_export(command)
    _add_push(command)
    _add_pull(command)
    _add_keys(command)
    return parser


REMOTE_HELP = (
    "a team cache: s3://bucket/prefix (credentials and endpoint from AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL) or file:///shared/folder "
    "(default: $BT_REMOTE); never part of any hash"
)


def _add_remote(
    sub: argparse.ArgumentParser, help_text: str = REMOTE_HELP, *, optional: bool = False
) -> None:
    """--remote URL; `optional`: the URL may be left out (`bt ls --remote` then uses $BT_REMOTE)."""
    if optional:
        sub.add_argument("--remote", nargs="?", const="", metavar="URL", help=help_text)
    else:
        sub.add_argument("--remote", metavar="URL", help=help_text)


def _add_min_attestations(sub: argparse.ArgumentParser, otherwise: str) -> None:
    sub.add_argument(
        "--min-attestations",
        type=positive,
        metavar="N",
        help="pull a step only when at least N distinct keys of your keyring (bt keys) signed an "
        "attestation of exactly the remote's output (default: $BT_MIN_ATTESTATIONS, else 0); unsigned "
        f"or untrusted records count 0; {otherwise}",
    )


def _add_push(command: Command) -> None:
    sub = command(
        "push",
        "upload built steps of plans to a remote (team cache)",
        "Upload every built step of each PLAN, and the plan itself, to the remote: each file once "
        "(by its blake3), the step's manifest last, so a reader never sees half a step. A step the "
        "remote already holds with the same digests uploads nothing; one it holds with different "
        "digests is non-determinism: reported, never overwritten (exit 4). Where the remote lacked "
        "a step's result, the push adds this build's signed attestation (bt show PLAN --remote "
        "counts distinct trusted keys; a step pulled from the remote is not one more build of it).",
    )
    sub.add_argument("plans", nargs="+", metavar="PLAN", help="plans as bt run takes them")
    _add_remote(sub)
    sub.set_defaults(func=team.cmd_push)


def _add_pull(command: Command) -> None:
    sub = command(
        "pull",
        "download the steps of plans from a remote (team cache)",
        "Download every step of each PLAN that this store lacks from the remote. Every byte is "
        "checked against its blake3 and the manifest against the step hash it was found under "
        "before anything is kept; a damaged, missing or foreign object is named and nothing of it "
        "is kept (exit 5). A full plan hash this store does not know is fetched from the remote "
        "first. Exit 1 when a step is not on the remote (bt run builds it).",
    )
    sub.add_argument(
        "plans",
        nargs="+",
        metavar="PLAN",
        help="plans as bt run takes them, or a full hash from bt ls --remote",
    )
    _add_min_attestations(sub, "else exit 4")
    _add_remote(sub)
    sub.set_defaults(func=team.cmd_pull)


def _add_plan(command: Command) -> None:
    sub = command(
        "plan",
        "compile a preset into a stored plan; print its hash",
        "Compile PRESET (and any --set overrides) into a content-hashed plan and store it. stdout is "
        "the 64-hex plan hash and nothing else, so `bt run $(bt plan PRESET)` composes; a summary of "
        "the steps (cached or to run) goes to stderr. Problems in the preset are all listed, one per "
        "line, as FILE: KEY: MESSAGE, with exit code 2.",
    )
    sub.add_argument("preset", help="a preset TOML file")
    sub.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key with a TOML value, e.g. train.lr=3e-4 or stages.finetune.train.steps=50 (repeatable)",
    )
    sub.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="compile one plan per point of the grid of these axes (repeatable: the product), e.g. "
        "train.lr=1e-3,3e-3; prints one hash per line; a preset's [sweep] table declares axes too",
    )
    sub.add_argument("-q", "--quiet", action="store_true", help="print only the hash")
    add_executor(sub, planning=True)
    add_world_size(sub, rendezvous=False)
    sub.set_defaults(func=commands.cmd_plan)


def _add_run(command: Command) -> None:
    sub = command(
        "run",
        "execute a plan (or plan and execute a preset)",
        "Execute the steps of PLAN (a hash, a unique prefix, or a preset path) in order: data, train "
        "stage(s), eval, export. Steps already in the store are cache hits. An interrupted step "
        "resumes from its newest valid checkpoint, bit for bit. Ctrl-C finishes the current optimizer "
        "step, checkpoints and exits with code 3. Every run writes a record to experiments/.",
    )
    sub.add_argument(
        "plan",
        nargs="+",
        help="plan hashes or prefixes, preset paths (every point of a preset's sweep), a stored sweep's "
        "hash, a sweep file (one plan hash per line, as bt plan --sweep prints), or - for that on stdin; "
        "steps the plans share are built once",
    )
    sub.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="overrides, when PLAN is a preset"
    )
    sub.add_argument(
        "--sweep", action="append", default=[], metavar="KEY=V1,V2", help="sweep axes, when PLAN is a preset"
    )
    sub.add_argument(
        "--threads",
        type=thread_count,
        help="cores to compute with (default: the preset's numerics.threads, or all, shared among "
        "--nproc processes); a portable plan computes with one thread per process and runs a large "
        "train step on several, a native plan runs the thread count its hash pins",
    )
    sub.add_argument(
        "--experiments",
        metavar="DIR",
        help="where run records go (default: $BT_EXPERIMENTS or ./experiments)",
    )
    sub.add_argument(
        "--no-wait",
        action="store_true",
        help="exit with code 7 instead of waiting when another bt builds a step",
    )
    sub.add_argument(
        "--target", metavar="LABEL", help="build only this step and what it needs, e.g. train:main"
    )
    sub.add_argument(
        "--progress",
        choices=("auto", "on", "off"),
        default="auto",
        help="progress bar (default: on a terminal)",
    )
    sub.add_argument(
        "--log-every",
        type=positive,
        default=10,
        metavar="N",
        help="log a training line every N steps (default 10)",
    )
    sub.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="say only what each run came to (its 'done' line, a sweep's summary); errors still on stderr",
    )
    _add_remote(
        sub,
        "a team cache (default: $BT_REMOTE): a step not in this store is pulled from it when it is "
        "there (every byte checked), else built here while holding its lease on the remote and "
        "then pushed; s3://bucket/prefix (AWS_* variables) or file:///shared/folder; never part of any hash",
    )
    _add_min_attestations(sub, "a step with fewer is built here instead")
    add_executor(sub)
    add_world_size(sub, rendezvous=True)
    sub.set_defaults(func=commands.cmd_run)


def _add_verify(command: Command) -> None:
    sub = command(
        "verify",
        "re-execute a plan from scratch and compare bit for bit",
        "Re-execute every step of PLAN in a scratch store, each in a fresh process, and compare each "
        "output with the recorded one by canonical tensor digests. On a difference, name the first "
        "training step that diverged and the tensors that differ. An unbuilt plan is built, then "
        "checked against a second independent execution. Exit 0: reproduced; 4: not reproduced, or "
        "a comparison could not be made (verify fails closed); 5: a recorded output is damaged or "
        "belongs to another step.",
    )
    sub.add_argument("plan", help=PLAN_OR_PRESET)
    sub.add_argument(
        "--resume-at", metavar="N[,M]", help="hard-kill the re-execution after these steps and resume"
    )
    sub.add_argument(
        "--threads",
        type=thread_count,
        help="re-execute with this many cores (portable plans; see bt run --help)",
    )
    sub.add_argument(
        "--steps", type=positive, metavar="N", help="spot check: only the first N steps of each train stage"
    )
    sub.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    sub.add_argument("--keep-scratch", action="store_true", help="keep the scratch store for inspection")
    sub.add_argument(
        "--experiments",
        metavar="DIR",
        help="where the record of a first build goes (default: $BT_EXPERIMENTS or ./experiments)",
    )
    sub.add_argument(
        "--push",
        action="store_true",
        help="attest each step it reproduced on the remote (--remote or $BT_REMOTE): one more "
        "independent build that agrees, which bt pull --min-attestations counts",
    )
    _add_remote(sub)
    add_world_size(sub, rendezvous=False)
    sub.set_defaults(func=commands.cmd_verify)


def _add_fsck(command: Command) -> None:
    sub = command(
        "fsck",
        "re-hash every object in the store",
        "Re-hash every plan, step output, checkpoint and evaluation result in the store (and "
        "check its stamps, locks and stat cache) and report each damaged one with the plans and "
        "steps that reference it (exit 5). --repair moves them to quarantine/ (exit 0 when every "
        "one was moved); bt run then rebuilds what a plan needs.",
    )
    sub.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    sub.add_argument(
        "--repair", action="store_true", help="move every damaged object to quarantine/ (caches are removed)"
    )
    sub.set_defaults(func=upkeep.cmd_fsck)


def _add_show(command: Command) -> None:
    sub = command(
        "show",
        "show a plan: config, steps, hashes, inputs",
        "Show the resolved config of PLAN and its steps with their hashes, inputs and status.",
    )
    sub.add_argument("plan", help="plan hash or prefix")
    sub.add_argument("--json", action="store_true", help="machine-readable")
    sub.add_argument(
        "--lineage",
        action="store_true",
        help="for each output, the chain of steps, inputs and toolchain that produced it, down to the "
        "source files' digests",
    )
    _add_remote(
        sub,
        "per step: whether the remote (URL, or $BT_REMOTE when left out) holds it and how many "
        "recorded independent builds agree with it; disagreeing builds are named (non-determinism)",
        optional=True,
    )
    sub.set_defaults(func=queries.cmd_show)


def _add_why(command: Command) -> None:
    sub = command(
        "why",
        "which plan and step produced these weights",
        "Find the stored step outputs that hold a file with this blake3 digest (any line of an "
        "export's BLAKE3SUMS) or declare it, and name the plans and steps that produced them. "
        "DIGEST may be a unique prefix of at least 8 hex digits, an export folder or its BLAKE3SUMS "
        "file (its model.safetensors line). Exit 2 when nothing in the store holds it.",
    )
    sub.add_argument(
        "digest", metavar="DIGEST", help="a blake3 digest or prefix, an export folder, a BLAKE3SUMS file"
    )
    sub.add_argument("--json", action="store_true", help="machine-readable")
    sub.set_defaults(func=queries.cmd_why)


def _add_diff(command: Command) -> None:
    sub = command(
        "diff",
        "which keys differ between two plans and which steps that invalidates",
        "Compare two plans: the config keys that differ, and for each step whether it is reused "
        "from the store or invalidated, and why.",
    )
    sub.add_argument("plan_a", help="plan hash or prefix, or a preset (planned first, as bt run does)")
    sub.add_argument("plan_b", help="plan hash or prefix, or a preset")
    sub.add_argument("--json", action="store_true", help="machine-readable")
    sub.set_defaults(func=queries.cmd_diff)


def _add_ls(command: Command) -> None:
    sub = command(
        "ls",
        "list stored plans (with --metrics: their results)",
        "List stored plans with name, creation time, steps and build status. With --metrics: per "
        "plan, the config values that differ between the listed plans, final train loss, held-out "
        "loss and bits per token, tokens/s, wall time and build status.",
    )
    sub.add_argument(
        "plans",
        nargs="*",
        metavar="PLAN",
        help="list only these: plan hashes or prefixes, stored sweeps, sweep files or presets, as "
        "bt run takes them (default: every stored plan)",
    )
    sub.add_argument("--name", metavar="GLOB", help="list only plans whose name matches, e.g. 'micro*'")
    sub.add_argument("--json", action="store_true", help="machine-readable")
    sub.add_argument(
        "--metrics",
        action="store_true",
        help="a results table (never imports torch), fitted to $COLUMNS or the terminal: config keys "
        "by short names, then columns left out (said on stderr); a pipe gets every column",
    )
    sub.add_argument(
        "--sort",
        metavar="COLUMN",
        help="sort the results table by a column (train_loss, heldout_loss, bits_per_token, "
        "tokens_per_s, wall_s, name, created, or a differing key such as train.lr); --sort=-COLUMN: descending",
    )
    _add_remote(
        sub, "list the plans a remote holds instead (URL, or $BT_REMOTE when left out)", optional=True
    )
    sub.set_defaults(func=queries.cmd_ls)


def _add_report(command: Command) -> None:
    sub = command(
        "report",
        "an HTML page with curves, results and cache hits of plans",
        "Write one self-contained HTML page (inline SVG, no script, no network) that overlays the "
        "training-loss and learning-rate curves of PLANs (default: every stored plan), their "
        "held-out evaluations, the results table of bt ls --metrics and each plan's steps with the "
        "cache hits of its last run. --png DIR also writes the figures as PNG for papers.",
    )
    sub.add_argument("plans", nargs="*", metavar="PLAN", help="plan hashes or prefixes (default: all)")
    sub.add_argument(
        "-o", "--output", default="report.html", type=output_file, metavar="FILE", help="default report.html"
    )
    sub.add_argument("--png", metavar="DIR", help="also write loss.png, lr.png and heldout.png here")
    sub.add_argument(
        "--experiments", metavar="DIR", help="run records to read (default: $BT_EXPERIMENTS or ./experiments)"
    )
    sub.set_defaults(func=queries.cmd_report)


def _add_sample(command: Command) -> None:
    sub = command(
        "sample",
        "generate text from a built plan's exported weights",
        "Generate text after PROMPT from the export of a built PLAN, with a key/value cache. The same "
        "--seed gives the same text; --temperature 0 is greedy and gives the text transformers' greedy "
        "generate gives from the hf/ export.",
    )
    sub.add_argument("plan", help=PLAN_OR_PRESET)
    sub.add_argument(
        "--prompt",
        default="",
        metavar="TEXT",
        help="text to continue, encoded as the exported tokenizer encodes it (default: none: start "
        "from the end-of-document token); at most the model's context less one token",
    )
    sub.add_argument(
        "--tokens",
        type=positive,
        default=64,
        metavar="N",
        help="tokens to generate (default 64); generation also stops at an end-of-document token "
        "and at the model's context (the training sequence length), and says so on stderr",
    )
    sub.add_argument(
        "--temperature",
        type=temperature,
        default=0.8,
        metavar="T",
        help="default 0.8; 0: greedy; else 0.001..1000",
    )
    sub.add_argument(
        "--top-k",
        type=positive,
        default=None,
        metavar="K",
        help="draw from the K likeliest tokens (default: all)",
    )
    sub.add_argument(
        "--seed", type=seed, default=0, metavar="S", help="seed of the draws, 0..2**64-1 (default 0)"
    )
    sub.set_defaults(func=delivery.cmd_sample)


def _add_eval(command: Command) -> None:
    sub = command(
        "eval",
        "score a built plan's weights on one of its suites, ad hoc",
        "Score the final weights of a built PLAN (or a kept checkpoint's, --update N) on one of the "
        "suites its [eval] suites lists. The result is stored in the store's evaluation cache like "
        "the eval step's, under (suite, version, weights, file, subset, seed): asked again, or by a "
        "plan, it is found there and no model is loaded. Prints the result as JSON on stdout.",
    )
    sub.add_argument("plan", help=PLAN_OR_PRESET)
    sub.add_argument(
        "--suite", required=True, metavar="NAME[@VERSION]", help="a suite of the plan's [eval] suites"
    )
    sub.add_argument(
        "--subset",
        type=fraction,
        default=None,
        metavar="F",
        help="score this share of its questions (default: the plan's eval.subset)",
    )
    sub.add_argument(
        "--update",
        type=positive,
        default=None,
        metavar="N",
        help="the weights of the kept checkpoint of update N (default: the final weights)",
    )
    sub.set_defaults(func=delivery.cmd_eval)


def _add_gc(command: Command) -> None:
    sub = command(
        "gc",
        "remove what no plan needs",
        "Remove step outputs no stored plan references, leftover temporary and work folders of "
        "completed steps, quarantined outputs and unreferenced evaluation results.",
    )
    sub.add_argument(
        "--drop", action="append", default=[], metavar="PLAN", help="forget this plan first (repeatable)"
    )
    sub.add_argument("--dry-run", action="store_true", help="list what would be removed")
    group = sub.add_argument_group(
        "run records",
        "bt gc --records prunes run records instead of the store: the records of null builds "
        "(nothing executed) except each plan's newest; --keep N also removes each plan's records "
        "past its N newest. Records of runs that executed, failed or were interrupted stay unless "
        "--keep says otherwise; a run still going and any folder that is not a run record are never touched.",
    )
    group.add_argument("--records", action="store_true", help="prune run records, not the store")
    group.add_argument(
        "--keep", type=positive, metavar="N", help="keep each plan's N newest records (implies --records)"
    )
    group.add_argument(
        "--experiments",
        metavar="DIR",
        help="where run records are (default: $BT_EXPERIMENTS or ./experiments)",
    )
    sub.set_defaults(func=upkeep.cmd_gc)


def _add_export(command: Command) -> None:
    sub = command(
        "export",
        "copy a built plan's export package out of the store",
        "Copy the export package of a built PLAN (weights, config, tokenizer description, "
        "checksums) to DEST (default ./export/NAME-HASH), read-only.",
    )
    sub.add_argument("plan", help=PLAN_OR_PRESET)
    sub.add_argument("dest", nargs="?", help="destination directory (must not exist)")
    sub.add_argument(
        "--sign",
        metavar="KEY",
        help="sign the package in the OpenSSF model-signing format with this elliptic-curve private "
        "key (PEM), offline; the signature goes to DEST.sig (needs pip install 'buildtrain[sign]')",
    )
    sub.set_defaults(func=delivery.cmd_export)


def _add_keys(command: Command) -> None:
    sub = command(
        "keys",
        "this builder's signing key and the builders you trust",
        "Attestations are signed: each push or verify --push that attests signs an in-toto "
        "statement with this builder's Ed25519 key ($BT_KEYS, else $XDG_CONFIG_HOME/buildtrain/keys, "
        "else ~/.config/buildtrain/keys; made on first use). bt pull --min-attestations and bt show "
        "--remote count distinct keys of your keyring whose signature verifies, never records.",
    )
    actions = sub.add_subparsers(dest="action", metavar="ACTION", required=True)
    actions.add_parser("generate", help="make this builder's key (mode 0600) and trust it as 'self'")
    actions.add_parser("export", help="print this builder's public key (PEM) to give to teammates")
    actions.add_parser("ls", help="list the trusted keys: KEYID  NAME")
    trusted = actions.add_parser("trust", help="trust a builder's public key")
    trusted.add_argument("key", metavar="FILE|PUBKEY", help="a PEM file from bt keys export, '-', or the PEM")
    trusted.add_argument("--name", required=True, help="what to call this builder (letters, digits, . _ -)")
    untrusted = actions.add_parser("untrust", help="remove a key from the keyring")
    untrusted.add_argument("name", help="the name it was trusted under")
    sub.set_defaults(func=trust.cmd_keys)
