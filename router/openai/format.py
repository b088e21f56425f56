"""Router outputs -> OpenAI responses: one formatter per request shapes its ``OutputDelta``s and its ``Completion``
into stream chunks, or into one whole response, of ``/v1/completions`` or ``/v1/chat/completions``.

    formatter.opening_chunks()          chat: the assistant's role, before any text
    formatter.delta_chunk(delta)        one chunk per delta with new text (or logprobs owed), else None
    formatter.finish_chunks(completion) the finish reason and stop reason (chat with tools: the calls before it)
    formatter.usage_chunk(usage)        the usage, when stream_options.include_usage
    formatter.response(deltas, completion)   the same, joined, for a request that does not stream

A request with several choices (a list of prompts, ``n`` > 1) has one formatter per choice, each with its index;
``joined_responses`` and ``joined_usage`` put their answers together, each prompt's tokens counted once.

With ``stream_options.continuous_usage_stats`` every chunk also carries the usage so far (prompt tokens, and
the completion tokens streamed up to and including that chunk), as vLLM does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pydantic import BaseModel

from splitserve.router.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    PromptTokenLogprob,
    PromptTokensDetails,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from splitserve.router.openai.tool_calls import ToolCall, ToolCallParser
from splitserve.router.outputs import Completion, OutputDelta

TokenText = Callable[[int], str]  # a token id's own text, for logprobs


class _Formatter:
    """Shapes one request's router outputs; the stream and the whole response are built from the same deltas."""

    id_prefix = ""

    def __init__(self, request_id: str, model: str, token_text: TokenText, num_logprobs: int | None,
                 prompt_tokens: int = 0, continuous_usage: bool = False, index: int = 0, echo: str = "",
                 tool_parser: ToolCallParser | None = None):
        self.response_id = f"{self.id_prefix}{request_id}"
        self.index = index  # the choice's index: prompt index * n + sample index
        self.echo = echo  # text before the output (completions' echo: the prompt)
        self.tool_parser = tool_parser  # chat with tools: the answer's tool calls
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.num_logprobs = num_logprobs  # None: the client asked for no logprobs
        self.prompt_tokens = prompt_tokens
        self.continuous_usage = continuous_usage  # every chunk carries the usage so far
        self._completion_tokens = 0  # streamed so far

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def _count(self, delta: OutputDelta) -> None:
        self._completion_tokens += len(delta.token_ids)

    def _usage_so_far(self, completion: Completion | None = None) -> Usage | None:
        if not self.continuous_usage:
            return None
        if completion is not None:
            return self.usage(completion)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self._completion_tokens,
                     total_tokens=self.prompt_tokens + self._completion_tokens)

    @staticmethod
    def usage(completion: Completion) -> Usage:
        return Usage(
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.completion_tokens,
            total_tokens=completion.prompt_tokens + completion.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=completion.cached_tokens),
        )

    def _wants_chunk(self, delta: OutputDelta) -> bool:
        # Tokens whose text is held back (a partial character, a possible stop string) still owe their logprobs.
        return bool(delta.text) or (self.num_logprobs is not None and bool(delta.token_ids))

    def _token_logprobs(self, delta: OutputDelta) -> list[tuple[int, dict[int, float]]] | None:
        """(sampled token id, {candidate id: logprob}) per token, or None when no logprobs were asked for.

        The router's dict lists the top alternatives in rank order, then the sampled token when it is not
        among them (``splitserve.protos.convert.token_logprob_to_dict``)."""
        if self.num_logprobs is None or delta.logprobs is None:
            return None
        return list(zip(delta.token_ids, delta.logprobs))


