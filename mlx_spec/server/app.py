"""An OpenAI-compatible HTTP server over the engine.

The standard library's ThreadingHTTPServer, as mlx_lm.server uses: the work is one generation
at a time on one engine (its cache is the prompt cache), so an asynchronous stack would add a
dependency and buy nothing. One thread per connection parses and checks the request, then
queues it; one worker thread owns the engine and generates for the queued requests in turn,
handing each its responses through a queue of its own, so two requests' tokens never mix.
A client that disconnects is noticed at the next token (or within 50 ms while it waits) and its
generation stops within a step."""

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

import mlx.core as mx
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from .. import __version__
from ..api import Responses, count, sampling_and_seed, stream_generate
from ..batch import BatchEngine
from ..cache import common_prefix_length
from ..errors import MlxSpecError, RanksLost
from ..events import Done, Failed
from ..models.checkpoint import one_line
from .protocol import Reply, Request, RequestError, parse, usage
from .sessions import SessionCache

POLL_SECONDS = 0.05
KEEP_ALIVE_SECONDS = 1.0
RETRY_AFTER_SECONDS = 1


END = object()   # a job's last message: nothing more comes


class Job:
    """One queued request: the prompt's tokens and settings in; out through `events`, its
    GenerationResponses (or a RequestError), then END."""

    def __init__(self, request: Request, tokens, max_tokens: int):
        self.request, self.tokens, self.max_tokens = request, tokens, max_tokens
        self.events: "queue.Queue" = queue.Queue()
        self.cancelled = threading.Event()


