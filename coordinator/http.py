"""The OpenAI-compatible HTTP edge of the coordinator, on the public server's event loop: the
same engine as gRPC, no extra hop.

- POST /v1/chat/completions and /v1/completions, streamed as server-sent events (`data:`
  chunks, then `data: [DONE]`) or answered whole; `usage` and the request's speculative
  decoding statistics come with the last chunk (or the whole answer).
- GET /v1/models and /v1/models/{model}; GET /health (200 while serving, else 503: for HTTP
  load balancers); GET / is a chat page that streams answers and shows which text came from
  accepted drafts.
- A request field the edge does not implement is refused (400 naming it), never ignored;
  fields clients send by default are accepted at their neutral values (see FIELDS, NEUTRAL).
- Errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) with the HTTP
  status of their kind: 400 bad input, 401 missing API key, 404 unknown model or path, 429
  queue full, 503 no target reachable.

Requests are converted into the requests part's `RequestInput` and checked by its `validate`,
as the gRPC edge's are, so both edges accept and refuse exactly the same things.
"""
import asyncio
import contextlib
import dataclasses
import json
import logging
import pathlib
import socket
import time
import uuid
from collections.abc import Callable

from aiohttp import web

from batchspec import errors, security
from batchspec.params import MAX_LOGIT_BIAS, MAX_PENALTY
from coordinator.grammar import Grammars, ResponseFormat
from coordinator.requests import Ending, Limits, RequestInput, ValidRequest, stream_events, validate
from coordinator.sequence import Finish
from coordinator.text import TextCodec

log = logging.getLogger(__name__)
PAGE = pathlib.Path(__file__).parent / "web" / "index.html"
# max_tokens when a request gives none: this many, or what the context leaves if less
# (OpenAI's own default for completions is 16).
DEFAULT_MAX_TOKENS = 256
MAX_N = 16  # most choices one request may ask for (each is a sequence of its own)
# most choices a completion's prompts together may ask for (prompts x n)
MAX_CHOICES = 64
_FINISH = {Finish.STOP: "stop", Finish.STOP_STRING: "stop", Finish.LENGTH: "length"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 429: "rate_limit_error"}


@dataclasses.dataclass(frozen=True)
class ServedModels:
    """What the page and /v1/models show: the model id clients name, and the pair."""

    model_id: str
    target: str
    drafts: tuple[str, ...]


# The request fields each endpoint implements; anything else is refused (400 naming it)
# rather than ignored, except NEUTRAL fields given their neutral value (what clients send by
# default) and `user`, which is the caller's label and never changes an answer.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "stream", "stream_options", "n", "user", "ignore_eos", "response_format",
                 "presence_penalty", "frequency_penalty", "logit_bias"}
FIELDS = {"/v1/chat/completions": COMMON_FIELDS | {"messages", "max_completion_tokens",
                                                   "logprobs", "top_logprobs"},
          "/v1/completions": COMMON_FIELDS | {"prompt", "logprobs", "echo"}}
NEUTRAL = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
           "best_of": (None, 1), "suffix": (None,),
           "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
           "function_call": (None, "none"), "parallel_tool_calls": (None,)}


def refuse_unknown_fields(path: str, body: dict) -> None:
    """HttpError 400 naming the first field of `body` the endpoint does not implement."""
    for name, value in body.items():
        if name in FIELDS[path]:
            continue
        if name in NEUTRAL and any(_same(value, v) for v in NEUTRAL[name]):
            continue
        what = "is not supported" if name in NEUTRAL else "is not a field this endpoint takes"
        raise HttpError(400, f"{name} {what} (given {json.dumps(value)[:80]}); remove it",
                        name)
    flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict)
                                    and set(options) <= {"include_usage"}
                                    and isinstance(options.get("include_usage", False), bool)):
        raise HttpError(400, "stream_options takes only include_usage (true or false)",
                        "stream_options")


