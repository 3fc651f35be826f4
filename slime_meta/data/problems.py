"""Loading problems from a file and drawing reproducible episodes from them.

Why this module is strict: a bad row found mid-run costs a GPU job, so every problem with the
data is found at load time and reported as one `UserInputError` line that names the file, the
row, the field and the flag that fixes it. Why the sampler keeps a cursor instead of a
generator: training resumes from checkpoints, and a resumed run must draw exactly the batches
the uninterrupted run would have drawn (`state_dict` / `load_state_dict`).

Row numbers in messages: `.jsonl` rows are named by their 1-based line number (what an editor
shows); `.parquet` and `.json` rows by their 0-based index (what pandas shows).

Labels: a string, a number (kept as its string) or a dict such as {"answer": "x = 2"} (kept as
the dict; `Problem.ground_truth` gives its text). Parquet columns cannot mix dicts and strings,
so a string label that is a JSON object (`'{"answer": "x = 2"}'`) is decoded into the dict; the
sample data's parquet copy stores its labels that way.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import unicodedata
from pathlib import Path
from typing import Any, Sequence

from slime_meta.errors import UserInputError
from slime_meta.types import Episode, Problem, label_text

SUPPORTED_EXTENSIONS = (".parquet", ".jsonl", ".json")
MESSAGES_COLUMN = "messages"


# --------------------------------------------------------------------------- reading rows


def _read_jsonl(path: Path) -> tuple[list[dict], list[str]]:
    """Rows and their names ("line 7"). Parsed line by line so a bad line is named exactly."""
    rows, names = [], []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue  # blank lines (often a trailing one) are not rows
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserInputError(
                    f"{path}: line {line_number} is not valid JSON ({exc.msg} at column {exc.colno}); "
                    "each line of a .jsonl file must be one JSON object"
                )
            if not isinstance(row, dict):
                raise UserInputError(
                    f"{path}: line {line_number} is a JSON {type(row).__name__}, not an object; "
                    "each line of a .jsonl file must be one JSON object"
                )
            rows.append(row)
            names.append(f"line {line_number}")
    return rows, names


def _read_json(path: Path) -> tuple[list[dict], list[str]]:
    """A list of objects, or anything pandas reads as records (e.g. column-oriented JSON)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserInputError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
            "for one object per line name the file .jsonl"
        )
    if isinstance(data, list):
        for index, row in enumerate(data):
            if not isinstance(row, dict):
                raise UserInputError(
                    f"{path}: row {index} (0-based) is a JSON {type(row).__name__}, not an object; "
                    "use a list of objects with one object per problem"
                )
        return data, [f"row {i} (0-based)" for i in range(len(data))]
    import pandas as pd  # lazy: pandas is slow to import and only needed here

    try:
        frame = pd.read_json(path)
    except ValueError as exc:
        raise UserInputError(f"{path}: pandas cannot read it as a table ({exc}); use a list of objects")
    rows = [{key: _none_if_nan(value) for key, value in row.items()} for row in frame.to_dict("records")]
    return rows, [f"row {i} (0-based)" for i in range(len(rows))]


def _read_parquet(path: Path) -> tuple[list[dict], list[str]]:
    # pyarrow's to_pylist gives plain Python values (lists, dicts, None); going through a pandas
    # frame would turn chat lists into numpy arrays and nulls into NaN.
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several unrelated types for a corrupt file
        raise UserInputError(f"{path}: cannot read it as parquet ({type(exc).__name__}: {exc})")
    return rows, [f"row {i} (0-based)" for i in range(len(rows))]


def _none_if_nan(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def _is_missing(value: Any) -> bool:
    return value is None or _none_if_nan(value) is None or (isinstance(value, str) and not value.strip())


# --------------------------------------------------------------------------- fields


def _text_from_messages(messages: Any, where: str, field_name: str) -> str:
    """The user turns of a chat list, joined by a blank line."""
    if isinstance(messages, str) and messages.lstrip().startswith("["):
        try:  # a chat list stored as a JSON string (some parquet writers do this)
            messages = json.loads(messages)
        except json.JSONDecodeError:
            pass
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "content" in m for m in messages):
        raise UserInputError(
            f'{where}: field \'{field_name}\' must be a list of {{"role": ..., "content": ...}} objects '
            f"(got {type(messages).__name__}); fix the row or name a plain-text column with --input-key"
        )
    user_texts = []
    for message in messages:
        if message.get("role", "user") != "user":
            continue
        content = message["content"]
        if isinstance(content, list):  # OpenAI content parts: [{"type": "text", "text": ...}]
            content = "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
        if content is not None and str(content).strip():
            user_texts.append(str(content))
    return "\n\n".join(user_texts)


