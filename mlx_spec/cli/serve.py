import json
import signal
import socket

import click

from .common import (
    GroupedCommand,
    config_options,
    draft_label,
    echo_err,
    load_engine,
    model_label,
    reports_errors,
)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@click.command(
    "serve", cls=GroupedCommand, short_help="An OpenAI-compatible HTTP server (chat, completions, streaming)."
)
@config_options()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind (loopback by default: say 0.0.0.0 to serve the network).",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    help="Port (0: any free one, printed at start).",
)
@click.option(
    "--max-tokens",
    "-m",
    type=click.IntRange(1),
    default=512,
    show_default=True,
    help="Most tokens per reply when a request gives no max_tokens.",
)
@click.option(
    "--api-key",
    envvar="MLX_SPEC_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' (also $MLX_SPEC_API_KEY).",
)
@click.option(
    "--prompt-cache-size",
    type=click.IntRange(0),
    default=10,
    show_default=True,
    help="Most conversations kept besides the current one (their caches are reused).",
)
@click.option(
    "--prompt-cache-bytes",
    type=click.IntRange(0),
    default=1 << 30,
    show_default=True,
    help="Most bytes those conversations' caches take.",
)
@click.option(
    "--prompt-cache-dir",
    default="",
    show_default=False,
    help="Where conversations go on disk when evicted from memory and at shutdown, so that a "
    "restart continues them (default: one directory per model under ~/.cache/mlx-spec/"
    "prompt-cache), or off.",
)
@click.option(
    "--prompt-cache-disk-bytes",
    type=click.IntRange(1),
    default=8 << 30,
    show_default=True,
    help="Most bytes the conversations on disk take (least recently used out first).",
)
@click.option(
    "--max-batch",
    type=click.IntRange(1),
    default=8,
    show_default=True,
    help="Most requests generated at once, sharing each target pass (1: one at a time).",
)
@click.option(
    "--max-body-bytes",
    type=click.IntRange(1),
    default=1 << 20,
    show_default=True,
    help="Largest request body accepted (413 past it).",
)
@click.option(
    "--backlog",
    type=click.IntRange(1),
    default=socket.SOMAXCONN,
    show_default=True,
    help="Connections the system holds until they are accepted (a burst of parallel requests).",
)
@click.option(
    "--max-queued",
    type=click.IntRange(1),
    default=256,
    show_default=True,
    help="Requests waiting for the model past which a request gets 503 with Retry-After.",
)
@click.option(
    "--allowed-origins",
    default="",
    help="Comma-separated origins whose browser pages may call the API (CORS), or '*'; default none.",
)
@click.option("--no-ui", is_flag=True, help="Serve no chat page at GET / (the API only).")
@click.option(
    "--chat-template-args",
    default=None,
    help="JSON arguments for the chat template, e.g. '{\"enable_thinking\": false}' (a request's "
    "chat_template_kwargs add to them).",
)
@reports_errors
def serve(
    host,
    port,
    max_tokens,
    api_key,
    prompt_cache_size,
    prompt_cache_bytes,
    prompt_cache_dir,
    prompt_cache_disk_bytes,
    max_batch,
    max_body_bytes,
    backlog,
    max_queued,
    allowed_origins,
    chat_template_args,
    no_ui,
    **options,
):
    """Serve the model over the OpenAI API: POST /v1/chat/completions and /v1/completions
    (streaming too), GET /v1/models and /health. Up to --max-batch requests are generated at
    once, each with the --draft source, every step's drafts verified in one pass for all of
    them; a chat's next turn computes only its new tokens."""
    from ..server.app import Server

    split = bool(options["sharding"])
    if split:
        from ..distributed import init_group

        if init_group(options["sharding"]).rank() != 0:
            load_engine(options)  # serves rank 0's passes; the process ends with rank 0's
        # The other ranks mirror one cache: the prompt cache is the live conversation alone.
        echo_err(
            "mlx-spec serve: split target: requests run one at a time, and the prompt cache is the "
            "current conversation (--prompt-cache-size 0, none on disk)"
        )
        prompt_cache_size, max_batch, prompt_cache_dir = 0, 1, "off"
    try:
        template_args = json.loads(chat_template_args) if chat_template_args else {}
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="--chat-template-args") from None
    if not isinstance(template_args, dict):
        raise click.BadParameter(
            "a JSON object, e.g. '{\"enable_thinking\": false}'", param_hint="--chat-template-args"
        )
    origins = [o.strip() for o in allowed_origins.split(",") if o.strip()]
    name = model_label(options["path_or_hf_repo"])
    try:
        server = Server(
            (host, port),
            lambda: load_engine(options, sessions=not split),
            name,
            max_tokens=max_tokens,
            allowed_origins=origins,
            chat_template_args=template_args,
            api_key=api_key,
            max_body_bytes=max_body_bytes,
            max_sessions=prompt_cache_size,
            max_cache_bytes=prompt_cache_bytes,
            max_batch=max_batch,
            backlog=backlog,
            max_queued=max_queued,
            log=echo_err,
            prompt_cache_dir=None if prompt_cache_dir == "off" else prompt_cache_dir,
            prompt_cache_disk_bytes=prompt_cache_disk_bytes,
            ui=not no_ui,
        )
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound_host, bound_port = server.server_address[:2]
    echo_err(
        f"mlx-spec serve: {name} ({draft_label(server.loaded)}) on http://{bound_host}:{bound_port}/v1"
        f"{' (API key required)' if api_key else ''}"
        + ("" if no_ui else f"; chat page http://{bound_host}:{bound_port}/")
        + "; Ctrl-C stops"
    )
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown_worker()
        server.server_close()
    echo_err("mlx-spec serve: stopped")
    if server.worker.fatal is not None:
        raise click.ClickException(str(server.worker.fatal))