class TextCompletionFormatter(_Formatter):
    """``/v1/completions`` responses and chunks (object ``text_completion``), with legacy logprobs.

    Echo with logprobs scores the prompt as OpenAI's legacy API does: ``logprobs`` starts with an entry per prompt
    token (the first one's logprob and alternatives null), its text offsets counted from the start of the prompt's
    tokens' text; streamed, the echoed text goes out with those entries in the first delta's chunk. vLLM's
    ``prompt_logprobs`` come in the choice as vLLM shapes them (``prompt_token_ids``: the prompt's ids, given when
    echoing; ``prompt_logprobs``: the top-N asked for, None when not)."""

    id_prefix = "cmpl-"

    def __init__(self, *args, prompt_token_ids: list[int] | None = None, prompt_logprobs: int | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_logprobs = prompt_logprobs
        self._scores_echo = prompt_token_ids is not None and self.num_logprobs is not None
        self._echo_waits = self._scores_echo  # the echo waits for its logprobs, in the first delta
        self._text_offset = 0 if self._scores_echo else len(self.echo)  # characters before the next token

    def delta_chunk(self, delta: OutputDelta) -> CompletionResponse | None:
        self._count(delta)
        echo = self._take_echo() if delta.prompt_logprobs is not None else ""
        if not (echo or delta.prompt_logprobs is not None or self._wants_chunk(delta)):
            return None
        return self._response(CompletionChoice(index=self.index, text=echo + delta.text, logprobs=self._logprobs(delta),
                                               prompt_logprobs=self._prompt_logprobs(delta)), self._usage_so_far())

    def finish_chunks(self, completion: Completion) -> list[CompletionResponse]:
        return [self._response(CompletionChoice(
            index=self.index, text=self._take_echo(), finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason), self._usage_so_far(completion))]

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=[],
                                  usage=usage)

    def opening_chunks(self) -> list[BaseModel]:
        echo = self.echo if not self._echo_waits else ""
        return [self._response(CompletionChoice(index=self.index, text=echo))] if echo else []

    def response(self, deltas: list[OutputDelta], completion: Completion) -> CompletionResponse:
        whole = _joined(deltas)
        choice = CompletionChoice(index=self.index, text=self.echo + whole.text, logprobs=self._logprobs(whole),
                                  finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                                  prompt_logprobs=self._prompt_logprobs(whole))
        return self._response(choice, self.usage(completion))

    def _take_echo(self) -> str:
        """The echoed text still owed (streaming echo with logprobs), once."""
        echo, self._echo_waits = (self.echo if self._echo_waits else ""), False
        return echo

    def _response(self, choice: CompletionChoice, usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                  choices=[choice], usage=usage)

    def _logprobs(self, delta: OutputDelta) -> CompletionLogprobs | None:
        per_token = self._token_logprobs(delta)
        if per_token is None:
            return None
        logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        if self._scores_echo and delta.prompt_logprobs is not None:
            self._add_entry(logprobs, self.prompt_token_ids[0], None, None)  # the first token has no context
            for entry in delta.prompt_logprobs:
                top = dict(list(entry.top.items())[:self.num_logprobs])
                self._add_entry(logprobs, entry.token_id, entry.logprob, {**top, entry.token_id: entry.logprob})
        for token_id, candidates in per_token:
            # This format wants exactly what the router's dict holds: the alternatives and the sampled token.
            self._add_entry(logprobs, token_id, candidates[token_id], candidates)
        return logprobs

    def _add_entry(self, logprobs: CompletionLogprobs, token_id: int, logprob: float | None,
                   candidates: dict[int, float] | None) -> None:
        text = self.token_text(token_id)
        logprobs.tokens.append(text)
        logprobs.token_logprobs.append(logprob)
        logprobs.top_logprobs.append(None if candidates is None else
                                     {self.token_text(other): value for other, value in candidates.items()})
        logprobs.text_offset.append(self._text_offset)
        self._text_offset += len(text)

    def _prompt_logprobs(self, delta: OutputDelta) -> list[dict[str, PromptTokenLogprob] | None] | None:
        """vLLM's ``prompt_logprobs``: None for the first token, then the prompt's token and the top-N of each."""
        if self.num_prompt_logprobs is None or delta.prompt_logprobs is None:
            return None
        entries: list[dict[str, PromptTokenLogprob] | None] = [None]
        for entry in delta.prompt_logprobs:
            ranked = {entry.token_id: (entry.logprob, entry.rank)}
            for rank, (token_id, value) in enumerate(list(entry.top.items())[:self.num_prompt_logprobs], start=1):
                ranked.setdefault(token_id, (value, rank))
            entries.append({str(token_id): PromptTokenLogprob(logprob=value, rank=rank,
                                                              decoded_token=self.token_text(token_id))
                            for token_id, (value, rank) in ranked.items()})
        return entries