def _same(value, neutral) -> bool:
    """value equals neutral, a bool only a bool (False is not 0 here, nor 0 False)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


# the request fields this edge names otherwise than the gRPC API (errors.BatchspecError.field)
_PARAMS = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt",
           "prompt_logprobs": "logprobs"}


_CHAT_PARAMS = {**_PARAMS, "logprobs": "top_logprobs", "prompt_token_ids": "messages"}


def http_param(field: str | None, chat: bool) -> str | None:
    """A request field as this edge names it (a chat's alternatives are `top_logprobs`, its
    prompt its messages)."""
    return (_CHAT_PARAMS if chat else _PARAMS).get(field, field)


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape; `code`: OpenAI's word for what clients act on (a request too
    long for the context: context_length_exceeded), else the HTTP status."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind,
                      "param": param, "code": code or status}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param, code), status=status)


class HttpEdge:
    def __init__(self, router, limits: Limits, codec: TextCodec | None, models: ServedModels,
                 api_key: str | None = None, grammars: Grammars | None = None, *,
                 serving: Callable[[], bool]):
        self.router = router
        # what GET /health answers: the public server's health (a target takes requests, and
        # the server is not draining)
        self.serving = serving
        self.limits = limits
        self.codec = codec
        self.grammars = grammars
        self.models = models
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_get("/", self.page)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model}", self.retrieve_model)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving, else 503: a probe for HTTP load balancers (no API key)."""
        if self.serving():
            return web.json_response({"status": "serving"})
        return error_response(503, "not serving: no target takes requests, or the server is "
                                   "stopping")

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every refusal in OpenAI's shape; the API key checked on /v1/ paths."""
        if request.path.startswith("/v1/") and self._expected is not None and \
                not security.bearer_matches(request.headers.get("Authorization", ""),
                                            self._expected):
            return error_response(401, "missing or wrong API key: send 'Authorization: "
                                       "Bearer <key>'")
        try:
            return await handler(request)
        except HttpError as error:
            return error_response(error.status, str(error), error.param)
        except errors.BatchspecError as error:
            param = http_param(error.field, request.path.endswith("/chat/completions"))
            message = str(error) if param == error.field else \
                str(error).replace(error.field, param)
            code = "context_length_exceeded" \
                if isinstance(error, errors.ContextLengthExceeded) else None
            return error_response(errors.to_http_status(error), message, param, code)
        except web.HTTPException as error:
            return error_response(error.status, error.reason or "not found")

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(text=PAGE.read_text(), content_type="text/html")

    async def list_models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model()]})

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """The served model by the id clients name (its own, or "batchspec"), else 404."""
        self._check_model(request.match_info["model"])
        return web.json_response(self._model())

    def _model(self) -> dict:
        return {"id": self.models.model_id, "object": "model", "created": 0,
                "owned_by": "batchspec",
                "batchspec": {"target": self.models.target, "drafts": list(self.models.drafts)}}

    def _check_model(self, model: str | None) -> None:
        """HttpError 404 unless `model` names the served model (None: a request naming none)."""
        if model not in (None, self.models.model_id, "batchspec"):
            raise HttpError(404, f"the model {model!r} is not served here; this server serves "
                                 f"{self.models.model_id!r}", "model")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        given = self._request(request.path, body)
        wanted, top = flag(body, "logprobs"), optional_number(body, "top_logprobs", int)
        if top is not None and not wanted:
            raise HttpError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        given = dataclasses.replace(given, messages=chat_messages(body.get("messages")),
                                    logprobs=(top or 0) if wanted else None)
        return await self._answer(request, body, [given], chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        given = self._request(request.path, body)
        # legacy logprobs: the number of alternatives per token (0: only the token's own)
        top = optional_number(body, "logprobs", int)
        given = dataclasses.replace(given, logprobs=top,
                                    prompt_logprobs=top if flag(body, "echo") else None)
        prompts = [dataclasses.replace(given, prompt=p) if isinstance(p, str)
                   else dataclasses.replace(given, prompt_token_ids=tuple(p))
                   for p in completion_prompts(body.get("prompt"))]
        return await self._answer(request, body, prompts, chat=False)

    def _request(self, path: str, body: dict) -> RequestInput:
        """The sampling and length fields of an OpenAI request (other fields refused)."""
        refuse_unknown_fields(path, body)
        self._check_model(body.get("model"))
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list)
                                     and all(isinstance(s, str) for s in stop)):
            raise HttpError(400, "stop must be a string or a list of strings", "stop")
        return RequestInput(
            # 0: the default, which validate() sets once the prompt's length is known
            max_new_tokens=0 if max_tokens is None else number(max_tokens, "max_tokens", int, 1),
            # OpenAI samples at temperature 1 unless told otherwise
            temperature=number(body.get("temperature", 1.0), "temperature", float, 0),
            top_p=optional_number(body, "top_p", float),
            top_k=optional_number(body, "top_k", int),  # an extension, as in vLLM
            seed=optional_number(body, "seed", int), stop=tuple(stop or ()),
            ignore_eos=flag(body, "ignore_eos"),  # an extension, as in vLLM
            response_format=response_format(body.get("response_format")),
            presence_penalty=penalty(body, "presence_penalty"),
            frequency_penalty=penalty(body, "frequency_penalty"),
            logit_bias=logit_bias(body.get("logit_bias")))

    async def _answer(self, request: web.Request, body: dict, prompts: list[RequestInput],
                      chat: bool):
        """Answer whole or streamed, n choices for each of the prompts (a completion may
        send several; chat one); one log line per request, as the gRPC edge writes."""
        ending = Ending("http", request.headers.get("X-Request-Id", ""), time.monotonic())
        try:
            return await self._respond(request, body, prompts, chat, ending)
        except errors.BatchspecError as error:
            ending.fail(error, admitted=ending.seq is not None)
            raise
        except (asyncio.CancelledError, ConnectionError):  # the client went away
            ending.reason = "cancelled"
            raise
        finally:
            ending.log()

    def _reply(self, body: dict, prompts: list[RequestInput], chat: bool, ending: Ending):
        """(the Reply of n choices for each prompt, choice p * n + j prompt p's j-th; the
        prompts validated; n), or HttpError for a request that cannot be answered."""
        n = number(body.get("n", 1), "n", int, 1)
        if n > MAX_N:
            raise HttpError(400, f"n must be <= {MAX_N}, not {n}", "n")
        if n * len(prompts) > MAX_CHOICES:
            raise HttpError(400, f"{len(prompts)} prompts x n = {n} asks for "
                                 f"{n * len(prompts)} choices; at most {MAX_CHOICES}", "prompt")
        valid = [validate(given, self.limits, self.codec,
                          default_max_new_tokens=DEFAULT_MAX_TOKENS, grammars=self.grammars)
                 for given in prompts]
        echoing = flag(body, "echo")
        if (valid[0].logprobs is not None or echoing) and self.codec is None:
            raise HttpError(400, "logprobs and echo need a tokenizer; this coordinator has none",
                            "logprobs")
        scores = []
        for given, checked in zip(prompts, valid):
            echo = None
            if echoing:
                echo = given.prompt or self.codec.decode(checked.prompt_token_ids,
                                                         skip_special_tokens=False)
            scores += [Scores(self.codec, checked.logprobs is not None,
                              checked.prompt_token_ids, echo) for _ in range(n)]
        reply = Reply(self.models.model_id, chat,
                      sum(len(v.prompt_token_ids) for v in valid), ending, scores)
        return reply, valid, n

    async def _respond(self, request: web.Request, body: dict, prompts: list[RequestInput],
                       chat: bool, ending: Ending):
        reply, valid, n = self._reply(body, prompts, chat, ending)
        # a prompt's n choices go to one target, which caches their prompt once
        streams = [stream_events(self.router, choice_request(checked, j), self.codec,
                                 on_admitted=ending.admitted,
                                 together=(id(reply), p) if n > 1 else None)
                   for p, checked in enumerate(valid) for j in range(n)]
        try:
            if not flag(body, "stream"):
                await all_or_none(reply.consume(i, s) for i, s in enumerate(streams))
                return web.json_response(reply.whole())
            # every choice's first event (refusals, queue full, come before any byte is sent)
            firsts = await all_or_none(anext(s) for s in streams)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                   "Cache-Control": "no-cache"})
            try:
                await response.prepare(request)
                for i, first in enumerate(firsts):
                    await send(response, reply.chunk(i, first))
                # closed (its pumps stopped) before the streams are, below
                async with contextlib.aclosing(merge(streams)) as merged:
                    async for i, event in merged:
                        await send(response, reply.chunk(i, event))
                if (body.get("stream_options") or {}).get("include_usage"):
                    await send(response, reply.usage_chunk())
            except errors.BatchspecError as error:  # after the first byte: an error event
                ending.fail(error, admitted=True)
                await send(response, error_body(errors.to_http_status(error), str(error)))
            except ConnectionError:  # the client went away: its requests are cancelled below
                ending.reason = "cancelled"
                return response
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            for events in streams:
                await events.aclose()  # a client gone mid-answer cancels its requests


