"""An OpenAI-compatible HTTP server over the engine.

The standard library's ThreadingHTTPServer, as mlx_lm.server uses: the work is one generation
at a time on one engine (its cache is the prompt cache), so an asynchronous stack would add a
dependency and buy nothing. One thread per connection parses and checks the request, then
queues it; one worker thread owns the engine and generates for the queued requests in turn,
handing each its responses through a queue of its own, so two requests' tokens never mix.
A client that disconnects is noticed at the next token (or within 50 ms while it waits) and its
generation stops within a step."""

import difflib
import hmac
import json
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import List, Optional, Sequence

import mlx.core as mx

from .. import __version__
from ..api import Responses, count, sampling_and_seed
from ..batch import BatchEngine
from ..cache import common_prefix_length
from ..engine import GenerationOptions
from ..errors import MlxSpecError, RanksLost
from ..events import Done, Failed, Prefilling
from ..models.checkpoint import one_line
from . import anthropic
from .disk_cache import DEFAULT_MAX_BYTES as DEFAULT_DISK_BYTES
from .disk_cache import DiskCache, default_directory, model_identity
from .output import (
    Delta,
    Reply,
    ReplySplitter,
    initial_state,
    text_machine,
    token_logprobs,
    token_texts,
    usage,
)
from .protocol import Request, RequestError, parse
from .sessions import SessionCache

PAGE = Path(__file__).with_name("page.html")  # GET /: the chat page (one file: HTML, CSS, JS)

POLL_SECONDS = 0.05
KEEP_ALIVE_SECONDS = 1.0
RETRY_AFTER_SECONDS = 1


END = object()  # a job's last message: nothing more comes


class Job:
    """One queued request: the prompt's tokens and settings in; out through `events`, its
    GenerationResponses (or a RequestError), then END."""

    def __init__(self, request: Request, tokens, max_tokens: int, options: GenerationOptions):
        self.request, self.tokens, self.max_tokens, self.options = request, tokens, max_tokens, options
        self.events: "queue.Queue" = queue.Queue()
        self.cancelled = threading.Event()


