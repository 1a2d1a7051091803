"""Dataset tasks: every format gives the same rows, columns map, held-out splits, and every fault is named at
start-up (file, line or row, column) as a ConfigError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loraflow.common.config import ConfigError, DataConfig
from loraflow.common.dataset import DatasetError, DatasetTask
from loraflow.common.tasks import load_task

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i), "level": i % 3, "tests": [i, i + 1]}
        for i in range(12)]
CHAT_ROWS = [{"question": [{"role": "user", "content": f"q{i}"}], "solution": f"#### {i}", "source": "mine"}
             for i in range(5)]


def write(path: Path, rows: list[dict[str, Any]]) -> str:
    """``rows`` in the format the suffix names (or a save_to_disk directory when there is none)."""
    from datasets import Dataset

    suffix = path.suffix
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif suffix == ".csv":
        Dataset.from_list(rows).to_csv(str(path), index=False)
    elif suffix == ".parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    else:
        Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def items(task: DatasetTask, split: str = "train") -> list[Any]:
    return [task.item(i, split) for i in range(task.split_size(split))]


@pytest.mark.parametrize("name", ["p.jsonl", "p.json", "p.parquet", "saved"])
def test_each_format_loads_the_same_rows(tmp_path: Path, name: str) -> None:
    task = load_task(write(tmp_path / name, ROWS), data=DataConfig())
    assert isinstance(task, DatasetTask) and task.size == 11 and task.split_size("eval") == 1
    first = task.item(0)
    assert first.prompt == "What is 1 + 1?" and first.answer == "2"
    assert first.columns == {"answer": "2", "level": 1, "tests": [1, 2]}  # everything but the prompt
    assert [it.prompt for it in items(task, "eval")] == ["What is 0 + 0?"]
    assert task.item(11) == first  # indices wrap (epochs)


def test_csv_numbers_become_answers_without_a_decimal_point(tmp_path: Path) -> None:
    rows = [{"prompt": r["prompt"], "answer": int(r["answer"]), "level": r["level"]} for r in ROWS]
    task = load_task(write(tmp_path / "p.csv", rows), data=DataConfig())
    assert task.item(0).answer == "2" and task.item(0).columns["level"] == 1


def test_a_directory_of_data_files_and_its_splits(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / "train.jsonl", ROWS)
    write(tmp_path / "data" / "test.jsonl", ROWS[:3])
    task = load_task(str(tmp_path / "data"), data=DataConfig(eval_split="test"))
    assert task.size == 12 and [it.answer for it in items(task, "eval")] == ["0", "2", "4"]
    test_only = load_task(str(tmp_path / "data"), data=DataConfig(split="test", eval_fraction=0.0))
    assert test_only.size == 3 and test_only.split_size("eval") == 0
    with pytest.raises(DatasetError, match=r"Unknown split.*'nope'.*\(data.split\)|Unknown split \"nope\""):
        load_task(str(tmp_path / "data"), data=DataConfig(split="nope"))


def test_a_saved_dataset_dict_picks_its_split(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    DatasetDict({"train": Dataset.from_list(ROWS), "validation": Dataset.from_list(ROWS[5:7])}).save_to_disk(
        str(tmp_path / "dd"))
    task = load_task(str(tmp_path / "dd"), data=DataConfig(eval_split="validation"))
    assert task.size == 12 and [it.answer for it in items(task, "eval")] == ["10", "12"]
    with pytest.raises(DatasetError, match=r"no split 'test' \(data.split\); it has \['train', 'validation'\]"):
        load_task(str(tmp_path / "dd"), data=DataConfig(split="test"))


def test_held_out_from_another_file(tmp_path: Path) -> None:
    train, held_out = write(tmp_path / "train.parquet", ROWS), write(tmp_path / "held.jsonl", ROWS[:2])
    task = load_task(train, data=DataConfig(eval_path=held_out))
    assert task.size == 12 and [it.answer for it in items(task, "eval")] == ["0", "2"]
    fraction = load_task(train, data=DataConfig(eval_fraction=0.25))
    assert fraction.size == 9 and fraction.split_size("eval") == 3


def test_column_mapping_and_conversational_prompts_with_a_system_prompt(tmp_path: Path) -> None:
    path = write(tmp_path / "chat.jsonl", CHAT_ROWS)
    data = DataConfig(prompt_column="question", answer_column="solution", system_prompt="Think, then answer.")
    item = load_task(path, data=data).item(0)
    assert item.prompt == [{"role": "system", "content": "Think, then answer."}, {"role": "user", "content": "q1"}]
    assert item.answer == "#### 1"
    assert item.columns == {"solution": "#### 1", "source": "mine", "answer": "#### 1"}
    fields = item.lease_fields()
    assert fields["prompt"] == "" and fields["prompt_messages"] == item.prompt
    text = load_task(write(tmp_path / "t.jsonl", ROWS), data=DataConfig(system_prompt="Be brief.")).item(0)
    assert text.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 1?"}]
    no_answer = load_task(path, data=DataConfig(prompt_column="question", answer_column="")).item(0)
    assert no_answer.answer == "" and "answer" not in no_answer.columns


def test_a_conversation_that_has_its_own_system_message_keeps_it(tmp_path: Path) -> None:
    rows = [{"prompt": [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}], "answer": "1"},
            {"prompt": [{"role": "user", "content": "yo", "name": "bob"}], "answer": "2"}]
    task = load_task(write(tmp_path / "c.jsonl", rows), data=DataConfig(system_prompt="theirs", eval_fraction=0))
    assert task.item(0).prompt[0] == {"role": "system", "content": "mine"}
    # Arrow fills the keys a message lacks with null: they are dropped again
    assert task.item(1).prompt == [{"role": "system", "content": "theirs"}, {"role": "user", "content": "yo",
                                                                             "name": "bob"}]
    assert task.item(0).prompt[1] == {"role": "user", "content": "hi"}


def lines(*objects: Any) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objects)


@pytest.mark.parametrize(("name", "text", "data", "message"), [
    ("bad.jsonl", lines({"prompt": "a", "answer": "1"}, "{not json", {"prompt": "b", "answer": "2"}), {},
     r"bad.jsonl:2: not valid JSON"),
    ("types.jsonl", lines({"prompt": "a", "answer": "1"}, "", {"prompt": [{"role": "user", "content": "x"}],
                                                             "answer": "2"}), {},
     r"types.jsonl:3: column 'prompt' is a list here but a string at line 1"),
    ("noans.jsonl", lines({"prompt": "a", "answer": "1"}, "", {"prompt": "b"}), {},
     r"noans.jsonl:3: no 'answer' \(data.answer_column\)"),
    ("nullprompt.jsonl", lines({"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "1"}), {},
     r"nullprompt.jsonl:2: column 'prompt' is empty"),
    ("number.jsonl", lines({"prompt": 3, "answer": "1"}), {}, r"column 'prompt' holds int64; a prompt must be"),
    ("nocol.jsonl", lines({"question": "a", "answer": "1"}), {},
     r"no column 'prompt' \(data.prompt_column\); the columns are \['question', 'answer'\]"),
    ("nosol.jsonl", lines({"prompt": "a", "answer": "1"}), {"answer_column": "solution"},
     r"no column 'solution' \(data.answer_column\).*or \"\" when there is none"),
    ("emptymsgs.jsonl", lines({"prompt": [{"role": "user", "content": "x"}], "answer": "1"},
                              {"prompt": [], "answer": "1"}), {}, r"emptymsgs.jsonl:2: column 'prompt' is an empty"),
    ("norole.jsonl", lines({"prompt": [{"role": "user", "content": "x"}], "answer": "1"},
                           {"prompt": [{"content": "y"}], "answer": "2"}), {},
     r"norole.jsonl:2: column 'prompt': a message has no 'role'"),
    ("notobject.jsonl", lines({"prompt": "a", "answer": "1"}, "[1, 2]"), {},
     r"notobject.jsonl:2: each line must be a JSON object"),
    ("bad.json", '[{"prompt": "a", "answer": "1"},\n {"prompt": "b" "answer": "2"}]', {},
     r"bad.json:2: not valid JSON"),
    ("ragged.csv", "prompt,answer\na,1\nb,2,3\n", {}, r"ragged.csv:3: 3 fields, the header has 2 \(prompt, answer\)"),
    ("empty.jsonl", "", {}, r"empty.jsonl"),
    ("data.txt", "hello", {}, r"data.txt"),
])
def test_faults_are_named_at_start_up(tmp_path: Path, name: str, text: str, data: dict[str, Any],
                                      message: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_task(str(tmp_path / name), data=DataConfig(**data))


def test_an_empty_split_and_a_missing_path(tmp_path: Path) -> None:
    (tmp_path / "header_only.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"header_only.csv: the split has no rows"):
        load_task(str(tmp_path / "header_only.csv"))
    with pytest.raises(DatasetError, match=r"run.task: .*missing.jsonl does not exist"):
        load_task(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ConfigError, match=r"data.eval_path: .*nope.parquet does not exist"):
        load_task(write(tmp_path / "p.jsonl", ROWS), data=DataConfig(eval_path=str(tmp_path / "nope.parquet")))


def test_a_column_that_cannot_travel_is_refused(tmp_path: Path) -> None:
    import datetime

    from datasets import Dataset

    Dataset.from_list([{"prompt": "a", "answer": "1", "when": datetime.datetime(2026, 1, 1)}]).save_to_disk(
        str(tmp_path / "ts"))
    with pytest.raises(DatasetError, match=r"column 'when' holds timestamp.*cast it to a string or drop"):
        load_task(str(tmp_path / "ts"))


def test_data_settings_with_a_builtin_task_are_refused() -> None:
    assert load_task("arith", data=DataConfig()).item(0).columns["answer"] == load_task("arith").item(0).answer
    with pytest.raises(ConfigError, match=r"\[data\] settings apply to dataset tasks"):
        load_task("arith", data=DataConfig(prompt_column="question"))


def test_the_gsm8k_example_is_what_its_generator_writes_and_loads_as_its_config_says() -> None:
    from loraflow.common.config import load_config
    from loraflow.deploy.data import make_gsm8k_mini
    from loraflow.rollout_worker.rewards.builtin import exact_match, format_reward

    assert make_gsm8k_mini.PATH.read_text() == make_gsm8k_mini.text()  # regenerate after changing the generator
    config = load_config(Path(__file__).resolve().parents[2] / "deploy" / "configs" / "gsm8k.toml")
    task = load_task(str(make_gsm8k_mini.PATH), data=config.data)
    assert (task.size, task.split_size("eval")) == (108, 12)
    item = task.item(0)
    assert [m["role"] for m in item.prompt] == ["system", "user"] and "####" in item.prompt[0]["content"]
    assert set(item.columns) == {"answer", "topic", "num_steps"}
    solution = [{"role": "assistant", "content": item.answer}]  # the reference solution, as a completion
    assert exact_match([item.prompt], [solution], answer=[item.answer]) == [1.0]
    assert format_reward([item.prompt], [solution]) == [1.0]
    assert config.worker.rewards == ["loraflow:exact_match", "loraflow:format"]


@pytest.mark.parametrize(("completion", "answer", "finished", "score"), [
    ("Out: 4 * 3 = 12.\n#### 12", "Out: 4 * 3 = 12 km.\n#### 12", True, 1.0),  # worked solutions
    ("so the total is \\boxed{72}", "72", True, 1.0),
    ("the answer is 71", "72", True, 0.0),
    ("#### 12", "#### 12", False, 0.0),  # cut off before its end of turn
    ("Paris", "paris", True, 1.0),  # a text answer as a whole
    ("no number here", "7", True, 0.0),
])
def test_held_out_scoring_of_a_dataset_task(tmp_path: Path, completion: str, answer: str, finished: bool,
                                            score: float) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(4)))
    task = DatasetTask(str(path))
    assert task.score(completion, answer, finished=finished) == score