def choice_request(valid: ValidRequest, index: int) -> ValidRequest:
    """The request of choice `index` of n: choice 0 as given, the others with seeds of their
    own (seed + index), so that sampled choices differ and a seeded request repeats."""
    if index == 0:
        return valid
    seed = (valid.sampling.seed + index) % 2**64
    return dataclasses.replace(valid, sampling=dataclasses.replace(valid.sampling, seed=seed))


async def all_or_none(awaitables) -> list:
    """Await them all at once; when one fails, the others are cancelled and waited for (so
    that no stream is still running when it is closed) and the failure is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await stop(tasks)
        raise


async def stop(tasks) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def merge(streams):
    """(index, event) from every stream but its first event (already taken), as they come;
    the first error raised by any stream is raised here."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, events):
        try:
            async for event in events:
                await queue.put((index, event, None))
        except Exception as error:  # noqa: BLE001 (handed to the consumer)
            await queue.put((index, None, error))
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, event, error = await queue.get()
            if error is not None:
                raise error
            if event is None:
                open_streams -= 1
                continue
            yield index, event
    finally:
        await stop(tasks)  # each stream idle again before it is closed


class Choice:
    """One choice of an answer: its text, tokens and statistics so far."""

    def __init__(self, index: int, scores: "Scores"):
        self.index = index
        self.scores = scores
        self.logprobs: list = []  # every event's, in order (the whole answer's)
        self.prompt_logprobs = None  # the first event's, with echo
        self.text, self.tokens, self.drafted, self.accepted = "", 0, 0, 0
        self.passes = 0  # target forward passes (RequestStats.num_target_forward_passes)
        self.events = 0
        self.finish: str | None = None
        self.sent_role = False

    def add(self, event) -> None:
        self.logprobs += event.logprobs or []
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        self.text += event.text
        self.tokens += len(event.token_ids)
        self.drafted += event.num_drafted
        self.accepted += event.num_accepted
        self.passes += event.num_passes
        self.events += 1
        if event.finish is not None:
            self.finish = _FINISH[event.finish]

    def delta(self, event, chat: bool) -> dict:
        """This event as the choice of a chunk."""
        first = self.events == 0
        self.add(event)
        if chat:
            delta = {"content": event.text}
            if not self.sent_role:
                delta["role"], self.sent_role = "assistant", True
            return {"index": self.index, "delta": delta,
                    "logprobs": self.scores.chat(event.logprobs),
                    "finish_reason": self.finish}
        echoed = self.scores.echo if first and self.scores.echo is not None else ""
        return {"index": self.index, "text": echoed + event.text,
                "logprobs": self.scores.completion(event.logprobs, event.prompt_logprobs
                                                   if first else None),
                "finish_reason": self.finish}

    def whole(self, chat: bool) -> dict:
        if chat:
            return {"index": self.index,
                    "message": {"role": "assistant", "content": self.text},
                    "logprobs": self.scores.chat(self.logprobs), "finish_reason": self.finish}
        return {"index": self.index, "text": (self.scores.echo or "") + self.text,
                "logprobs": self.scores.completion(self.logprobs, self.prompt_logprobs),
                "finish_reason": self.finish}


