"""Dataset tasks: a run's prompts from files in the ecosystem's formats, read with Hugging Face ``datasets``.

``run.task`` names the data; ``[data]`` says how to read it (:class:`loraflow.common.config.DataConfig`)::

    prompts.jsonl / .json        one object per line / an array of objects   (load_dataset("json"))
    prompts.parquet / .csv       columns as the file has them                (load_dataset("parquet"/"csv"))
    saved/                       a Dataset or DatasetDict written by save_to_disk   (load_from_disk)
    data/                        a directory of data files (train.jsonl, test.parquet, ...): load_dataset(dir)

A single file is one split; a DatasetDict or a directory of data files has several and ``data.split`` picks
the one trained on. Held-out rows (the launcher's evaluation) come from ``data.eval_split`` (another split of the
same data), ``data.eval_path`` (another file or directory), or else the first ``data.eval_fraction`` of the rows.

A row is TRL's: the prompt column holds a string or a conversation (a list of ``{"role", "content"}``
messages); ``data.system_prompt`` is put in front of every conversation as a system message (a string prompt
then becomes one user message). The answer column (``data.answer_column``; "" = none) is the reference answer
the held-out evaluation scores with (:meth:`DatasetTask.score`: exact match of the whole completion or of its
extracted final answer, as the built-in ``exact_match`` reward extracts it). Every column but the prompt reaches the reward functions as a keyword
argument (``solution``, ``ground_truth``, test cases, ...), and so does the answer, also under the name
``answer`` (see :mod:`loraflow.rollout_worker.rewards`).

Everything is checked at start-up, column-wise over Arrow batches (no Python loop over rows): an empty split, a
missing column, a prompt that is neither a string nor a message list, a row without an answer, a column whose
values cannot travel in a message (timestamps, decimals). A file the reader rejects is read again by a small
checker that names the line (JSONL, CSV) or row (JSON) and the column. Every error is a :class:`DatasetError`,
a :class:`~loraflow.common.config.ConfigError`: the process exits 2 with one line before it connects to anything.

Why the row travels in the lease (and not only its index). The broker reads row ``index`` when it grants a
lease and sends its prompt, answer and other columns with it (:meth:`TaskItem.lease_fields`). The broker still
holds no more than the cursor: the data is Arrow, memory-mapped from the ``datasets`` cache, so reading a row
costs microseconds and no resident copy; the rows of leases in flight live in the messages, not in broker state.
Workers stay correct without a copy of the data: a worker on another machine needs no shared file system, and
it cannot disagree with the broker about what row ``i`` is (another version of the file, another split or
held-out fraction, another ``system_prompt``). Rows are as large as their prompt; the wire bounds them
(``PromptLease``'s limits, ``broker.max_message_bytes``).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loraflow.common.answers import is_correct
from loraflow.common.config import ConfigError, DataConfig
from loraflow.common.task_base import Prompt, Task, TaskItem

#: file suffix -> the ``datasets`` builder that reads it
FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
_BATCH_ROWS = 8192


class DatasetError(ConfigError):
    """A dataset cannot be used as it is; the message names the file, the line or row and the column."""


def is_dataset_spec(spec: str) -> bool:
    """True when ``run.task`` names data (a file of a known format or a directory), not a built-in task."""
    path = Path(spec)
    return path.suffix.lower() in FILE_FORMATS or path.is_dir()


def _quiet_datasets() -> Any:
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


# -- reading ---------------------------------------------------------------------------------------------------


def read_split(spec: str, split: str, setting: str = "run.task") -> Any:
    """The ``datasets.Dataset`` of one split of the data ``spec`` names; DatasetError for anything wrong."""
    datasets = _quiet_datasets()
    path = Path(spec)
    if not path.exists():
        raise DatasetError(f"{setting}: {spec} does not exist")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            try:
                loaded = datasets.load_from_disk(str(path))
            except Exception as exc:  # noqa: BLE001 - the reader's own error, reported with the directory named
                raise DatasetError(f"{setting}: {spec} cannot be read by load_from_disk: {_reason(exc)}") from None
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DatasetError(f"{setting}: {spec} has no split {split!r} (data.split); it has "
                                       f"{sorted(loaded)}")
                return loaded[split]
            return loaded  # a saved Dataset is one split
        if not any(p.suffix.lower() in FILE_FORMATS for p in path.rglob("*") if p.is_file()):
            raise DatasetError(f"{setting}: {spec} is a directory with neither a save_to_disk dataset nor data "
                               f"files ({', '.join(sorted(FILE_FORMATS))})")
        try:
            return datasets.load_dataset(str(path), split=split)
        except ValueError as exc:
            if "Unknown split" in str(exc):
                raise DatasetError(f"{setting}: {spec}: {exc} (data.split)") from None
            raise DatasetError(f"{setting}: {spec} cannot be read: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the reader's own error, reported with the files named
            raise DatasetError(f"{setting}: {spec} cannot be read: {_reason(exc)}") from None
    builder = FILE_FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(f"{setting}: {spec} is not a known data file; use one of {sorted(FILE_FORMATS)}, a "
                           "save_to_disk directory or a directory of data files")
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")  # one file is one split
    except Exception as exc:  # noqa: BLE001 - find the line ourselves, else report the reader's reason
        if "corresponds to no data" in str(exc):  # the reader's words for a file without rows
            raise DatasetError(f"{spec}: the split has no rows") from None
        raise DatasetError(diagnose_file(path) or f"{spec}: cannot be read as {builder}: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = f"{exc}" + (f" ({cause})" if cause is not None and str(cause) not in str(exc) else "")
    return text.splitlines()[0][:500] if text else type(exc).__name__


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


def diagnose_file(path: Path) -> str | None:
    """Where a JSON, JSONL or CSV file is malformed (file, line or row, column), or None if no fault is found."""
    suffix = path.suffix.lower()
    try:
        if path.is_file() and not path.read_bytes().strip():
            return f"{path}: the file is empty (a dataset needs at least one row)"
        if suffix == ".csv":
            return _diagnose_csv(path)
        if suffix == ".jsonl" or (suffix == ".json" and not path.read_text().lstrip().startswith("[")):
            return _diagnose_rows(path, _jsonl_rows(path), "line")
        if suffix == ".json":
            try:
                rows = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                return f"{path}:{exc.lineno}: not valid JSON: {exc.msg}"
            return _diagnose_rows(path, ((i, row) for i, row in enumerate(rows)), "row")
    except _Malformed as exc:
        return str(exc)
    except (OSError, UnicodeDecodeError) as exc:
        return f"{path}: cannot be read: {exc}"
    return None


class _Malformed(Exception):
    pass


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise _Malformed(f"{path}:{number}: not valid JSON: {exc.msg} (column {exc.colno})") from None


def _diagnose_rows(path: Path, rows: Iterator[tuple[int, Any]], unit: str) -> str | None:
    """The first row that is not an object, or whose column changes its kind of value (string vs list ...)."""
    first: dict[str, tuple[str, int]] = {}
    where = (lambda n: f"{path}:{n}") if unit == "line" else (lambda n: f"{path}: row {n}")
    for number, row in rows:
        if not isinstance(row, dict):
            return f"{where(number)}: each {unit} must be a JSON object, got {_kind(row)}"
        for column, value in row.items():
            if value is None:
                continue
            kind = _kind(value)
            seen = first.setdefault(column, (kind, number))
            if seen[0] != kind:
                return (f"{where(number)}: column {column!r} is a {kind} here but a {seen[0]} at {unit} {seen[1]}; "
                        "a column holds one kind of value")
    return None


def _diagnose_csv(path: Path) -> str | None:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            return f"{path}: empty file (no header line)"
        for row in reader:
            if row and len(row) != len(header):
                return (f"{path}:{reader.line_num}: {len(row)} fields, the header has {len(header)} "
                        f"({', '.join(header)})")
    return None


# -- checking --------------------------------------------------------------------------------------------------


def _batches(ds: Any, columns: list[str]) -> Iterator[tuple[int, Any]]:
    """(first row number, pyarrow Table of ``columns``) over the dataset in row order."""
    start = 0
    for table in ds.select_columns(columns).with_format("arrow").iter(batch_size=_BATCH_ROWS):
        yield start, table
        start += table.num_rows


def _first_true(mask: Any) -> int | None:
    import pyarrow.compute as pc

    if not pc.any(mask).as_py():
        return None
    return int(pc.index(mask, True).as_py())


def _travels(arrow_type: Any) -> bool:
    """Whether values of this Arrow type become msgpack-friendly Python values (no timestamps, decimals)."""
    import pyarrow as pa

    t = pa.types
    if getattr(arrow_type, "extension_name", "") == "arrow.json":  # objects of varying keys, decoded by datasets
        return True
    if t.is_list(arrow_type) or t.is_large_list(arrow_type) or t.is_fixed_size_list(arrow_type):
        return _travels(arrow_type.value_type)
    if t.is_struct(arrow_type):
        return all(_travels(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    return (t.is_string(arrow_type) or t.is_large_string(arrow_type) or t.is_integer(arrow_type)
            or t.is_floating(arrow_type) or t.is_boolean(arrow_type) or t.is_null(arrow_type)
            or t.is_binary(arrow_type) or t.is_large_binary(arrow_type))


def _is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def _is_json_list(arrow_type: Any) -> bool:
    """A list of objects whose keys differ from row to row: ``datasets`` keeps each as JSON text."""
    import pyarrow as pa

    return ((pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type))
            and getattr(arrow_type.value_type, "extension_name", "") == "arrow.json")


def _is_messages(arrow_type: Any) -> bool:
    import pyarrow as pa

    if not (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)):
        return False
    item = arrow_type.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(name in names and _is_text(names[name]) for name in ("role", "content"))


class _Where:
    """Names a row: ``file:line`` for a JSONL file (blank lines skipped as the reader does), else ``row N``."""

    def __init__(self, spec: str, split: str) -> None:
        self.spec, self.split = spec, split

    def __call__(self, row: int) -> str:
        path = Path(self.spec)
        if path.suffix.lower() == ".jsonl" and path.is_file():
            with open(path, encoding="utf-8") as f:
                seen = -1
                for number, line in enumerate(f, 1):
                    seen += bool(line.strip())
                    if seen == row:
                        return f"{self.spec}:{number}"
        return f"{self.spec} ({self.split} split) row {row}"


def check_rows(ds: Any, data: DataConfig, where: _Where) -> None:
    """Every start-up check of one split (see the module docstring); DatasetError on the first fault."""
    import pyarrow.compute as pc

    label = where.spec if where.split in ("", "train") else f"{where.spec} ({where.split} split)"
    if len(ds) == 0:
        raise DatasetError(f"{label}: the split has no rows")
    columns = list(ds.column_names)
    for setting, column in (("data.prompt_column", data.prompt_column), ("data.answer_column", data.answer_column)):
        if column and column not in columns:
            fix = " (or \"\" when there is none)" if setting == "data.answer_column" else ""
            raise DatasetError(f"{label}: no column {column!r} ({setting}); the columns are {columns}: set "
                               f"{setting} to one of them{fix}")
    schema = ds.data.schema
    prompt_type = schema.field(data.prompt_column).type
    conversational = _is_messages(prompt_type)
    if _is_json_list(prompt_type):
        _check_json_messages(ds, data.prompt_column, where)
        conversational = False  # checked row by row above; nulls below
    elif not (_is_text(prompt_type) or conversational):
        raise DatasetError(f"{label}: column {data.prompt_column!r} holds {prompt_type}; a prompt must be a string "
                           "or a list of {\"role\", \"content\"} messages")
    answer_type = schema.field(data.answer_column).type if data.answer_column else None
    if answer_type is not None and not (_is_text(answer_type) or _numeric(answer_type)):
        raise DatasetError(f"{label}: column {data.answer_column!r} (data.answer_column) holds {answer_type}; an "
                           "answer must be a string or a number")
    for name in columns:
        if not _travels(schema.field(name).type):
            raise DatasetError(f"{label}: column {name!r} holds {schema.field(name).type}, which cannot be sent to "
                               "the reward functions; cast it to a string or drop the column")
    checked = [data.prompt_column] + ([data.answer_column] if data.answer_column else [])
    for start, table in _batches(ds, checked):
        prompts = table.column(data.prompt_column).combine_chunks()
        row = _first_true(pc.is_null(prompts))
        if row is not None:
            raise DatasetError(f"{where(start + row)}: column {data.prompt_column!r} is empty (null)")
        if conversational:
            _check_messages(prompts, data.prompt_column, start, where)
        if answer_type is not None:
            answers = table.column(data.answer_column).combine_chunks()
            row = _first_true(pc.is_null(answers))
            if row is not None:
                raise DatasetError(f"{where(start + row)}: no {data.answer_column!r} (data.answer_column); every "
                                   "row needs its reference answer (or set data.answer_column = \"\")")


def _numeric(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)


def _check_json_messages(ds: Any, column: str, where: _Where) -> None:
    """Message lists whose messages have differing keys, checked row by row (datasets decodes their JSON)."""
    for row, value in enumerate(ds[column]):
        if value is None:
            raise DatasetError(f"{where(row)}: column {column!r} is empty (null)")
        if not value:
            raise DatasetError(f"{where(row)}: column {column!r} is an empty message list")
        for message in value:
            for key in ("role", "content"):
                if not isinstance(message, dict) or not isinstance(message.get(key), str):
                    raise DatasetError(f"{where(row)}: column {column!r}: a message has no {key!r}; each message "
                                       "is {\"role\": str, \"content\": str}")


def _check_messages(prompts: Any, column: str, start: int, where: _Where) -> None:
    """No empty conversation; every message has a role and a content."""
    import pyarrow.compute as pc

    row = _first_true(pc.equal(pc.list_value_length(prompts), 0))
    if row is not None:
        raise DatasetError(f"{where(start + row)}: column {column!r} is an empty message list")
    messages = pc.list_flatten(prompts)
    parents = pc.list_parent_indices(prompts)
    for key in ("role", "content"):
        index = _first_true(pc.is_null(pc.struct_field(messages, key)))
        if index is not None:
            row = int(parents[index].as_py())
            raise DatasetError(f"{where(start + row)}: column {column!r}: a message has no {key!r}; each message "
                               "is {\"role\": str, \"content\": str}")


# -- the task --------------------------------------------------------------------------------------------------


def format_answer(value: Any) -> str:
    """A reference answer as text: numbers from CSV/Parquet columns without a spurious ``.0``."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return str(value)


