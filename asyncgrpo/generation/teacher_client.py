"""The client of a distillation teacher's vLLM server: teacher-forced scoring and its tokenizer.

A teacher is never sent weights nor sampled from: it scores the student's sequences token ids in
(`prompt_logprobs`), and its tokenizer is compared with the student's before a run
(docs/distillation.md, "The teacher's server"). A request the server fails is retried as a generation
request is, within the client's timeout.
"""

from __future__ import annotations

import numpy as np

from asyncgrpo.generation.client import VLLMClient
from asyncgrpo.generation.responses import parse_prompt_logprobs


class TeacherClient(VLLMClient):
    # Whether the server offers the token route (`asyncgrpo serve`'s --enable-scale-out); None: not asked.
    _token_route: bool | None = None

    async def prompt_logprobs(
        self, token_ids: list[int], positions: np.ndarray, top_k: int, temperature: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Score `token_ids` teacher-forced: the server's top-`top_k` tokens and their log-probs at
        `temperature` at each of `positions` (the position's token given the tokens before it), plus
        the realized token where it ranks lower, as `parse_prompt_logprobs` returns them. One
        throwaway token is generated. Through the token route where the server offers it, which spares
        its API process the text of every reported token; `/v1/completions` otherwise."""
        fields = {"max_tokens": 1, "temperature": temperature, "prompt_logprobs": top_k}
        if self._token_route is None:
            self._token_route = await self.supports_token_generate()
        if self._token_route:  # tokens in and out: the server decodes no reported token's text
            payload = {
                "token_ids": token_ids,
                "sampling_params": {**fields, "detokenize": False},
                "model": await self.model_name(),
            }
            _, body = await self._generation_call("/inference/v1/generate", payload, cache_salt=None)
        else:
            payload = {"model": await self.model_name(), "prompt": token_ids, "stream": False, **fields}
            _, body = await self._generation_call("/v1/completions", payload, cache_salt=None)
        return parse_prompt_logprobs(body, positions, top_k + 1)

    async def tokenize(self, text: str) -> list[int]:
        """The token ids the server's tokenizer gives `text`, without special tokens added."""
        payload = {"model": await self.model_name(), "prompt": text, "add_special_tokens": False}
        return list((await self._json("POST", self.base_urls[0], "/tokenize", payload))["tokens"])
