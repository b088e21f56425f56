"""Several choices in one request (a list of prompts, ``n`` samples each): one ``RouterRequest`` per choice, run side
by side, their outputs merged as they come. Both APIs use it: the HTTP API for ``n`` and lists of prompts, gRPC's
``Generate`` for ``SamplingParams.n``.

    make_choices(router, prompts, params, id)   choice index = prompt index * n + sample index, each checked and
                                                tokenized before any starts; sample i seeded seed + i
                                                (``SamplingParams.for_sample``); ids ``<id>-<index>`` when several;
                                                the n samples of a prompt share a ``SampleGroup``: one prefill, one
                                                KV transfer, the prompt's blocks shared on the decode pod
    merged_outputs([router.generate(r)...])    (index, OutputDelta | Completion) as they come; closing it, or a
                                                choice failing, stops every choice still running
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from splitserve.engine.sampling.params import SamplingParams
from splitserve.router.intake import DEFAULT_SERVICE, RouterRequest, SampleGroup, ServiceLevel
from splitserve.router.outputs import Completion, OutputDelta

if TYPE_CHECKING:
    from splitserve.router.router import Router

# Choices per request (prompts x n): each is a request of its own on the pods.
MAX_CHOICES = 128
RouterOutputs = AsyncGenerator[OutputDelta | Completion, None]


def too_many_choices(num_prompts: int, n: int) -> str:
    return (f"{num_prompts} prompt(s) x n = {n} make {num_prompts * n} choices, more than the limit of {MAX_CHOICES} "
            f"per request")


async def make_choices(router: Router, prompts: list[str | list[int]], params: SamplingParams,
                       request_id: str | None, add_special_tokens: bool, timeout_s: float | None = None,
                       service: ServiceLevel = DEFAULT_SERVICE) -> list[RouterRequest]:
    """One request per choice, prompt by prompt, ``n`` samples each; a single choice keeps the request's id."""
    options = {"add_special_tokens": add_special_tokens, "timeout_s": timeout_s, "service": service}
    if len(prompts) == 1 and params.n == 1:
        return [await router.make_request(prompts[0], params, request_id, **options)]
    request_id = request_id or uuid.uuid4().hex
    made = []
    for prompt_index, prompt in enumerate(prompts):
        samples = []
        for sample in range(params.n):
            index = prompt_index * params.n + sample
            samples.append(await router.make_request(prompt, params.for_sample(sample), f"{request_id}-{index}",
                                                     **options))
        if params.n > 1 and params.max_tokens != 0:  # one prefill and one KV transfer for the prompt's samples
            group = SampleGroup([r.request_id for r in samples], dataclasses.replace(samples[0].params, n=params.n))
            for request in samples:
                request.samples = group
        made.extend(samples)
    return made


async def merged_outputs(outputs: list[RouterOutputs]) -> AsyncGenerator[tuple[int, OutputDelta | Completion], None]:
    """The choices' outputs as they come, each with its choice's index, until every choice completed."""
    reading: dict[asyncio.Future, int] = {}

    def read(index: int) -> None:
        reading[asyncio.ensure_future(anext(outputs[index]))] = index

    try:
        for index in range(len(outputs)):
            read(index)
        while reading:
            done, _ = await asyncio.wait(reading, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=reading.__getitem__):
                index = reading.pop(task)
                output = task.result()
                if isinstance(output, OutputDelta):
                    read(index)
                yield index, output
    finally:
        for task in reading:
            task.cancel()
        await asyncio.gather(*reading, return_exceptions=True)
        for choice in outputs:
            await choice.aclose()
