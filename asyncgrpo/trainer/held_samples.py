"""Samples a checkpoint carries: those the trainer held but had not trained when it saved.

A group's samples can straddle two optimizer steps. Were they dropped at a checkpoint, resuming
would regenerate the whole prompt and train its first samples a second time; so the checkpoint keeps
every sample the trainer holds for an unconsumed prompt, and the resumed run trains them first
(docs/architecture.md, "Resume"). Arrays go to one `.npz` and the scalars to JSON: loading a
checkpoint never unpickles anything.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from asyncgrpo.records.sample import Sample

HELD_SAMPLES_ARRAYS = "held_samples.npz"
HELD_SAMPLES_FIELDS = "held_samples.json"
_SCALARS = (
    "advantage",
    "group_id",
    "model_version",
    "row_index",
    "stream_index",
    "epoch",
    "reward",
    "rollout_id",
    "queued_at",
    "teacher_index",
)


def save_held_samples(samples: list[Sample], directory: str | os.PathLike) -> None:
    directory = Path(directory)
    arrays: dict[str, np.ndarray] = {}
    fields = []
    for index, sample in enumerate(samples):
        arrays[f"{index}.token_ids"] = sample.token_ids
        arrays[f"{index}.trained"] = sample.trained
        arrays[f"{index}.sampler_logprobs"] = sample.sampler_logprobs
        if sample.top_ids is not None:
            arrays[f"{index}.top_ids"] = sample.top_ids
            arrays[f"{index}.top_logprobs"] = sample.top_logprobs
        if sample.routed_experts is not None:
            arrays[f"{index}.routed_experts"] = sample.routed_experts
        if sample.token_advantages is not None:
            arrays[f"{index}.token_advantages"] = sample.token_advantages
        if sample.teacher_ids is not None:
            arrays[f"{index}.teacher_ids"] = sample.teacher_ids
            arrays[f"{index}.teacher_logprobs"] = sample.teacher_logprobs
        if sample.candidate_sets is not None:
            arrays[f"{index}.candidate_sizes"] = np.array(
                [len(c) for c in sample.candidate_sets], dtype=np.int64
            )
            arrays[f"{index}.candidates"] = (
                np.concatenate(sample.candidate_sets)
                if sample.candidate_sets
                else np.zeros(0, dtype=np.int64)
            )
        fields.append({name: getattr(sample, name) for name in _SCALARS} | {"metadata": sample.metadata})
    np.savez(directory / HELD_SAMPLES_ARRAYS, **arrays)
    (directory / HELD_SAMPLES_FIELDS).write_text(json.dumps(fields))


def load_held_samples(directory: str | os.PathLike) -> list[Sample]:
    """The samples `save_held_samples` wrote; [] for a checkpoint without any."""
    directory = Path(directory)
    if not (directory / HELD_SAMPLES_FIELDS).exists():
        return []
    fields = json.loads((directory / HELD_SAMPLES_FIELDS).read_text())
    samples = []
    with np.load(directory / HELD_SAMPLES_ARRAYS, allow_pickle=False) as arrays:
        for index, scalars in enumerate(fields):
            candidate_sets = None
            if f"{index}.candidate_sizes" in arrays:
                sizes = arrays[f"{index}.candidate_sizes"]
                candidate_sets = (
                    np.split(arrays[f"{index}.candidates"], np.cumsum(sizes)[:-1]) if len(sizes) else []
                )
            top_ids = arrays[f"{index}.top_ids"] if f"{index}.top_ids" in arrays else None
            top_logprobs = arrays[f"{index}.top_logprobs"] if top_ids is not None else None
            samples.append(
                Sample(
                    token_ids=arrays[f"{index}.token_ids"],
                    trained=arrays[f"{index}.trained"],
                    sampler_logprobs=arrays[f"{index}.sampler_logprobs"],
                    top_ids=top_ids,
                    top_logprobs=top_logprobs,
                    candidate_sets=candidate_sets,
                    routed_experts=arrays.get(f"{index}.routed_experts"),
                    teacher_ids=arrays.get(f"{index}.teacher_ids"),
                    teacher_logprobs=arrays.get(f"{index}.teacher_logprobs"),
                    token_advantages=arrays.get(f"{index}.token_advantages"),
                    **scalars,
                )
            )
    return samples