class Reply:
    """One request's answer (n choices), in OpenAI's shapes, built from engine events."""

    def __init__(self, model_id: str, chat: bool, prompt_tokens: int,
                 ending: Ending | None = None, scores: "list[Scores] | None" = None):
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.ending = ending  # told when the request finishes
        self.choices = [Choice(i, s) for i, s in
                        enumerate(scores or [Scores(None, False, [], None)])]
        self.created = int(time.time())
        self.model = model_id
        self.chat = chat
        self.prompt_tokens = prompt_tokens

    async def consume(self, index: int, events) -> None:
        async for event in events:
            self._finished(event)
            self.choices[index].add(event)

    def _finished(self, event) -> None:
        if event.finish is not None and self.ending is not None:
            self.ending.reason = f"finished ({event.finish.value})"

    def chunk(self, index: int, event) -> dict:
        self._finished(event)
        choice = self.choices[index].delta(event, self.chat)
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat
               else "text_completion", "created": self.created, "model": self.model,
               "choices": [choice],
               # extension: what this step's drafts achieved (the page colours draft_text)
               "batchspec": {"tokens": len(event.token_ids), "draft_tokens": event.num_drafted,
                             "accepted_draft_tokens": event.num_accepted,
                             "draft_text": event.draft_text}}
        if all(c.finish is not None for c in self.choices):  # the last chunk of all
            out.update(self.usage())
        return out

    def usage_chunk(self) -> dict:
        """The last chunk a client asking for stream_options.include_usage expects."""
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat
                else "text_completion", "created": self.created, "model": self.model,
                "choices": [], **self.usage()}

    def whole(self) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [c.whole(self.chat) for c in self.choices], **self.usage()}

    def usage(self) -> dict:
        tokens = sum(c.tokens for c in self.choices)
        drafted = sum(c.drafted for c in self.choices)
        accepted = sum(c.accepted for c in self.choices)
        passes = sum(c.passes for c in self.choices)
        return {"usage": {"prompt_tokens": self.prompt_tokens,
                          "completion_tokens": tokens,
                          "total_tokens": self.prompt_tokens + tokens},
                "speculative_decoding": {
                    "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                    "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                    # tokens per target forward pass (accepted drafts + the target's own)
                    "mean_acceptance_length": round(tokens / passes, 3) if passes else None,
                    "num_target_forward_passes": passes}}


