"""Scaling of the planner: `bt plan` time and store size against the number of training stages and
the number of data files (planning only, nothing is run).

Stages: a preset (written into the temporary directory) extending presets/tiny.toml with N
[[stages]] chained by init_from (stage i starts from stage i-1), N = 1, 10, 100.
Files: a preset extending presets/tiny.toml with data.source = "files" and a glob over N small
generated text files (about 1 kB each), N = 10, 1,000, 10,000 (--quick: up to 1,000).

For each N, alternated with the other N, each in a fresh process: the first plan into an empty
store (for files: every file hashed) and a second plan into the same store (plan already stored;
for files: the stat cache answers). Reported: medians, growth against the smallest N, and the
store's size after the first plan (plans, plan metadata, stat cache).

Run: python benchmarks/scale.py [--quick]
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.dont_write_bytecode = True  # no benchmarks/__pycache__ in the repository
from common import (  # noqa: E402
    TINY,
    Workspace,
    age_files,
    alternate,
    fmt_bytes,
    fmt_ratio,
    fmt_seconds,
    fmt_spread,
    make_parser,
    median,
    note,
    print_header,
    print_table,
    rounds,
    tree_size,
    workspace,
)


def stages_preset(space: Workspace, count: int) -> Path:
    lines = [f'name = "scale-{count}-stages"', f"extends = {json.dumps(str(TINY))}", ""]
    for index in range(count):
        lines += ["[[stages]]", f'name = "s{index}"']
        if index:
            lines.append(f'init_from = "s{index - 1}"')
        lines.append("")
    path = space.path(f"stages-{count}.toml")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def files_preset(space: Workspace, count: int) -> Path:
    folder = space.path(f"files-{count}")
    folder.mkdir()
    paths = []
    for index in range(count):
        path = folder / f"doc-{index:05d}.txt"
        path.write_text("".join(f"{index}+{j}={index + j}\n" for j in range(100))[:1000], encoding="ascii")
        paths.append(path)
    age_files(paths)
    preset = space.path(f"files-{count}.toml")
    pattern = json.dumps(str(folder / "*.txt"))
    preset.write_text(
        f'name = "scale-{count}-files"\nextends = {json.dumps(str(TINY))}\n\n'
        f'[data]\nsource = "files"\nfiles = [{pattern}]\n',
        encoding="utf-8",
    )
    return preset


def measure(space: Workspace, kind: str, presets: dict[int, Path], n: int) -> None:
    sizes: dict[int, tuple[int, int]] = {}
    stores: dict[int, Path] = {}
    counter = iter(range(1_000_000))

    def first(count: int) -> float:
        store = space.path(f"store-{kind}-{count}-{next(counter)}")
        if count in stores:
            shutil.rmtree(stores[count], ignore_errors=True)
        stores[count] = store
        seconds = space.run_bt("plan", "-q", str(presets[count]), store=store)[0]
        sizes[count] = tree_size(store)
        return seconds

    def second(count: int) -> float:
        return space.run_bt("plan", "-q", str(presets[count]), store=stores[count])[0]

    contenders = []
    for count in presets:
        contenders.append((f"{count} {kind}: first plan", lambda c=count: first(c)))
        contenders.append((f"{count} {kind}: second plan", lambda c=count: second(c)))
    note(f"{kind}: {n} alternating rounds over N = {', '.join(map(str, presets))}")
    results = alternate(contenders, n)
    smallest = min(presets)
    rows = []
    for count in presets:
        one, two = results[f"{count} {kind}: first plan"], results[f"{count} {kind}: second plan"]
        size, files = sizes[count]
        rows.append(
            [
                f"{count:,}",
                fmt_seconds(median(one)),
                fmt_spread(one),
                fmt_ratio(median(one) / median(results[f"{smallest} {kind}: first plan"])),
                fmt_seconds(median(two)),
                fmt_spread(two),
                fmt_ratio(median(two) / median(results[f"{smallest} {kind}: second plan"])),
                f"{fmt_bytes(size)} in {files} files",
            ]
        )
    print_table(
        f"bt plan with N {kind} (median of {n}, alternated; growth against N = {smallest})",
        [
            "N",
            "first plan",
            "min..max",
            "growth",
            "second plan",
            "min..max",
            "growth",
            "store after first plan",
        ],
        rows,
    )


def main() -> int:
    parser = make_parser(__doc__)
    args = parser.parse_args()
    n = rounds(args, quick=3, full=5)
    stage_counts = (1, 10, 100)
    file_counts = (10, 1_000) if args.quick else (10, 1_000, 10_000)

    with workspace("scale", args) as space:
        print_header("planner scaling: stages and data files", args, space)
        measure(space, "stages", {count: stages_preset(space, count) for count in stage_counts}, n)
        note("generating data files")
        measure(space, "files", {count: files_preset(space, count) for count in file_counts}, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