def _decode_label(value: Any) -> Any:
    if isinstance(value, str):
        stripped = value.strip()
        if stripped.startswith("{") and stripped.endswith("}"):
            try:
                decoded = json.loads(stripped)
            except json.JSONDecodeError:
                return value  # e.g. "{1, 2, 3}": a set written as an answer, not JSON
            if isinstance(decoded, dict) and decoded:
                return decoded
        return value
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # 12.0 from a float column is the label "12"
    if isinstance(value, (int, float)):
        return str(value)
    return value


def _missing_column(path: Path, column: str, what: str, flag: str, columns: Sequence[str]) -> UserInputError:
    available = ", ".join(columns) if columns else "(none)"
    return UserInputError(
        f"{path}: no '{column}' column for the {what}; available columns: {available}; name the right one with {flag}"
    )


def _read_rows(path: Path) -> tuple[list[dict], list[str]]:
    """The rows of a .parquet, .jsonl or .json file and their names; one-line errors otherwise."""
    if not path.is_file():
        raise UserInputError(f"{path}: no such file; check the --prompt-data path")
    extension = path.suffix.lower()
    readers = {".parquet": _read_parquet, ".jsonl": _read_jsonl, ".json": _read_json}
    if extension not in readers:
        raise UserInputError(f"{path}: unknown extension '{path.suffix}'; use .parquet, .jsonl or .json")
    try:
        rows, row_names = readers[extension](path)
    except UnicodeDecodeError as exc:
        raise UserInputError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); save the file as UTF-8")
    if not rows:
        raise UserInputError(f"{path}: the dataset has no rows; give a file with at least one problem")
    return rows, row_names


def _columns_of(rows: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(key for row in rows for key in row))


def check_group_column(path: str | Path, group_key: str) -> None:
    """Refuse a --group-key that names no column of the dataset (the same error `load_problems` gives)."""
    path = Path(path)
    columns = _columns_of(_read_rows(path)[0])
    if group_key not in columns:
        raise _missing_column(path, group_key, "task family (group)", "--group-key", columns)


def load_problems(
    path: str | Path,
    *,
    input_key: str | None = "prompt",
    label_key: str = "label",
    rubric_key: str | None = "rubric",
    group_key: str | None = None,
    id_key: str | None = None,
    metadata_keys: Sequence[str] = (),
) -> list[Problem]:
    """Every row of a .parquet, .jsonl or .json file as a `Problem`; one-line errors otherwise.

    The problem text comes from `input_key` when that column exists, else from a `messages`
    chat column (its user turns). Columns not used for a field go into `metadata`, or only
    `metadata_keys` when given.
    """
    path = Path(path)
    rows, row_names = _read_rows(path)
    columns = _columns_of(rows)
    if input_key and input_key in columns:
        text_column = input_key
    elif MESSAGES_COLUMN in columns:
        text_column = MESSAGES_COLUMN
    else:
        raise _missing_column(path, input_key or MESSAGES_COLUMN, "problem text", "--input-key", columns)
    if label_key not in columns:
        raise _missing_column(path, label_key, "label (reference answer)", "--label-key", columns)
    if group_key and group_key not in columns:
        raise _missing_column(path, group_key, "task family (group)", "--group-key", columns)
    if id_key and id_key not in columns:
        raise _missing_column(path, id_key, "problem id", "id_key", columns)
    for key in metadata_keys:
        if key not in columns:
            raise _missing_column(path, key, "metadata", "metadata_keys", columns)
    # A missing rubric column is normal (a label-only dataset): every rubric is "".
    has_rubric = bool(rubric_key) and rubric_key in columns

    used = {text_column, label_key, rubric_key, group_key, id_key}
    kept_columns = list(metadata_keys) if metadata_keys else [c for c in columns if c not in used]

    problems: list[Problem] = []
    first_row_of_uid: dict[str, str] = {}
    for index, (row, row_name) in enumerate(zip(rows, row_names)):
        where = f"{path}: {row_name}"
        raw_text = row.get(text_column)
        if isinstance(raw_text, (list, tuple)) or text_column == MESSAGES_COLUMN:
            text = "" if raw_text is None else _text_from_messages(raw_text, where, text_column)
        else:
            text = "" if _is_missing(raw_text) else str(raw_text)
        if not text.strip():
            flag = "--input-key" if text_column != MESSAGES_COLUMN else "--input-key (or a user turn in messages)"
            raise UserInputError(
                f"{where}: field '{text_column}' has no problem text; fill it in or drop the row ({flag})"
            )

        label = _decode_label(row.get(label_key))
        if _is_missing(label) or not label_text(label).strip():
            raise UserInputError(f"{where}: field '{label_key}' is empty; every problem needs a label (--label-key)")

        rubric_value = row.get(rubric_key) if has_rubric else None
        rubric = "" if _is_missing(rubric_value) else str(rubric_value)

        group = None
        if group_key:
            group_value = row.get(group_key)
            if _is_missing(group_value):
                raise UserInputError(
                    f"{where}: field '{group_key}' (--group-key) is empty; every row needs a task family"
                )
            group = str(group_value)

        if id_key:
            id_value = row.get(id_key)
            if _is_missing(id_value):
                raise UserInputError(f"{where}: field '{id_key}' (the id column) is empty; every row needs an id")
            uid = str(id_value)
            if uid in first_row_of_uid:
                raise UserInputError(
                    f"{where}: field '{id_key}' repeats id '{uid}' of {first_row_of_uid[uid]}; ids must be unique"
                )
            first_row_of_uid[uid] = row_name
        else:
            uid = str(index)

        metadata = {key: _none_if_nan(row.get(key)) for key in kept_columns}
        problems.append(
            Problem(uid=uid, prompt=text, label=label, rubric=rubric, group=group, metadata=metadata, source=where)
        )
    return problems


