"""How a task module writes its rows: JSON lines (and parquet) in a fixed column order, from its command line.

Each `python -m slime_meta.data.tasks.<name>` builds its flags on `task_parser` and hands a row
generator to `write_task`, which writes the file(s) and prints one line for each; a bad flag value
(a `UserInputError` from the generator) exits 2 with one `error: ...` line and writes nothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from slime_meta.errors import UserInputError

Rows = Sequence[dict[str, Any]]


def jsonl_text(rows: Rows, columns: Sequence[str]) -> str:
    """The rows as JSON lines with the columns in a fixed order: the same rows give the same bytes."""
    return "".join(json.dumps({key: row[key] for key in columns}, ensure_ascii=False) + "\n" for row in rows)


def write_jsonl(rows: Rows, path: str | Path, columns: Sequence[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(jsonl_text(rows, columns), encoding="utf-8")
    return path


def write_parquet(rows: Rows, path: str | Path, columns: Sequence[str]) -> Path:
    """The rows as parquet through pyarrow directly (no pandas index column in the file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({key: [row[key] for row in rows] for key in columns})
    pq.write_table(table, path)
    return path


def prompts_of(path: str | Path, key: str = "prompt") -> set[str]:
    """The prompts of a JSON-lines task file; a missing or malformed one is one UserInputError line."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"{path}: no such file; give a JSON-lines task file")
    prompts = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.add(json.loads(line)[key])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserInputError(f"{path}, row {number}: not a JSON object with a {key!r} field") from None
    return prompts


def task_parser(
    name: str, description: str, out: str | None = None, seed: bool = True, parquet: bool = False
) -> argparse.ArgumentParser:
    """The flags every task writer shares: `--out` (required where it has no default), `--seed`, `--parquet`."""
    parser = argparse.ArgumentParser(prog=f"python -m slime_meta.data.tasks.{name}", description=description)
    parser.add_argument("--out", default=out, required=out is None, help="JSON-lines file to write")
    if parquet:
        parser.add_argument("--parquet", default=None, help="also write the rows to this parquet file")
    if seed:
        parser.add_argument("--seed", type=int, default=0, help="draw seed: another seed gives other problems")
    return parser


def add_family_flags(
    parser: argparse.ArgumentParser, names: Iterable[str], family: str = "family", families: str = "families"
) -> None:
    """`--n` problems of each family (40) and `--families` (default: all of `names`), in the task's own word."""
    parser.add_argument("--n", type=int, default=40, help=f"problems per {family} (default: 40)")
    parser.add_argument("--families", nargs="+", default=None, help=f"{families} (default: all: {', '.join(names)})")


def write_task(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    generate: Callable[[argparse.Namespace], Rows],
    columns: Sequence[str],
    group: str,
) -> None:
    """Parse the flags, generate the rows and write them to `--out` (and `--parquet` where the parser has it)."""
    args = parser.parse_args(argv)
    try:
        rows = generate(args)
    except UserInputError as error:
        parser.exit(2, f"error: {error}\n")
    written = [write_jsonl(rows, args.out, columns)]
    if getattr(args, "parquet", None):
        written.append(write_parquet(rows, args.parquet, columns))
    groups = len({row[group] for row in rows})
    for path in written:
        print(f"wrote {len(rows)} problems to {path}; distinct {group} values: {groups}")