class Worker(threading.Thread):
    """Owns the engine: loads it (MLX's streams belong to the thread that made them, as in
    mlx_lm.server), then generates for one job at a time, in the order they came."""

    def __init__(
        self,
        load,
        max_sessions: int,
        max_cache_bytes: int,
        log,
        max_batch: int = 1,
        prompt_cache_dir: Optional[str] = None,
        prompt_cache_disk_bytes: int = DEFAULT_DISK_BYTES,
    ):
        super().__init__(name="mlx-spec-worker", daemon=True)
        self.load, self.max_sessions, self.max_cache_bytes, self.log = (
            load,
            max_sessions,
            max_cache_bytes,
            log,
        )
        self.prompt_cache_dir, self.prompt_cache_disk_bytes = prompt_cache_dir, prompt_cache_disk_bytes
        self.max_batch = max_batch
        self.batch: Optional[BatchEngine] = None
        self.jobs: "queue.Queue" = queue.Queue()
        self.stopping = threading.Event()
        self.loaded = threading.Event()
        self.load_error: Optional[MlxSpecError] = None
        self.fatal: Optional[RanksLost] = None  # the server cannot go on

    def start_engine(self):
        """Start the thread and wait for the engine (an api.Loaded); its loading error, if any,
        is raised here."""
        self.start()
        self.loaded.wait()
        if self.load_error is not None:
            raise self.load_error
        return self.loaded_model

    def run(self):
        try:
            self._run()
        finally:  # by this thread, else the process may abort as it exits (MLX 0.32, mlx#4327)
            mx.clear_streams()

    def _run(self):
        try:
            self.loaded_model = self.load()
            self.engine = self.loaded_model.engine
        except MlxSpecError as e:
            self.load_error = e
        except Exception as e:
            self.load_error = MlxSpecError(f"cannot load the model: {one_line(e)}")
        if self.load_error is not None:
            self.loaded.set()
            return
        self.tokenizer = self.engine.target.tokenizer
        if self.max_batch > 1:
            reason = self.engine.unbatchable()
            chains = self.engine.with_chain_drafts() if self.engine.drafter.tree else None
            if reason is not None and chains is not None and chains.unbatchable() is None:
                self.log(f"{reason}: the batch drafts this source's chains (its trees' best paths)")
                self.engine, reason = chains, None
            if reason is None:
                self.batch = BatchEngine.spawned(self.engine, self.max_batch)
            else:
                self.log(f"batching off: {reason}; requests run one at a time")
        self.sessions = SessionCache(self.engine, self.max_sessions, self.max_cache_bytes, self._disk_cache())
        self.loaded.set()
        try:
            if self.batch is not None:
                self._serve_batched()
            else:
                self._serve_one_at_a_time()
        finally:
            self.sessions.flush(self.batch.engines if self.batch is not None else [self.engine])
            self.engine.close()  # here: MLX's streams belong to this thread
        while True:  # stopped: whoever still waits is told so
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.events.put(RequestError(503, "the server is shutting down", kind="server_error"))
                job.events.put(END)

    def _disk_cache(self) -> Optional[DiskCache]:
        """The prompt cache on disk: prompt_cache_dir, "" for the default one of this model,
        None for none."""
        if self.prompt_cache_dir is None:
            return None
        target = self.engine.target
        identity = model_identity(target)
        if identity is None:
            self.log("prompt cache on disk: off (the model has no directory to name it by)")
            return None
        directory = (
            Path(self.prompt_cache_dir).expanduser()
            if self.prompt_cache_dir
            else default_directory(target, identity)
        )
        try:
            disk = DiskCache(directory, target, identity, self.prompt_cache_disk_bytes, self.log)
        except OSError as e:
            self.log(f"prompt cache on disk: off (cannot use {directory}: {one_line(e)})")
            return None
        self.log(f"prompt cache on disk: {directory} ({disk.stats['entries']} conversations)")
        return disk

    def _next_job(self, block: bool) -> Optional[Job]:
        """The next queued job still wanted (None: none queued, or stopping)."""
        while not self.stopping.is_set():
            try:
                job = self.jobs.get(block=block)
            except queue.Empty:
                return None
            if job is None:
                return None
            if not job.cancelled.is_set():
                return job
            self.log("client gone: generation stopped before it started")  # it left while queued
            job.events.put(END)
        return None

    def _serve_one_at_a_time(self) -> None:
        while True:
            job = self._next_job(block=True)
            if job is None:
                return
            self._generate(job)
            job.events.put(END)

    def _serve_batched(self) -> None:
        """Up to max_batch requests at once, one target pass per step for all of them; a new
        request joins between two steps, a finished or cancelled one leaves."""
        batch, active = self.batch, {}  # id(row) -> (row, job, Responses)
        while not self.stopping.is_set():
            while batch.idle:
                job = self._next_job(block=not active)
                if job is None:
                    break
                self._start(job, active)
            try:
                events = batch.step()
            except Exception as e:  # the pass itself failed: every request in it fails, the server serves on
                error = _request_error(e, self.log)
                for row, job, _ in active.values():
                    batch.remove(row)
                    job.events.put(error)
                    job.events.put(END)
                active.clear()
                continue
            for row, event in events:
                _, job, responses = active[id(row)]
                if isinstance(event, Failed):
                    job.events.put(_request_error(event.error, self.log))
                else:
                    for response in responses.add(event):
                        job.events.put(response)
                    if isinstance(event, Prefilling):
                        job.events.put(event)
                    if not isinstance(event, Done):
                        continue
                    job.events.put(responses.last())
                    self.sessions.keep(row.engine.detach())
                job.events.put(END)
                del active[id(row)]
            for row, job, _ in list(active.values()):
                if job.cancelled.is_set():
                    batch.remove(row)
                    self.log("client gone: generation stopped")
                    job.events.put(END)
                    del active[id(row)]
        for row, job, _ in active.values():  # stopped
            batch.remove(row)
            self.log("stopped")
            job.events.put(END)

    def _start(self, job: Job, active: dict) -> None:
        """Add a job to the batch, on the idle engine that holds most of its prompt."""
        request, batch = job.request, self.batch
        engine = max(batch.idle, key=lambda e: common_prefix_length(e.cached_tokens, job.tokens))
        try:
            self.sessions.prepare(job.tokens, engine)
            params, seed = sampling_and_seed(engine, request.seed, request.sampling)
        except MlxSpecError as e:
            job.events.put(RequestError(400, str(e)))
            job.events.put(END)
            return
        row = batch.add(job.tokens, job.max_tokens, request.stop, params, seed, job.options, engine=engine)
        active[id(row)] = (row, job, Responses())

    def _generate(self, job: Job) -> None:
        request, responses = job.request, Responses()
        try:
            self.sessions.prepare(job.tokens)
            params, seed = sampling_and_seed(self.engine, request.seed, request.sampling)
            for event in self.engine.generate(
                job.tokens, job.max_tokens, request.stop, params, seed, job.options
            ):
                for response in responses.add(event):
                    job.events.put(response)
                if isinstance(event, Prefilling):
                    job.events.put(event)
                if job.cancelled.is_set() or self.stopping.is_set():
                    self.log("client gone: generation stopped" if job.cancelled.is_set() else "stopped")
                    return  # closes the generator at this event: the cache stays consistent
            job.events.put(responses.last())
        except Exception as e:  # never a traceback to the client; the server keeps serving
            job.events.put(_request_error(e, self.log))
            if isinstance(e, RanksLost):  # ... but over a split target that lost a rank
                self.fatal = e
                self.log(f"error: {e}")
                os.kill(os.getpid(), signal.SIGTERM)  # serve stops as on SIGTERM, then says why

    def stop(self) -> None:
        self.stopping.set()
        self.jobs.put(None)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address,
        load,
        model_name: str,
        max_tokens: int = 512,
        api_key: Optional[str] = None,
        max_body_bytes: int = 1 << 20,
        max_sessions: int = 10,
        max_cache_bytes: int = 1 << 30,
        max_batch: int = 1,
        backlog: int = socket.SOMAXCONN,
        max_queued: int = 256,
        allowed_origins: Sequence[str] = (),
        chat_template_args: Optional[dict] = None,
        prompt_cache_dir: Optional[str] = None,
        prompt_cache_disk_bytes: int = DEFAULT_DISK_BYTES,
        log=None,
        ui: bool = True,
    ):
        """load: () -> api.Loaded (the engine and the source it runs), called on the worker
        thread (errors raised here, before serving).
        backlog: connections the kernel holds before they are accepted (socketserver's default
        of 5 resets a burst of parallel requests); max_queued: requests waiting for the engine
        past which a request gets a 503 with Retry-After instead of waiting; prompt_cache_dir:
        where conversations go on disk ("": the model's default directory; None: nowhere),
        prompt_cache_disk_bytes: the most they take there."""
        self.request_queue_size = backlog  # read by server_activate's listen()
        self.max_queued = max_queued
        super().__init__(address, Handler)
        # One model is served whatever name a request gives (as llama.cpp's server does: apps
        # with a fixed model name work); replies name the served one.
        self.model_name = model_name
        self.max_tokens, self.api_key, self.max_body_bytes = max_tokens, api_key, max_body_bytes
        self.ui = ui  # GET / serves the chat page
        self.allowed_origins = set(allowed_origins)  # CORS: browser pages of these origins ("*": any)
        self.chat_template_args = dict(chat_template_args or {})
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.worker = Worker(
            load,
            max_sessions,
            max_cache_bytes,
            self.log,
            max_batch,
            prompt_cache_dir,
            prompt_cache_disk_bytes,
        )
        try:
            loaded = self.worker.start_engine()
        except BaseException:
            self.server_close()
            raise
        self.loaded, self.engine = loaded, loaded.engine  # loaded.draft: the source served (what auto chose)
        self.tokenizer, self.sessions = self.worker.tokenizer, self.worker.sessions
        self.machine, self.token_text = text_machine(self.tokenizer), token_texts(self.tokenizer)

    def shutdown_worker(self) -> None:
        self.worker.stop()
        self.worker.join(timeout=10)

    def tokens_for(self, request: Request):
        """The prompt's token ids: the chat template applied to messages, with the tools it
        renders and its arguments (the server's --chat-template-args, then the request's
        chat_template_kwargs); a reply due to begin with a tool call (tool_choice required or
        named) gets the tool-call marker after the template's generation prompt."""
        tokenizer = self.tokenizer
        if request.chat:
            if not getattr(tokenizer, "chat_template", None):
                raise RequestError(
                    400, "the served model has no chat template: use /v1/completions", "messages"
                )
            if request.tools and not tokenizer.has_tool_calling:
                raise RequestError(
                    400,
                    "the served model's chat template has no tool calling: drop 'tools' "
                    "(or use a model whose template renders them)",
                    "tools",
                )
            template = dict(self.chat_template_args, **request.chat_template_kwargs)
            try:
                if request.tool_choice != "required":
                    return list(
                        tokenizer.apply_chat_template(
                            request.messages, add_generation_prompt=True, tools=request.tools, **template
                        )
                    )
                text = tokenizer.apply_chat_template(
                    request.messages,
                    add_generation_prompt=True,
                    tools=request.tools,
                    tokenize=False,
                    **template,
                )
                return list(tokenizer.encode(text + tokenizer.tool_call_start, add_special_tokens=False))
            except Exception as e:  # a template that rejects the conversation (roles, order)
                raise RequestError(
                    400, f"the chat template rejects these messages: {one_line(e)}", "messages"
                ) from None
        if isinstance(request.prompt, list):
            if max(request.prompt) >= self.engine.target.vocab_size:
                raise RequestError(
                    400,
                    f"'prompt' has a token id past the vocabulary ({self.engine.target.vocab_size})",
                    "prompt",
                )
            return request.prompt
        return list(tokenizer.encode(request.prompt))

    def options_for(self, request: Request) -> GenerationOptions:
        """The generation's logits processors (mlx-lm's, from the penalties and logit_bias),
        logprobs and prediction."""
        from mlx_lm.sample_utils import make_logits_processors

        bias = request.penalties.get("logit_bias", {})
        if any(not 0 <= t < self.engine.target.vocab_size for t in bias):
            raise RequestError(
                400,
                f"'logit_bias' has a token id past the vocabulary ({self.engine.target.vocab_size})",
                "logit_bias",
            )
        prediction = request.prediction
        return GenerationOptions(
            logits_processors=tuple(make_logits_processors(**request.penalties)) if request.penalties else (),
            logprobs=request.logprobs,
            prediction=tuple(self.tokenizer.encode(prediction, add_special_tokens=False))
            if prediction
            else (),
        )


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"mlx-spec/{__version__}"
    server: Server

    def log_message(self, format, *args):  # one line per request is written by _log instead
        pass

    def _log(self, status: int, extra: str = "") -> None:
        self.server.log(f"{self.command} {self.path} {status}{' ' + extra if extra else ''}")

    # --- replies -----------------------------------------------------------------------
    def _send_json(self, status: int, obj: dict, headers=()) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _send_error(self, error: RequestError) -> None:
        retry = () if error.retry_after is None else (("Retry-After", str(error.retry_after)),)
        self._send_json(error.status, anthropic.error_body(error) if self._anthropic else error.body(), retry)
        self._log(error.status, error.message)

    def _sse(self, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _client_gone(self) -> bool:
        """Whether the client closed its connection (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def end_headers(self):
        """Every response says whether a browser page of the request's origin may read it (CORS:
        --allowed-origins; none by default, so a page elsewhere cannot reach a local server)."""
        origin, allowed = self.headers.get("Origin") if self.headers else None, self.server.allowed_origins
        if origin and ("*" in allowed or origin in allowed):
            self.send_header("Access-Control-Allow-Origin", "*" if "*" in allowed else origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

    # --- routes ------------------------------------------------------------------------
    def do_OPTIONS(self):
        """A browser's CORS preflight: allowed origins are told what they may send."""
        origin, allowed = self.headers.get("Origin"), self.server.allowed_origins
        self.close_connection = True
        if not origin or not ("*" in allowed or origin in allowed):
            self._send_error(
                RequestError(
                    403,
                    f"origin {origin!r} is not allowed here (serve --allowed-origins)",
                    code="origin_not_allowed",
                )
            )
            return
        self.send_response(204)
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header(
            "Access-Control-Allow-Headers",
            self.headers.get("Access-Control-Request-Headers", "Authorization, Content-Type"),
        )
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()
        self._log(204)

    def do_GET(self):
        routes = {"/health": self._health, "/v1/models": self._models}
        if self.server.ui:
            routes[""] = self._page  # GET /: the chat page
        self._route(routes)

    def _page(self) -> None:
        body = PAGE.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.write(body)
        self._log(200)

    def do_POST(self):
        self._route(
            {
                "/v1/chat/completions": lambda: self._complete(chat=True),
                "/v1/completions": lambda: self._complete(chat=False),
                "/v1/messages": self._messages,
                "/v1/messages/count_tokens": self._count_tokens,
            }
        )

    @property
    def _anthropic(self) -> bool:
        """A request of Anthropic's Messages API (its errors have Anthropic's shape)."""
        return self.path.split("?", 1)[0].rstrip("/").startswith("/v1/messages")

    def _route(self, routes) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if path not in routes:
                raise RequestError(404, f"no route {self.command} {path}", code="not_found")
            if path not in ("/health", ""):  # the page asks for the key itself, then sends it
                self._authorize()
            routes[path]()
        except RequestError as e:
            self.close_connection = True
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _authorize(self) -> None:
        """--api-key as OpenAI's clients send it (Authorization: Bearer) or Anthropic's (x-api-key)."""
        key = self.server.api_key
        if key is None:
            return
        bearer = self.headers.get("Authorization", "")
        given = bearer[7:] if bearer.startswith("Bearer ") else self.headers.get("x-api-key", "")
        if not (given and hmac.compare_digest(given.encode(), key.encode())):
            raise RequestError(
                401,
                "a valid API key is required: 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                code="invalid_api_key",
            )

    def _health(self) -> None:
        sessions = self.server.sessions
        self._send_json(
            200,
            {
                "status": "ok",
                "model": self.server.model_name,
                "draft": self.server.loaded.draft,
                "queued": self.server.worker.jobs.qsize(),
                "prompt_cache": {
                    "sessions": len(sessions.stored),
                    "bytes": sessions.nbytes,
                    "max_bytes": sessions.max_bytes,
                    "disk": sessions.disk.stats if sessions.disk else None,
                },
            },
        )

    def _models(self) -> None:
        self._send_json(
            200,
            {
                "object": "list",
                "data": [
                    {"id": self.server.model_name, "object": "model", "created": 0, "owned_by": "mlx-spec"}
                ],
            },
        )
        self._log(200)

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError(411 if length is None else 400, "the request needs a Content-Length")
        if int(length) > self.server.max_body_bytes:
            raise RequestError(
                413, f"the request body is over {self.server.max_body_bytes} bytes", code="request_too_large"
            )
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {one_line(e)}") from None

    def _complete(self, chat: bool) -> None:
        request = parse(self._read_body(), chat)
        job = self._submit(request)
        try:
            (self._stream if request.stream else self._whole)(job, Reply(request, self.server.model_name))
        finally:
            job.cancelled.set()  # whatever ended the reply, the worker stops at its next token

    def _messages(self) -> None:
        request = anthropic.parse(self._read_body())
        job = self._submit(request)
        try:
            reply = anthropic.MessageReply(self.server.model_name, request.stop)
            (self._message_stream if request.stream else self._message_whole)(job, reply)
        finally:
            job.cancelled.set()

    def _count_tokens(self) -> None:
        request = anthropic.parse(self._read_body(), count_only=True)
        self._send_json(200, {"input_tokens": len(self.server.tokens_for(request))})
        self._log(200)

    def _submit(self, request: Request) -> Job:
        """Check the request against the model and queue its generation."""
        server, chat = self.server, request.chat
        tokens = server.tokens_for(request)
        limit = server.engine.target.context_length
        room = None if limit is None else limit - len(tokens)
        if room is not None and room < 1:
            raise RequestError(
                400,
                f"the prompt ({len(tokens)} tokens) fills the model's context of {limit} tokens",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        if request.max_tokens is not None and room is not None and request.max_tokens > room:
            raise RequestError(
                400,
                f"the prompt ({len(tokens)} tokens) + max_tokens ({request.max_tokens}) "
                f"exceed the model's context of {limit} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        max_tokens = request.max_tokens or min(server.max_tokens, room or server.max_tokens)
        if server.worker.jobs.qsize() >= server.max_queued:
            raise RequestError(
                503,
                f"the server is busy: {server.max_queued} requests are waiting; retry later",
                code="server_busy",
                kind="server_error",
                retry_after=RETRY_AFTER_SECONDS,
            )
        job = Job(request, tokens, max_tokens, server.options_for(request))
        server.worker.jobs.put(job)
        return job

    def _splitter(self, job: Job) -> Optional[ReplySplitter]:
        """Where a chat reply's text goes (content, reasoning, tool calls); None: a completion's
        text is the reply as written."""
        request, tokenizer = job.request, self.server.tokenizer
        if not request.chat or not (
            tokenizer.has_thinking or tokenizer.response_initial_state or request.tools
        ):
            return None  # nothing to split: the text goes as it is, at no cost per token
        return ReplySplitter(
            tokenizer,
            self.server.machine,
            initial_state(tokenizer, job.tokens, request.tool_choice),
            request.tools,
            request.stream,
        )

    def _logprobs(self, job: Job, response) -> Optional[List[dict]]:
        if job.request.logprobs is None or response.token is None:
            return None
        return [
            token_logprobs(self.server.token_text, response.token, response.logprob, response.top_logprobs)
        ]

    def _usage(self, job: Job, stats, tokens: List[int]) -> dict:
        """usage, with OpenAI's accepted_prediction_tokens (the prediction's tokens found, in
        order, in the reply) and rejected_prediction_tokens (the rest of the prediction)."""
        prediction = None
        if job.options.prediction:
            matched = sum(
                block.size
                for block in difflib.SequenceMatcher(
                    None, job.options.prediction, tokens, autojunk=False
                ).get_matching_blocks()
            )
            prediction = {
                "accepted_prediction_tokens": matched,
                "rejected_prediction_tokens": len(job.options.prediction) - matched,
            }
        return usage(stats, self.server.loaded.draft, self._sampled(job), prediction)

    def _events(self, job: Job, keep_alive=None):
        """The job's events, until its end; stops early (cancelling it) if the client leaves.
        keep_alive(progress) is called at each chunk of a long prompt (a Prefilling) and about
        once a second while nothing comes (queued, prefilling: progress None)."""
        quiet_since = time.monotonic()
        while True:
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._client_gone():
                    job.cancelled.set()
                    return
                if keep_alive is not None and time.monotonic() - quiet_since > KEEP_ALIVE_SECONDS:
                    keep_alive(None)
                    quiet_since = time.monotonic()
                continue
            quiet_since = time.monotonic()
            if event is END:
                return
            if isinstance(event, Prefilling):
                if keep_alive is not None:
                    keep_alive(event)
                continue
            yield event
            if job.cancelled.is_set():
                return

    def _whole(self, job: Job, reply: Reply) -> None:
        splitter, whole, tokens, logprobs, last = self._splitter(job), Delta(), [], [], None
        for event in self._events(job):
            if isinstance(event, RequestError):
                raise event
            last = event
            delta = splitter.add(event.text, event.finish_reason) if splitter else Delta(content=event.text)
            whole.content, whole.reasoning = whole.content + delta.content, whole.reasoning + delta.reasoning
            whole.tool_calls += delta.tool_calls
            if event.token is not None:
                tokens.append(event.token)
                logprobs += self._logprobs(job, event) or []
        if last is None or last.finish_reason is None:  # the client left
            self.close_connection = True
            return
        finish = _finish_reason(last.finish_reason, whole.tool_calls)
        self._send_json(
            200,
            reply.whole(
                whole,
                finish,
                self._usage(job, last.stats, tokens),
                logprobs if job.request.logprobs is not None else None,
            ),
        )
        self._log(200, _summary(last.stats))

    def _stream(self, job: Job, reply: Reply) -> None:
        # The request was checked: the headers go out at once, and while it waits in the queue
        # SSE comments keep proxies and clients with header or read timeouts from giving up.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if reply.chat:
            self._sse(reply.first_chunk())
        splitter, tokens, called, offset = self._splitter(job), [], False, 0
        unsent = []  # from_draft of the tokens whose text has not gone out yet (draft_marks)
        try:
            for event in self._events(job, keep_alive=self._keep_alive):
                if isinstance(event, RequestError):
                    self._sse(event.body())  # in a stream, the error is its last event
                    self._log(event.status, event.message)
                    break
                if event.token is not None:
                    tokens.append(event.token)
                    unsent.append(event.from_draft)
                delta = (
                    splitter.add(event.text, event.finish_reason) if splitter else Delta(content=event.text)
                )
                called = called or bool(delta.tool_calls)
                finish = _finish_reason(event.finish_reason, called) if event.finish_reason else None
                marks = None
                if job.request.draft_marks and (delta.content or delta.reasoning):
                    marks, unsent = draft_marks(unsent, event), []
                for chunk in reply.chunks(delta, finish, self._logprobs(job, event), offset, marks):
                    self._sse(chunk)
                offset += len(delta.content)
                if event.finish_reason is not None:
                    if job.request.include_usage:
                        self._sse(reply.usage_chunk(self._usage(job, event.stats, tokens)))
                    self._sse("[DONE]")
                    self._log(200, "stream " + _summary(event.stats))
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()
            self.close_connection = True

    def _message_whole(self, job: Job, reply: "anthropic.MessageReply") -> None:
        splitter, whole, last = self._splitter(job), Delta(), None
        for event in self._events(job):
            if isinstance(event, RequestError):
                raise event
            last = event
            delta = splitter.add(event.text, event.finish_reason) if splitter else Delta(content=event.text)
            whole.content, whole.reasoning = whole.content + delta.content, whole.reasoning + delta.reasoning
            whole.tool_calls += delta.tool_calls
        if last is None or last.finish_reason is None:  # the client left
            self.close_connection = True
            return
        self._send_json(200, reply.whole(whole, last.stats))
        self._log(200, _summary(last.stats))

    def _message_stream(self, job: Job, reply: "anthropic.MessageReply") -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        splitter, called = self._splitter(job), False
        for name, data in reply.start(len(job.tokens)):
            self._event(name, data)
        try:
            for event in self._events(job, keep_alive=self._keep_alive):
                if isinstance(event, RequestError):
                    self._event(
                        "error", anthropic.error_body(event)
                    )  # in a stream, the error is its last event
                    self._log(event.status, event.message)
                    break
                delta = (
                    splitter.add(event.text, event.finish_reason) if splitter else Delta(content=event.text)
                )
                called = called or bool(delta.tool_calls)
                for name, data in reply.events(delta):
                    self._event(name, data)
                if event.finish_reason is not None:
                    for name, data in reply.finish(event.stats, called):
                        self._event(name, data)
                    self._log(200, "stream " + _summary(event.stats))
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()
            self.close_connection = True

    def _event(self, name: str, data: dict) -> None:
        self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def _sampled(self, job: Job) -> bool:
        return job.request.sampling.get("temp", self.server.engine.sampling.temp) > 0

    def _keep_alive(self, progress: Optional[Prefilling]) -> None:
        """An SSE comment (every client skips it): the prompt's progress, or that it waits."""
        text = f"prompt {progress.done}/{progress.total} tokens" if progress else "waiting"
        self.wfile.write(f": {text}\n\n".encode())
        self.wfile.flush()


def _finish_reason(finish_reason: str, tool_calls) -> str:
    """OpenAI's: a reply that ended having made tool calls ends with "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" and tool_calls else finish_reason


def _request_error(e: Exception, log) -> RequestError:
    """What a client is told of a generation that failed: a bad request (400), or the
    server's own failure (500, logged)."""
    if isinstance(e, MlxSpecError):
        return RequestError(400, str(e))
    log(f"error: {type(e).__name__}: {one_line(e)}")
    return RequestError(500, f"generation failed: {one_line(e)}", kind="server_error")


def _summary(stats) -> str:
    return (
        f"prompt {stats.prompt_tokens} ({stats.prompt_cached} cached), {count(stats.generated_tokens, 'token')}, "
        f"{stats.tokens_per_step:.2f} tokens/step, {stats.tokens_per_second:.1f} tok/s"
    )


def draft_marks(from_draft: List[bool], response) -> dict:
    """A stream chunk's draft_marks: of its tokens, how many came from accepted drafts, and the
    speculation's figures so far (what the chat page shows)."""
    return {
        "tokens": len(from_draft),
        "drafted": sum(from_draft),
        "steps": response.steps,
        "plain_steps": response.plain_steps,
        "tokens_per_step": round(response.tokens_per_step, 3),
        "acceptance": round(response.acceptance_rate, 3),
    }