def problem_key(problem: Problem) -> str:
    """A problem's identity when eval and training sets are compared: its text, normalised.

    NFKC (full-width digits, ligatures), casefolded, whitespace collapsed; the label is left out.
    Why: the same problem with the label `4`, `4.0` or {"answer": "4"}, or re-wrapped, is still the
    same problem, and training on it would inflate the eval figure it is held out for.
    """
    text = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", problem.prompt).casefold())
    return " ".join(text.split())


def without_eval_problems(problems: Sequence[Problem], eval_problems: Sequence[Problem]) -> list[Problem]:
    """`problems` less every one whose normalised text (`problem_key`) is also an eval problem's."""
    held_out = {problem_key(p) for p in eval_problems}
    return [p for p in problems if problem_key(p) not in held_out]


# --------------------------------------------------------------------------- sizes


# --------------------------------------------------------------------------- sampling


def _permutation(indices: Sequence[int], *, seed: int, epoch: int, family: str | None, shuffle: bool) -> list[int]:
    order = list(indices)
    if shuffle:
        # random.Random(str) hashes the string with SHA-512: the same order on every machine and
        # Python version, unlike hash(), which is salted per process.
        random.Random(f"slime_meta.data.problems/{seed}/{epoch}/{family or ''}").shuffle(order)
    return order


