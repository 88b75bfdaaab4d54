"""What the commands share: the engine's options (from config.py), grouped help, loading, streaming."""

import functools
import sys
from typing import Optional

import click

from ..errors import MlxSpecError
from ..events import Collector, Prefilling, Text, Token


class GroupedOption(click.Option):
    """An option listed under a heading of its own in --help (`group`; None: "Options")."""

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group


class GroupedCommand(click.Command):
    """--help lists the everyday options first ("Options"), then each group under its heading,
    in the order they first appear."""

    def format_options(self, ctx, formatter):
        groups = {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                groups.setdefault(getattr(param, "group", None) or "Options", []).append(record)
        for heading, records in groups.items():
            if records:
                with formatter.section(heading):
                    formatter.write_dl(records)


def option(*decls, group=None, **settings):
    """click.option, listed under `group`'s heading in --help."""
    return click.option(*decls, cls=GroupedOption, group=group, **settings)


def apply(f, options):
    for decorator in reversed(options):
        f = decorator(f)
    return f


class IntList(click.ParamType):
    """Comma-separated integers: "2,15,27"."""

    name = "INTS"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            return [int(v) for v in value.replace(",", " ").split()]
        except ValueError:
            self.fail(f"expected comma-separated integers, got {value!r}", param, ctx)


PARAM_TYPES = {"IntList": IntList}  # the types a setting may name besides click's own


def setting_option(f, meta=None, group=None):
    """The click option of a dataclass field declared with config.setting (meta: the metadata to
    read where the field's own has none): its flag, help, type and default; its destination
    is the field's name."""
    from dataclasses import MISSING

    meta = meta or f.metadata
    default = f.default if f.default is not MISSING else None
    settings = dict(default=default, help=meta["help"], group=group)
    flag = meta["flag"] or "--" + f.name.replace("_", "-")
    if meta["type"]:
        name, *arguments = meta["type"]
        kind = PARAM_TYPES.get(name) or getattr(click, name)
        settings["type"] = kind(*arguments) if arguments or name in PARAM_TYPES else kind
    elif isinstance(default, bool) and "/" not in flag:
        settings["is_flag"] = True
    settings["show_default"] = meta["show_default"] and default is not None
    return option(flag, f.name, **settings)


def config_options(exclude=()):
    """The options of every EngineConfig field but `exclude`, in the order the fields are
    declared (config.py: flags, help, types and defaults are read there); their destinations
    are the fields' names (api.load's keywords). The model and draft source's own options are
    listed first, the others under their section's heading."""
    from dataclasses import fields

    from ..config import EVERYDAY, SECTIONS

    decorators = [
        setting_option(f, group=None if f.name in EVERYDAY else heading)
        for kind, heading in SECTIONS.values()
        for f in fields(kind)
        if f.name not in exclude
    ]

    def decorate(f):
        return apply(f, decorators)

    return decorate


def reports_errors(f):
    """Bad input ends in one line on stderr and exit status 1, never a traceback."""

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except MlxSpecError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def load_engine(options: dict, sessions: bool = False):
    """The api.Loaded of config_options' values (api.load's keywords): the engine, and the
    source --draft auto chose. At a terminal, auto asks before it downloads a drafter."""
    from ..api import load_model

    interactive = sys.stdin.isatty() and sys.stderr.isatty()
    return load_model(
        **options,
        sessions=sessions,
        confirm=(lambda question: click.confirm(question, err=True)) if interactive else None,
    )


def draft_label(loaded) -> str:
    """--draft as the banners say it (of an api.Loaded): the source, and what --draft auto chose
    and why."""
    return f"--draft auto: {loaded.draft} ({loaded.why})" if loaded.why else f"--draft {loaded.draft}"


def model_label(model_path) -> str:
    """What to call the model the user named: its repo id, its directory's name, or the
    embedded model's name."""
    from pathlib import Path

    from ..models.default import DEFAULT_MODEL_NAME

    if model_path is None:
        return DEFAULT_MODEL_NAME
    return Path(model_path).resolve().name if Path(model_path).exists() else model_path


def echo_err(text: str, **kwargs) -> None:
    click.echo(text, err=True, **kwargs)


def stream(
    events, out=sys.stdout, collected: Optional[Collector] = None, stop=None, show_drafts: bool = False
) -> Collector:
    """Print text as it is committed; the generation collected (into `collected` if given: what
    was printed survives an interrupted stream). stop() True ends the generation at the next
    event (its stats then say "interrupted"). show_drafts: the text of tokens that came from
    accepted drafts in green (the chat page's colouring)."""
    collected = Collector() if collected is None else collected
    bar = None  # while a long prompt prefills (Prefilling events): a progress bar on stderr
    try:
        for event in events:
            collected.add(event)
            if isinstance(event, Prefilling):
                if bar is None:
                    bar = click.progressbar(
                        length=event.total, label="prompt", file=click.get_text_stream("stderr")
                    )
                    bar.__enter__()
                bar.update(event.done - bar.pos)
            elif bar is not None:  # the prompt is in
                bar.update(bar.length - bar.pos)
                bar.__exit__(None, None, None)
                bar = None
            text = event.text if isinstance(event, (Token, Text)) else ""
            if text and out is not None:
                if show_drafts and isinstance(event, Token) and event.from_draft:
                    click.echo(
                        click.style(text, fg="green"), file=out, nl=False
                    )  # plain where out is no terminal
                else:
                    out.write(text)
                out.flush()
            if stop is not None and stop():
                events.close()
                break
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    return collected
