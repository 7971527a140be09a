"""A run's teachers, checked when the trainer is built (docs/distillation.md, "The teacher's server"):
each teacher's tokenizer against the student's (samples travel to a teacher as token ids and its report
indexes the student's vocabulary, so a teacher with another tokenizer would train the student on the
wrong tokens, silently), and with several teachers each dataset row's `teacher_id`, the eval
datasets' rows too (each eval completion is scored by its row's teacher).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.teacher_client import TeacherClient
from asyncgrpo.rollout.teacher import TEACHER_ID_COLUMN

# Text whose tokens tell tokenizers apart: words, digits, punctuation, whitespace runs, accents, CJK,
# an emoji, and the chat template's special tokens.
TOKENIZER_PROBE = (
    "The quick brown fox: 12345 + 678 = 13023?\n\n\tdef f(x):  return x**2  # ok\n"
    "\u00c9lan vital, na\u00efve caf\u00e9; \u6771\u4eac \u306e \u5929\u6c17 \U0001f642 "
    "<|im_start|>user\nhi<|im_end|>"
)


def check_teachers(
    tokenizer, student: str, args, train_dataset, eval_rows: dict[str, list[dict]] | None = None
) -> None:
    """A run's teachers: every row names one of them (`check_teacher_ids`, `check_eval_teacher_ids`
    for the eval datasets' rows, {metric prefix: rows}), and each shares the student's tokenizer
    (`check_teacher_tokenizers`). A run without teachers has nothing to check."""
    if not getattr(args, "teacher_server_urls", None):
        return
    check_teacher_ids(train_dataset, list(args.teacher_server_urls))
    for prefix, rows in (eval_rows or {}).items():
        check_eval_teacher_ids(rows, list(args.teacher_server_urls), prefix)
    check_teacher_tokenizers(tokenizer, student, args)


def check_teacher_ids(train_dataset, teacher_ids: list[str]) -> None:
    """With several teachers, a dataset with rows (not a stream) must name a known teacher in every
    row's `teacher_id` column: said now, not when the row comes up hours into the run."""
    names = getattr(train_dataset, "column_names", None)
    if len(teacher_ids) < 2 or not hasattr(train_dataset, "__len__") or names is None:
        return
    if TEACHER_ID_COLUMN not in names:
        raise ConfigurationError(
            f"teacher_server_urls has {len(teacher_ids)} teachers ({', '.join(teacher_ids)}) but the dataset "
            f"has no {TEACHER_ID_COLUMN!r} column to say which one scores each row"
        )
    unknown = sorted({str(value) for value in train_dataset[TEACHER_ID_COLUMN]} - set(teacher_ids))
    if unknown:
        raise ConfigurationError(
            f"dataset rows name teachers that teacher_server_urls does not have: {unknown} (it has "
            f"{', '.join(teacher_ids)})"
        )


def check_eval_teacher_ids(rows: list[dict], teacher_ids: list[str], prefix: str) -> None:
    """With several teachers, every eval row names a known one in its `teacher_id` column, as training
    rows do: said now, not by an evaluation that fails while the run trains. `prefix`: the rows'
    metric prefix (`eval`, `eval_{name}`), which names the eval dataset."""
    if len(teacher_ids) < 2:
        return
    for index, row in enumerate(rows):
        if row.get(TEACHER_ID_COLUMN) not in teacher_ids:
            raise ConfigurationError(
                f"eval dataset {prefix!r}, row {index}: {TEACHER_ID_COLUMN}={row.get(TEACHER_ID_COLUMN)!r} "
                f"is not a teacher of teacher_server_urls ({', '.join(teacher_ids)}); with several teachers "
                "every eval row names the one that scores it, as training rows do"
            )


def check_teacher_tokenizers(tokenizer, student: str, args) -> None:
    """Refuse a teacher whose tokenizer is not the student's, naming both: samples travel to it as
    token ids and its report indexes the student's vocabulary, so another tokenizer would train the
    student on the wrong tokens without any error. Compared on `TOKENIZER_PROBE`; each teacher is
    waited for up to vllm_server_timeout."""
    expected = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    for teacher_id, url in args.teacher_server_urls.items():
        model, tokens = _on_fresh_loop(_teacher_tokens(url, args.vllm_server_timeout))
        if tokens != expected:
            first = next(
                (i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
                min(len(tokens), len(expected)),
            )
            raise ConfigurationError(
                f"teacher {teacher_id!r} at {url} serves {model}, whose tokenizer is not the student's "
                f"({student}): the same text gives {len(tokens)} tokens there and {len(expected)} here, "
                f"first differing at token {first}. A teacher must share the student's tokenizer (samples "
                "reach it as token ids, and its scores index the student's vocabulary)."
            )


async def _teacher_tokens(url: str, timeout: float) -> tuple[str, list[int]]:
    async with TeacherClient(url, timeout=timeout) as client:
        await client.wait_until_ready()
        return await client.model_name(), await client.tokenize(TOKENIZER_PROBE)


def _on_fresh_loop(coroutine):
    """Run `coroutine` to its end on a new event loop in a thread of its own: the trainer may be built
    where a loop already runs (a notebook)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