class Worker(threading.Thread):
    """Owns the engine: loads it (MLX's streams belong to the thread that made them, as in
    mlx_lm.server), then generates for one job at a time, in the order they came."""

    def __init__(self, load, max_sessions: int, max_cache_bytes: int, log, max_batch: int = 1):
        super().__init__(name="mlx-spec-worker", daemon=True)
        self.load, self.max_sessions, self.max_cache_bytes, self.log = load, max_sessions, max_cache_bytes, log
        self.max_batch = max_batch
        self.batch: Optional[BatchEngine] = None
        self.jobs: "queue.Queue" = queue.Queue()
        self.stopping = threading.Event()
        self.loaded = threading.Event()
        self.load_error: Optional[MlxSpecError] = None
        self.fatal: Optional[RanksLost] = None   # the server cannot go on

    def start_engine(self):
        """Start the thread and wait for the engine; its loading error, if any, is raised here."""
        self.start()
        self.loaded.wait()
        if self.load_error is not None:
            raise self.load_error
        return self.engine

    def run(self):
        try:
            self._run()
        finally:   # by this thread, else the process may abort as it exits (MLX 0.32, mlx#4327)
            mx.clear_streams()

    def _run(self):
        try:
            self.engine = self.load()
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
        self.sessions = SessionCache(self.engine, self.max_sessions, self.max_cache_bytes)
        self.loaded.set()
        try:
            if self.batch is not None:
                self._serve_batched()
            else:
                self._serve_one_at_a_time()
        finally:
            self.engine.close()   # here: MLX's streams belong to this thread
        while True:   # stopped: whoever still waits is told so
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.events.put(RequestError(503, "the server is shutting down", kind="server_error"))
                job.events.put(END)

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
            self.log("client gone: generation stopped before it started")   # it left while queued
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
        batch, active = self.batch, {}   # id(row) -> (row, job, Responses)
        while not self.stopping.is_set():
            while batch.idle:
                job = self._next_job(block=not active)
                if job is None:
                    break
                self._start(job, active)
            try:
                events = batch.step()
            except Exception as e:   # the pass itself failed: every request in it fails, the server serves on
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
        for row, job, _ in active.values():   # stopped
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
        row = batch.add(job.tokens, job.max_tokens, request.stop, params, seed, engine=engine)
        active[id(row)] = (row, job, Responses())

    def _generate(self, job: Job) -> None:
        request = job.request
        try:
            self.sessions.prepare(job.tokens)
            for response in stream_generate(self.engine, self.tokenizer, job.tokens, max_tokens=job.max_tokens,
                                            stop=request.stop, seed=request.seed, **request.sampling):
                job.events.put(response)
                if job.cancelled.is_set() or self.stopping.is_set():
                    self.log("client gone: generation stopped" if job.cancelled.is_set() else "stopped")
                    return   # closes the generator at this token: the cache stays consistent
        except Exception as e:   # never a traceback to the client; the server keeps serving
            job.events.put(_request_error(e, self.log))
            if isinstance(e, RanksLost):   # ... but over a split target that lost a rank
                self.fatal = e
                self.log(f"error: {e}")
                os.kill(os.getpid(), signal.SIGTERM)   # serve stops as on SIGTERM, then says why

    def stop(self) -> None:
        self.stopping.set()
        self.jobs.put(None)


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, load, model_name: str, method: str, aliases=(), max_tokens: int = 512,
                 api_key: Optional[str] = None, max_body_bytes: int = 1 << 20, max_sessions: int = 10,
                 max_cache_bytes: int = 1 << 30, max_batch: int = 1, backlog: int = socket.SOMAXCONN,
                 max_queued: int = 256, log=None):
        """load: () -> Engine, called on the worker thread (errors raised here, before serving).
        backlog: connections the kernel holds before they are accepted (socketserver's default
        of 5 resets a burst of parallel requests); max_queued: requests waiting for the engine
        past which a request gets a 503 with Retry-After instead of waiting."""
        self.request_queue_size = backlog   # read by server_activate's listen()
        self.max_queued = max_queued
        super().__init__(address, Handler)
        self.model_name, self.method = model_name, method
        # What clients of mlx_lm.server send for the same model: the name given to --model,
        # and its "default_model". Never a way to load another one.
        self.model_names = {model_name, "default_model", *aliases}
        self.max_tokens, self.api_key, self.max_body_bytes = max_tokens, api_key, max_body_bytes
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.worker = Worker(load, max_sessions, max_cache_bytes, self.log, max_batch)
        try:
            self.engine = self.worker.start_engine()
        except BaseException:
            self.server_close()
            raise
        self.tokenizer, self.sessions = self.worker.tokenizer, self.worker.sessions

    def shutdown_worker(self) -> None:
        self.worker.stop()
        self.worker.join(timeout=10)

    def tokens_for(self, request: Request):
        """The prompt's token ids (the chat template applied to messages)."""
        tokenizer = self.tokenizer
        if request.chat:
            if not getattr(tokenizer, "chat_template", None):
                raise RequestError(400, "the served model has no chat template: use /v1/completions",
                                   "messages")
            try:
                return list(tokenizer.apply_chat_template(request.messages, add_generation_prompt=True))
            except Exception as e:   # a template that rejects the conversation (roles, order)
                raise RequestError(400, f"the chat template rejects these messages: {one_line(e)}",
                                   "messages") from None
        if isinstance(request.prompt, list):
            if max(request.prompt) >= self.engine.target.vocab_size:
                raise RequestError(400, f"'prompt' has a token id past the vocabulary "
                                        f"({self.engine.target.vocab_size})", "prompt")
            return request.prompt
        return list(tokenizer.encode(request.prompt))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"mlx-spec/{__version__}"
    server: Server

    def log_message(self, format, *args):   # one line per request is written by _log instead
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
        self._send_json(error.status, error.body(), retry)
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

    # --- routes ------------------------------------------------------------------------
    def do_GET(self):
        self._route({"/health": self._health, "/v1/models": self._models})

    def do_POST(self):
        self._route({"/v1/chat/completions": lambda: self._complete(chat=True),
                     "/v1/completions": lambda: self._complete(chat=False)})

    def _route(self, routes) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if path not in routes:
                raise RequestError(404, f"no route {self.command} {path}", code="not_found")
            if path != "/health":
                self._authorize()
            routes[path]()
        except RequestError as e:
            self.close_connection = True
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode())):
            raise RequestError(401, "a valid API key is required: 'Authorization: Bearer KEY'",
                               code="invalid_api_key")

    def _health(self) -> None:
        sessions = self.server.sessions
        self._send_json(200, {"status": "ok", "model": self.server.model_name, "draft": self.server.method,
                              "queued": self.server.worker.jobs.qsize(),
                              "prompt_cache": {"sessions": len(sessions.stored), "bytes": sessions.nbytes,
                                               "max_bytes": sessions.max_bytes}})

    def _models(self) -> None:
        self._send_json(200, {"object": "list", "data": [
            {"id": self.server.model_name, "object": "model", "created": 0, "owned_by": "mlx-spec"}]})
        self._log(200)

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError(411 if length is None else 400, "the request needs a Content-Length")
        if int(length) > self.server.max_body_bytes:
            raise RequestError(413, f"the request body is over {self.server.max_body_bytes} bytes",
                               code="request_too_large")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RequestError(400, f"the request body is not valid JSON: {one_line(e)}") from None

    def _complete(self, chat: bool) -> None:
        server = self.server
        request = parse(self._read_body(), chat)
        model = request.model
        if model is not None and model not in server.model_names:
            raise RequestError(404, f"model {model!r} is not served here (this server serves "
                                    f"{server.model_name!r})", "model", "model_not_found")
        tokens = server.tokens_for(request)
        limit = server.engine.target.context_length
        room = None if limit is None else limit - len(tokens)
        if room is not None and room < 1:
            raise RequestError(400, f"the prompt ({len(tokens)} tokens) fills the model's context of {limit} "
                                    "tokens", "messages" if chat else "prompt", "context_length_exceeded")
        if request.max_tokens is not None and room is not None and request.max_tokens > room:
            raise RequestError(400, f"the prompt ({len(tokens)} tokens) + max_tokens ({request.max_tokens}) "
                                    f"exceed the model's context of {limit} tokens", "max_tokens",
                               "context_length_exceeded")
        max_tokens = request.max_tokens or min(server.max_tokens, room or server.max_tokens)
        if server.worker.jobs.qsize() >= server.max_queued:
            raise RequestError(503, f"the server is busy: {server.max_queued} requests are waiting; retry later",
                               code="server_busy", kind="server_error", retry_after=RETRY_AFTER_SECONDS)
        job = Job(request, tokens, max_tokens)
        server.worker.jobs.put(job)
        try:
            (self._stream if request.stream else self._whole)(job, Reply(request, server.model_name))
        finally:
            job.cancelled.set()   # whatever ended the reply, the worker stops at its next token

    def _events(self, job: Job, keep_alive=None):
        """The job's events, until its end; stops early (cancelling it) if the client leaves.
        keep_alive() is called about once a second while nothing comes (queued, prefilling)."""
        quiet_since = time.monotonic()
        while True:
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._client_gone():
                    job.cancelled.set()
                    return
                if keep_alive is not None and time.monotonic() - quiet_since > KEEP_ALIVE_SECONDS:
                    keep_alive()
                    quiet_since = time.monotonic()
                continue
            quiet_since = time.monotonic()
            if event is END:
                return
            yield event
            if job.cancelled.is_set():
                return

    def _whole(self, job: Job, reply: Reply) -> None:
        pieces, last = [], None
        for event in self._events(job):
            if isinstance(event, RequestError):
                raise event
            pieces.append(event.text)
            last = event
        if last is None or last.finish_reason is None:   # the client left
            self.close_connection = True
            return
        self._send_json(200, reply.whole("".join(pieces), last.finish_reason,
                                         usage(last.stats, self.server.method, self._sampled(job))))
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
            self._sse(reply.chunk(first=True))
        try:
            for event in self._events(job, keep_alive=self._keep_alive):
                if isinstance(event, RequestError):
                    self._sse(event.body())   # in a stream, the error is its last event
                    self._log(event.status, event.message)
                    break
                response = event
                if response.text:
                    self._sse(reply.chunk(response.text))
                if response.finish_reason is not None:
                    self._sse(reply.chunk(finish_reason=response.finish_reason))
                    if job.request.include_usage:
                        self._sse(reply.usage_chunk(usage(response.stats, self.server.method, self._sampled(job))))
                    self._sse("[DONE]")
                    self._log(200, "stream " + _summary(response.stats))
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled.set()
            self.close_connection = True


    def _sampled(self, job: Job) -> bool:
        return job.request.sampling.get("temp", self.server.engine.sampling.temp) > 0

    def _keep_alive(self) -> None:
        self.wfile.write(b": waiting\n\n")
        self.wfile.flush()


def _request_error(e: Exception, log) -> RequestError:
    """What a client is told of a generation that failed: a bad request (400), or the
    server's own failure (500, logged)."""
    if isinstance(e, MlxSpecError):
        return RequestError(400, str(e))
    log(f"error: {type(e).__name__}: {one_line(e)}")
    return RequestError(500, f"generation failed: {one_line(e)}", kind="server_error")


def _summary(stats) -> str:
    return (f"prompt {stats.prompt_tokens} ({stats.prompt_cached} cached), {count(stats.generated_tokens, 'token')}, "
            f"{stats.tokens_per_step:.2f} tokens/step, {stats.tokens_per_second:.1f} tok/s")