class ChatCompletionFormatter(_Formatter):
    """``/v1/chat/completions`` responses and chunks (``chat.completion`` / ``chat.completion.chunk``)."""

    id_prefix = "chatcmpl-"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._holding: str | None = "" if self.tool_parser is not None else None  # text held back, or None

    def opening_chunks(self) -> list[BaseModel]:
        return [self._chunk(ChatChunkChoice(index=self.index, delta={"role": "assistant", "content": ""}),
                            self._usage_so_far())]

    def delta_chunk(self, delta: OutputDelta) -> ChatCompletionChunk | None:
        self._count(delta)
        if self.tool_parser is not None and self._holding is not None:
            # Text that may still become a tool call is held back until it cannot (then it is content).
            self._holding += delta.text
            if self.tool_parser.may_be_call(self._holding):
                return None
            delta, self._holding = OutputDelta(delta.token_ids, self._holding, delta.logprobs), None
        if not self._wants_chunk(delta):
            return None
        return self._chunk(ChatChunkChoice(index=self.index, delta={"content": delta.text},
                                           logprobs=self._logprobs(delta)), self._usage_so_far())

    def finish_chunks(self, completion: Completion) -> list[ChatCompletionChunk]:
        chunks, finish_reason = [], completion.finish_reason
        if self._holding:
            content, calls = self.tool_parser.parse(self._holding)
            delta: dict = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [{"index": i, **_tool_call(call).model_dump()} for i, call in enumerate(calls)]
                finish_reason = _with_calls(finish_reason)
            if delta:
                chunks.append(self._chunk(ChatChunkChoice(index=self.index, delta=delta)))
        chunks.append(self._chunk(ChatChunkChoice(
            index=self.index, delta={}, finish_reason=finish_reason, stop_reason=completion.stop_reason),
            self._usage_so_far(completion)))
        return chunks

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[],
                                   usage=usage)

    def response(self, deltas: list[OutputDelta], completion: Completion) -> ChatCompletionResponse:
        whole = _joined(deltas)
        content, calls, finish_reason = whole.text, [], completion.finish_reason
        if self.tool_parser is not None:
            content, calls = self.tool_parser.parse(whole.text)
            finish_reason = _with_calls(finish_reason) if calls else finish_reason
        message = AssistantMessage(content=content, tool_calls=[_tool_call(call) for call in calls] or None)
        choice = ChatChoice(index=self.index, message=message, logprobs=self._logprobs(whole),
                            finish_reason=finish_reason, stop_reason=completion.stop_reason)
        return ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=[choice], usage=self.usage(completion))

    def _chunk(self, choice: ChatChunkChoice, usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice],
                                   usage=usage)

    def _logprobs(self, delta: OutputDelta) -> ChatLogprobs | None:
        per_token = self._token_logprobs(delta)
        if per_token is None:
            return None
        return ChatLogprobs(content=[self._token_logprob(token_id, candidates) for token_id, candidates in per_token])

    def _token_logprob(self, token_id: int, candidates: dict[int, float]) -> TokenLogprob:
        text = self.token_text(token_id)
        alternatives = list(candidates.items())[: self.num_logprobs]
        return TokenLogprob(token=text, logprob=candidates[token_id], bytes=list(text.encode("utf-8")),
                            top_logprobs=[self._top_logprob(other, value) for other, value in alternatives])

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def _tool_call(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _with_calls(finish_reason: str) -> str:
    """OpenAI's finish reason for an answer that called tools (one cut off at max_tokens stays "length")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def joined_responses(responses: list[CompletionResponse | ChatCompletionResponse], completions: list[Completion],
                     prompt_of: list[int]) -> CompletionResponse | ChatCompletionResponse:
    """The responses of a request's choices (in index order) as one: every choice, and the usage of all of them,
    each prompt counted once (``prompt_of``: the prompt index of each choice)."""
    whole = responses[0].model_copy(update={"choices": [r.choices[0] for r in responses]})
    whole.usage = joined_usage(completions, prompt_of)
    return whole


def joined_usage(completions: list[Completion], prompt_of: list[int]) -> Usage:
    """Usage of a request's choices: each prompt's tokens (and cached tokens) once, every choice's output."""
    prompts: dict[int, Completion] = {}  # each prompt's first choice
    for prompt_index, completion in zip(prompt_of, completions):
        prompts.setdefault(prompt_index, completion)
    prompt_tokens = sum(completion.prompt_tokens for completion in prompts.values())
    completion_tokens = sum(completion.completion_tokens for completion in completions)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=sum(completion.cached_tokens for completion in prompts.values())))


def _joined(deltas: list[OutputDelta]) -> OutputDelta:
    """All of a request's deltas as one, for a response that is not streamed."""
    has_logprobs = any(delta.logprobs is not None for delta in deltas)
    return OutputDelta(
        token_ids=[token_id for delta in deltas for token_id in delta.token_ids],
        text="".join(delta.text for delta in deltas),
        logprobs=[entry for delta in deltas for entry in delta.logprobs or []] if has_logprobs else None,
        prompt_logprobs=next((delta.prompt_logprobs for delta in deltas if delta.prompt_logprobs is not None), None),
    )