class Scores:
    """Log-probabilities in OpenAI's two shapes, token texts from the codec. `echo`: the
    prompt's text when a completion echoes it (its tokens' log-probabilities lead the list,
    the first token's null)."""

    def __init__(self, codec: TextCodec | None, logprobs: bool, prompt_token_ids: list[int],
                 echo: str | None):
        self.codec = codec
        self.wanted = logprobs
        self.prompt_token_ids = prompt_token_ids
        self.echo = echo
        self.offset = 0  # text_offset of the next token, in the text returned

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.codec.token_text(token_id)
        return {"token": text, "logprob": logprob,
                "bytes": list(self.codec.token_bytes(token_id))}

    def chat(self, scored) -> dict | None:
        """choices[].logprobs of a chat completion (or chunk)."""
        if not self.wanted:
            return None
        return {"content": [{**self._entry(t.token_id, t.logprob),
                             "top_logprobs": [self._entry(i, v) for i, v in t.top]}
                            for t in scored or []]}

    def completion(self, scored, prompt_scored=None) -> dict | None:
        """choices[].logprobs of a completion (or chunk); prompt_scored: the prompt's, when
        echoed (the first chunk)."""
        if not self.wanted:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt_scored is not None and self.echo is not None:
            self._add(out, self.prompt_token_ids[0], None, None)
            for t in prompt_scored:
                self._add(out, t.token_id, t.logprob, t.top)
        for t in scored or []:
            self._add(out, t.token_id, t.logprob, t.top)
        return out

    def _add(self, out: dict, token_id: int, logprob, top) -> None:
        text = self.codec.token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if top is None else
                                   {self.codec.token_text(i): v for i, v in top})
        out["text_offset"].append(self.offset)
        self.offset += len(text)