class _Cursor:
    """A walk through epochs of one pool of indices; draws distinct indices per call.

    When fewer than `count` remain in an epoch, the draw takes the rest and continues in the
    next epoch, whose order puts the just-taken indices last ("deferred"), so one draw never
    repeats an index and every index is still drawn once per epoch.
    """

    def __init__(self, indices: Sequence[int], *, seed: int, family: str | None, shuffle: bool):
        self.indices = list(indices)
        self.seed, self.family, self.shuffle = seed, family, shuffle
        self.epoch, self.position, self.deferred = 0, 0, []
        self._order: list[int] | None = None

    def order(self) -> list[int]:
        if self._order is None:
            base = _permutation(
                self.indices, seed=self.seed, epoch=self.epoch, family=self.family, shuffle=self.shuffle
            )
            deferred = set(self.deferred)
            self._order = [i for i in base if i not in deferred] + [i for i in base if i in deferred]
        return self._order

    def draw(self, count: int) -> list[int]:
        taken = self.order()[self.position : self.position + count]
        self.position += len(taken)
        if len(taken) < count:
            self.epoch, self.position, self.deferred, self._order = self.epoch + 1, 0, list(taken), None
            rest = self.order()[: count - len(taken)]
            self.position = len(rest)
            taken += rest
        return taken

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "deferred": list(self.deferred)}

    def load(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.deferred, self._order = [int(i) for i in state["deferred"]], None


class ProblemSampler:
    """Reproducible episodes from a list of problems, with a saveable cursor.

    Without groups a step is ONE Episode: P*k train problems (P chunks of k) and H holdout
    problems, all distinct, drawn from a seeded per-epoch order of the whole dataset. With
    groups (`group_key_used=True`, families from `Problem.group`) each of the P prompts gets
    the next family of a seeded family order and its own Episode: k train and H holdout
    problems of that family, so the holdout tests transfer within a task family.
    """

    STATE_VERSION = 1

    def __init__(self, problems: Sequence[Problem], *, seed: int, shuffle: bool = True, group_key_used: bool = False):
        if not problems:
            raise UserInputError("the dataset has no problems to sample from")
        self.problems = list(problems)
        self.seed, self.shuffle, self.group_key_used = int(seed), bool(shuffle), bool(group_key_used)
        self.fingerprint = hashlib.sha256("\x00".join(p.uid for p in self.problems).encode()).hexdigest()[:16]
        self._all = _Cursor(range(len(self.problems)), seed=self.seed, family=None, shuffle=self.shuffle)
        self.families: dict[str, list[int]] = {}
        if self.group_key_used:
            for index, problem in enumerate(self.problems):
                if problem.group is None:
                    raise UserInputError(f"problem {problem.uid} has no group; every row needs a --group-key value")
                self.families.setdefault(problem.group, []).append(index)
        self._build_group_cursors()

    def _build_group_cursors(self) -> None:
        # Families are numbered in order of first appearance: the file order when shuffle=False.
        names = list(self.families)
        self._family_cursor = _Cursor(range(len(names)), seed=self.seed, family="<families>", shuffle=self.shuffle)
        self._member_cursors = {
            name: _Cursor(members, seed=self.seed, family=name, shuffle=self.shuffle)
            for name, members in self.families.items()
        }

    @property
    def epoch(self) -> int:
        return self._family_cursor.epoch if self.group_key_used else self._all.epoch

    def validate(self, problems_per_prompt: int, num_holdout: int, num_prompts: int) -> None:
        """Raise a UserInputError now if these sizes cannot be drawn, instead of mid-run."""
        if problems_per_prompt < 1 or num_prompts < 1 or num_holdout < 1:
            raise UserInputError(
                f"need at least 1 prompt, 1 problem per prompt and 1 holdout problem "
                f"(got num_prompts={num_prompts}, problems_per_prompt={problems_per_prompt}, num_holdout={num_holdout})"
            )
        if self.group_key_used:
            needed = problems_per_prompt + num_holdout
            name, members = min(self.families.items(), key=lambda item: len(item[1]))
            if len(members) < needed:
                raise UserInputError(
                    f"task family '{name}' has {len(members)} problems but each teacher prompt needs {needed} of one "
                    f"family ({problems_per_prompt} train (--n-problems-per-prompt) + {num_holdout} holdout, its share "
                    "of the --rollout-batch-size split); lower those sizes or drop/merge small families"
                )
            return
        needed = num_prompts * problems_per_prompt + num_holdout
        if len(self.problems) < needed:
            raise UserInputError(
                f"the dataset has {len(self.problems)} problems but one step needs {needed} distinct ones "
                f"(--rollout-batch-size: {num_prompts * problems_per_prompt} train + {num_holdout} holdout); "
                "lower --rollout-batch-size or add data"
            )

    def next_episodes(self, *, num_prompts: int, problems_per_prompt: int, num_holdout: int) -> list[Episode]:
        """The next step's episodes; advances the cursor."""
        self.validate(problems_per_prompt, num_holdout, num_prompts)
        k = problems_per_prompt
        if not self.group_key_used:
            drawn = [self.problems[i] for i in self._all.draw(num_prompts * k + num_holdout)]
            chunks = tuple(tuple(drawn[p * k : (p + 1) * k]) for p in range(num_prompts))
            return [Episode(train_chunks_P=chunks, holdout=tuple(drawn[num_prompts * k :]))]
        names = list(self.families)
        episodes = []
        for family_index in self._draw_families(num_prompts):
            name = names[family_index]
            drawn = [self.problems[i] for i in self._member_cursors[name].draw(k + num_holdout)]
            episodes.append(Episode(train_chunks_P=(tuple(drawn[:k]),), holdout=tuple(drawn[k:])))
        return episodes

    def _draw_families(self, count: int) -> list[int]:
        # One family at a time, so a step with more prompts than families walks into the next
        # epoch's order (repeating families) instead of needing `count` distinct families.
        return [self._family_cursor.draw(1)[0] for _ in range(count)]

    def state_dict(self) -> dict:
        """JSON-serialisable cursor state; load it into a sampler over the same dataset."""
        return {
            "version": self.STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "group_key_used": self.group_key_used,
            "num_problems": len(self.problems),
            "fingerprint": self.fingerprint,
            "all": self._all.state(),
            "families": self._family_cursor.state(),
            "members": {name: cursor.state() for name, cursor in self._member_cursors.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the saved sampler stopped. The saved seed and shuffle win."""
        if state.get("version") != self.STATE_VERSION:
            raise UserInputError(
                f"sampler state version {state.get('version')} is not {self.STATE_VERSION}; start fresh"
            )
        if state["fingerprint"] != self.fingerprint or state["group_key_used"] != self.group_key_used:
            raise UserInputError(
                f"the checkpoint's sampler state was saved for a different dataset ({state['num_problems']} problems, "
                f"group_key_used={state['group_key_used']}); resume with the same --data file and --group-key, or "
                "start fresh"
            )
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._all = _Cursor(range(len(self.problems)), seed=self.seed, family=None, shuffle=self.shuffle)
        self._build_group_cursors()
        self._all.load(state["all"])
        self._family_cursor.load(state["families"])
        for name, cursor_state in state["members"].items():
            self._member_cursors[name].load(cursor_state)
