"""What a person sees on the terminal during `bt run` (stderr): one line per step, and while a
train step runs a progress bar with loss and tokens/s (or, off a terminal, a line every N steps).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Reporter:
    """`quiet` (`bt run -q`): only `result` lines; `plan`: a label put before every line, where
    several plans run at once and their lines interleave (a sweep on Ray or Slurm)."""

    def __init__(
        self,
        progress: bool | None,
        log_every: int,
        stream: TextIO | None = None,
        *,
        quiet: bool = False,
        plan: str = "",
    ) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.progress_bar = not quiet and (self.stream.isatty() if progress is None else progress)
        self.log_every = log_every
        self.prefix = f"[{plan}] " if plan else ""
        self._progress: Any = None
        self._task: Any = None
        self._label = ""

    def say(self, text: str) -> None:
        if not self.quiet:
            self._write(text)

    def result(self, text: str) -> None:
        """What a run came to: said even when quiet."""
        self._write(text)

    def _write(self, text: str) -> None:
        text = self.prefix + text
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False)
        else:
            # One write per line: the steps (and plans) of a concurrent engine report from threads.
            self.stream.write(text + "\n")
            self.stream.flush()

    def step(self, label: str, status: str, detail: str = "") -> None:
        self.say(f"  {label:<16} {status}{'  ' + detail if detail else ''}")

    def progress_started(self, label: str) -> None:
        """A step that reports updates (a train step) runs: a progress bar on a terminal."""
        self._label = label
        if not self.progress_bar:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn(f"{self.prefix}  {label:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[speed]} tok/s"),
            TimeRemainingColumn(),
            # `--progress on` draws the bar whatever the stream is (a pipe to `tee`, a CI log
            # that renders ANSI); without forcing, rich draws nothing off a terminal.
            console=Console(file=self.stream, force_terminal=True),
            transient=True,
        )
        self._progress.start()
        self._task = self._progress.add_task(label, total=None, loss="-", speed="-")

    def event(self, line: dict[str, Any]) -> None:
        name = line.get("event")
        if name == "train_step":
            self._train_step(line)
        elif name == "resumed":
            self.step(self._label, f"resuming from checkpoint at step {line['step']}")
        elif name == "checkpoint_skipped":
            self.step(self._label, f"skipping damaged checkpoint {line['checkpoint']}: {line['reason']}")
        elif name == "eval":
            at = f" at step {line['step']}" if "step" in line else ""
            label = line.get("label", self._label)
            self.step(label, f"held-out loss {line['loss']:.4f}, {line['bits_per_token']:.4f} bits/token{at}")
        elif name == "source_found_elsewhere":
            planned = ", ".join(line["planned_at"]) or "an unknown place"
            self.step(
                line["label"],
                f"data file {line['blake3'][:16]}… is gone from {planned}; "
                f"reading the identical copy at {line['found_at']}",
            )
        elif name == "source_downloaded":
            self.step(
                line["label"], f"downloaded {line['url']} ({line['bytes']:,} bytes) into the source cache"
            )
        elif name == "step_crashed":
            self.say(line.get("traceback", ""))

    def _train_step(self, line: dict[str, Any]) -> None:
        step, steps = line["step"], line["steps"]
        if self._progress is not None:
            self._progress.update(
                self._task,
                completed=step,
                total=steps,
                loss=f"{line['loss']:.4f}",
                speed=f"{line['tokens_per_s']:,.0f}",
            )
        elif step % self.log_every == 0 or step == steps or step == 1:
            self.step(
                self._label,
                f"step {step}/{steps}  loss {line['loss']:.4f}  lr {line['lr']:.2e}  "
                f"grad {line['grad_norm']:.3f}  {line['tokens_per_s']:,.0f} tok/s",
            )

    def progress_finished(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