async def send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HttpError(400, "the request body is not JSON")
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    return body


def number(value, name: str, kind, minimum):
    """value as int or float, at least `minimum`; HttpError 400 naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not float(value).is_integer()) or value < minimum:
        raise HttpError(400, f"{name} must be a{'n integer' if kind is int else ' number'} "
                             f">= {minimum}, not {value!r}", name)
    return kind(value)


def optional_number(body: dict, name: str, kind):
    """body[name] checked as by number() with a minimum of 0; None when absent or null."""
    return None if body.get(name) is None else number(body[name], name, kind, 0)


def penalty(body: dict, name: str) -> float | None:
    """body[name], a presence or frequency penalty, as a float in OpenAI's range; None when
    absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not abs(value) <= MAX_PENALTY:
        raise HttpError(400, f"{name} must be a number in [-{MAX_PENALTY:g}, "
                             f"{MAX_PENALTY:g}], not {value!r}", name)
    return float(value)


def logit_bias(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object of token ids (as strings) to numbers."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise HttpError(400, "logit_bias must be an object of token ids to numbers",
                        "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not key.strip().isdigit() or isinstance(bias, bool) \
                or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:
            raise HttpError(400, f"logit_bias must map token ids to numbers in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], not {key!r}: "
                                 f"{bias!r}", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def flag(body: dict, name: str) -> bool:
    """body[name] as a bool (False when absent or null); HttpError 400 if not a bool."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise HttpError(400, f"{name} must be true or false, not {value!r}", name)
    return bool(value)


def response_format(value) -> ResponseFormat | None:
    """OpenAI's response_format: text (None), json_object, or json_schema (its `schema`;
    enforced whether `strict` or not)."""
    def bad(message):
        return HttpError(400, f"response_format {message}", "response_format")

    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object",
                                                                 "json_schema"):
        raise bad('must be {"type": "text"}, {"type": "json_object"} or {"type": '
                  '"json_schema", "json_schema": {"name": ..., "schema": {...}}}')
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    if set(value) - allowed:
        raise bad(f"{kind} takes no {', '.join(sorted(set(value) - allowed))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad("json_schema needs json_schema.schema, a JSON schema object")
    extra = set(spec) - {"name", "schema", "strict", "description"}
    if extra:
        raise bad(f"json_schema takes no {', '.join(sorted(extra))}")
    return ResponseFormat("json_schema", json.dumps(spec["schema"]))


def completion_prompts(prompt) -> list:
    """A completion's prompts as OpenAI takes them: a string, a list of token ids, or a
    non-empty list of either (a batch, each answered as a request of its own)."""
    def one(p) -> bool:
        return isinstance(p, str) or (isinstance(p, list) and bool(p)
                                      and all(type(t) is int for t in p))

    if one(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(one(p) for p in prompt):
        return prompt
    raise HttpError(400, "prompt must be a string, a list of token ids, or a list of either",
                    "prompt")


def chat_messages(messages) -> tuple[tuple[str, str], ...]:
    """OpenAI chat messages (content a string, or a list of text parts) as (role, content);
    a `developer` message (OpenAI's name for system instructions to newer models) is the
    template's `system` one."""
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages must be a non-empty list", "messages")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise HttpError(400, "each message needs a role and a content", "messages")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise HttpError(400, "only text content is supported", "messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise HttpError(400, "each message needs a role and a content", "messages")
        role = "system" if message["role"] == "developer" else message["role"]
        out.append((role, content))
    return tuple(out)


async def start(edge: HttpEdge, host: str, port: int, ssl=None):
    """Serve the edge on host:port (0: a free port), on the running loop; HTTPS with an
    ssl.SSLContext. Returns (runner, port); `await runner.cleanup()` stops it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise errors.address_refused("HTTP", host, port, error) from None
    # a client that goes away cancels its handler, so an answer it no longer waits for (one
    # not streamed too) stops at once, its requests cancelled and their caches freed
    runner = web.AppRunner(edge.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.SockSite(runner, sock, ssl_context=ssl).start()
    return runner, sock.getsockname()[1]