class DatasetTask(Task):
    """Rows of a dataset split as prompts (see the module docstring); checked entirely at construction."""

    def __init__(self, spec: str, data: DataConfig | None = None) -> None:
        self.name = spec
        self.data = data = data or DataConfig()
        train = read_split(spec, data.split)
        check_rows(train, data, _Where(spec, data.split))
        held_out = None
        if data.eval_split:
            held_out = read_split(spec, data.eval_split, "data.eval_split")
            check_rows(held_out, data, _Where(spec, data.eval_split))
        elif data.eval_path:
            held_out = read_split(data.eval_path, data.split, "data.eval_path")
            check_rows(held_out, data, _Where(data.eval_path, data.split))
        if held_out is not None:
            self._splits = {"train": (train, 0, len(train)), "eval": (held_out, 0, len(held_out))}
        else:
            share = math.floor(len(train) * data.eval_fraction + 1e-9)
            num_eval = max(1, share) if data.eval_fraction and len(train) >= 2 else 0
            self._splits = {"eval": (train, 0, num_eval), "train": (train, num_eval, len(train) - num_eval)}
        self.size = self._splits["train"][2]

    def split_size(self, split: str) -> int:
        return self._splits[split][2]

    def score(self, completion: str, answer: str, *, finished: bool) -> float:
        """1.0 for a completion that ends its turn stating the reference answer, as a whole or as its final
        answer (``\\boxed{}``, ``####``, the last number: :func:`loraflow.common.answers.is_correct`), else 0.0."""
        return 1.0 if finished and is_correct(completion, answer) else 0.0

    def item(self, index: int, split: str = "train") -> TaskItem:
        rows, offset, size = self._splits[split]
        if size == 0:
            raise DatasetError(f"{self.name}: the {split} split is empty (data.eval_fraction, data.eval_split or "
                               "data.eval_path give held-out rows)")
        row = dict(rows[offset + index % size])
        data = self.data
        prompt = self._prompt(row.pop(data.prompt_column))
        answer = format_answer(row[data.answer_column]) if data.answer_column else ""
        if data.answer_column:
            row.setdefault("answer", answer)
        meta = row.get("meta") if isinstance(row.get("meta"), dict) else {}
        return TaskItem(prompt, answer, meta, columns=row)

    def _prompt(self, value: Any) -> Prompt:
        system = self.data.system_prompt
        if isinstance(value, str):
            return [{"role": "system", "content": system}, {"role": "user", "content": value}] if system else value
        # Arrow gives every message the union of the keys of all messages: drop the ones this message lacks
        messages = [{k: v for k, v in message.items() if v is not None} for message in value]
        if system and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system})
        return messages
