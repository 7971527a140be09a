"""PolicySampler: one sampling request to the vLLM servers under the trainer's current policy.

It holds what the default `generate_one_turn` needs and a hook should not see: the request seeds,
the route the servers offer (token ids in and out, candidate sets), the adapter naming of
adapter-only weight sync, and the check that the weights which sampled the tokens are the
trainer's. The scheduler (rollout/scheduler.py) builds it once the servers answer.
"""

from __future__ import annotations

import asyncio
import logging
import random

from asyncgrpo.errors import ConfigurationError, ServerError
from asyncgrpo.generation.client import (
    SamplingParams,
    ServerLostError,
    VLLMClient,
    VLLMRequestError,
    parse_policy_label,
    policy_adapter_name,
    policy_cache_salt,
)
from asyncgrpo.generation.server_info import ROUTING_REPLAY_HINT
from asyncgrpo.rollout.settings import SamplingSettings
from asyncgrpo.rollout.types import TurnRecord

logger = logging.getLogger(__name__)

# Adapter-only sync: how many times (about a second apart) a request retries when its policy
# adapter is not loaded (retired by a sync, or being pushed again to a restarted server).
ADAPTER_MISSING_RETRIES = 30


class RoutingNotReturnedError(ServerError):
    """MoE routing replay is on, but a server answered without the routed experts."""


async def wants_candidate_sets(client: VLLMClient, sampling: SamplingSettings) -> bool:
    """Whether samples carry each token's candidate set: top-p/top-k/min-p restrict sampling and
    the server returns the sets. Warns when they restrict it but the server cannot."""
    if sampling.top_p >= 1.0 and sampling.top_k == 0 and not sampling.min_p > 0:
        return False
    if await client.supports_sampling_mask():
        return True
    logger.warning(
        "top_p/top_k/min_p are set but the vLLM server does not return candidate sets (start it with "
        "--return-sampling-mask --enable-scale-out, vLLM >= 0.28): the trainer normalizes over the full "
        "vocabulary, so importance ratios are biased"
    )
    return False


class PolicySampler:
    """Sends sampling requests under the policy version the trainer publishes in
    `model_version_value` (a shared value, read at each request)."""

    def __init__(
        self,
        client: VLLMClient,
        model_version_value,
        lora_name: str | None,
        seed: int,
        token_route: bool,
        candidate_sets: bool,
        routing_replay: bool = False,
    ):
        if routing_replay and not token_route:
            raise ConfigurationError(
                "moe_routing_replay=True needs vLLM's token route, which returns the routed experts: start "
                f"the server with --enable-scale-out; {ROUTING_REPLAY_HINT}"
            )
        self.client = client
        self.model_version_value = model_version_value
        self.lora_name = lora_name
        self.token_route = token_route  # token ids in and out instead of /v1/completions
        self.candidate_sets = candidate_sets
        self.routing_replay = routing_replay  # samples carry the experts each token was routed to
        self._request_seeds = random.Random(seed)

    async def turn(self, prompt_ids: list[int], sampling: SamplingParams) -> TurnRecord:
        """One sampled response as a TurnRecord, labelled with the policy version that sampled it."""
        seed = self._request_seeds.getrandbits(62)
        completion, version = await self.sample(prompt_ids, sampling, seed)
        version = self.sampled_version(completion.weight_labels, version, completion.server_url)
        if self.routing_replay and completion.routed_experts is None:
            raise RoutingNotReturnedError(
                "moe_routing_replay=True but the vLLM server returned no routed experts: "
                + ROUTING_REPLAY_HINT
            )
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=completion.token_ids.tolist(),
            output_log_probs=completion.logprobs.tolist(),
            output_sampling_mask=[mask.tolist() for mask in completion.sampling_masks]
            if self.candidate_sets and completion.sampling_masks is not None
            else None,
            output_top_ids=completion.top_ids,
            output_top_logprobs=completion.top_logprobs,
            finish_reason=completion.finish_reason,
            model_version=version,
            routed_experts=completion.routed_experts if self.routing_replay else None,
        )

    def sampled_version(self, weight_labels: tuple[str, ...], version: int, url: str | None = None) -> int:
        """The policy version that sampled a response sent under `version` (by server `url`), from the
        weight labels the server reported for its tokens (see VLLMClient.complete; none: `version`)."""
        if not weight_labels:
            return version
        versions = [parse_policy_label(label) for label in weight_labels]
        if None in versions:
            raise ServerLostError(
                f"tokens sampled by weights labelled {weight_labels}: vLLM server {url} restarted and runs "
                "weights the trainer did not push",
                url,
                weights_lost=True,
            )
        # With adapters, the adapter the request named sampled every token.
        return version if self.lora_name else min(versions)

    async def sample(self, prompt_ids: list[int], sampling: SamplingParams, seed: int):
        """One request under the current policy version; returns (completion, version). With
        adapter-only weight sync (`lora_name` set) each version is its own adapter, named from the
        version, so the request runs to its end under the version it started with."""
        generate = self.client.generate_tokens if self.token_route else self.client.complete
        version, missing = self.model_version_value.value, 0
        while True:
            model = policy_adapter_name(self.lora_name, version) if self.lora_name else None
            try:
                return await generate(
                    prompt_ids, sampling, seed, model=model, cache_salt=policy_cache_salt(version)
                ), version
            except VLLMRequestError as error:
                # The version read just before a sync retired it, or a restarted server is being given
                # the current adapter again: take the newest version once it is there.
                missing += 1
                if not self.lora_name or error.status != 404 or missing > ADAPTER_MISSING_RETRIES:
                    raise
                if self.model_version_value.value == version:
                    await asyncio.sleep(1.0)
                version = self.model_version_value.value
