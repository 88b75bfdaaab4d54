"""Training data for drafters: prompts from offline sources assembled here, answered by the
TARGET itself (a drafter learns to predict what the target says, not what a dataset says).

Sources (never a public benchmark set): instructions written here (templates x topics), code
and docstrings of the installed Python standard library, generated arithmetic word problems,
standard-library documentation to summarize or rewrite, and everyday chat requests (templates x
typed subjects), each with a second turn that follows the target's own first answer. Responses
are generated in batches (mlx-lm's batch_generate), appended to JSONL as they come (resumable),
and a stable hash of each prompt's id (a second turn: its first turn's) puts ~5% of them in a
held-out split.

A prompts file (`train data --prompts-file`, e.g. benchmarks/training/real/prompts.jsonl.gz:
real instructions and conversations from public data sets, built by
scripts/build_real_prompts.py) replaces the assembled sources: its prompts are answered in the
file's order, a window at a time, so that an answering cut short (--max-minutes) has answered
a sample of the file, not its shortest prompts."""

import gzip
import hashlib
import inspect
import json
import random
import re
import textwrap
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

from ..errors import MlxSpecError

TOPICS = [
    "photosynthesis",
    "compound interest",
    "the water cycle",
    "how vaccines work",
    "black holes",
    "the French Revolution",
    "recursion in programming",
    "supply and demand",
    "plate tectonics",
    "how a bicycle stays upright",
    "the immune system",
    "machine learning",
    "climate and weather",
    "the printing press",
    "prime numbers",
    "how bread rises",
    "electric circuits",
    "sleep",
    "volcanoes",
    "the stock market",
    "honeybees",
    "public transport",
    "solar panels",
    "memory",
    "the Roman Empire",
    "coral reefs",
    "inflation",
    "the internet",
    "friendship",
    "time zones",
]
ACTIVITIES = [
    "learning a language",
    "running a first 5k",
    "saving money",
    "cooking for a family",
    "studying for exams",
    "starting a garden",
    "working from home",
    "public speaking",
    "keeping a journal",
    "traveling on a budget",
    "learning to draw",
    "moving to a new city",
]
INSTRUCTIONS = [
    "Explain {topic} in simple terms.",
    "What are the most common misconceptions about {topic}?",
    "Write a short paragraph about {topic} for a ten-year-old.",
    "Give three facts about {topic}.",
    "Write a short poem about {topic}.",
    "What questions would an expert ask about {topic}?",
    "Give three practical tips for {activity}.",
    "What mistakes do beginners make when {activity}?",
    "Write a short plan for a week of {activity}.",
    "Compare {topic} and {other} in a few sentences.",
]
WORD_PROBLEMS = [
    "A shop sells {a} apples on Monday and {b} apples on Tuesday. Each apple costs {c} cents. How much money did the shop make? Show your steps.",
    "A train travels {a} km in {c} hours. How far does it travel in {b} hours at the same speed? Explain.",
    "Sam has {a} marbles and gives {c} to each of his {d} friends. How many marbles does he have left?",
    "A rectangle is {a} cm long and {c} cm wide. What are its area and perimeter?",
    "A class of {a} students is split into groups of {d}. How many full groups are there, and how many students are left over?",
]
STDLIB_MODULES = [
    "json",
    "textwrap",
    "collections",
    "functools",
    "itertools",
    "statistics",
    "string",
    "shutil",
    "pathlib",
    "argparse",
    "csv",
    "datetime",
    "heapq",
    "bisect",
    "random",
    "difflib",
    "fractions",
    "calendar",
    "copy",
    "pprint",
    "queue",
    "glob",
    "fnmatch",
    "base64",
    "html",
    "zipfile",
]

# Added 2026-12-06 (instructions, summaries and rewrites paid least on the held-out prompts).
MORE_TOPICS = [
    "earthquakes",
    "the human heart",
    "photography",
    "the moon's phases",
    "recycling",
    "antibiotics",
    "the Silk Road",
    "rainbows",
    "electric cars",
    "fermentation",
    "the periodic table",
    "tides",
    "ancient Egypt",
    "how airplanes fly",
    "gravity",
    "bees and pollination",
    "the blockchain",
    "renewable energy",
    "the human brain",
    "deserts",
    "jazz music",
    "the Olympic Games",
    "magnets",
    "clouds",
    "taxes",
    "the printing of money",
    "dinosaurs",
    "nutrition",
    "composting",
    "the ocean floor",
]
MORE_ACTIVITIES = [
    "learning to swim",
    "training a puppy",
    "writing a resume",
    "learning to code",
    "decluttering a home",
    "baking bread at home",
    "learning chess",
    "hiking in the mountains",
]
# Pure-Python modules outside STDLIB_MODULES (the held-out bench quotes those) and TEXT_MODULES.
MORE_MODULES = [
    "getopt",
    "shelve",
    "ftplib",
    "pdb",
    "bdb",
    "code",
    "codeop",
    "pkgutil",
    "runpy",
    "tabnanny",
    "pyclbr",
    "py_compile",
    "compileall",
    "zipapp",
    "webbrowser",
    "wsgiref.util",
    "wsgiref.headers",
    "wsgiref.simple_server",
    "xmlrpc.client",
    "urllib.robotparser",
    "http.cookiejar",
    "http.cookies",
    "email.utils",
    "email.header",
    "email.feedparser",
    "html.parser",
    "posixpath",
    "linecache",
    "rlcompleter",
    "dbm",
    "click.core",
    "click.types",
    "click.termui",
    "click.utils",
    "click.formatting",
    "mlx_lm.models.base",
    "mlx_lm.tuner.utils",
    "mlx_lm.server",
    "mlx_lm.tuner.trainer",
    "mlx_lm.lora",
]

# Everyday requests, each template with the kind of subject it takes. None is a held-out bench
# conversation (benchmarks/heldout_prompts.jsonl; tests/test_train_data.py checks).
CHAT_SUBJECTS = {
    "dish": [
        "lentil curry",
        "banana bread",
        "fried rice",
        "pancakes",
        "a Greek salad",
        "chicken noodle soup",
        "guacamole",
        "vegetable stir-fry",
        "oatmeal cookies",
        "mashed potatoes",
        "a mushroom risotto",
        "hummus",
        "a fruit smoothie",
        "baked salmon",
        "chili con carne",
        "a quiche",
        "garlic bread",
        "potato salad",
        "spaghetti carbonara",
        "a chocolate cake",
    ],
    "place": [
        "Lisbon",
        "a national park",
        "the seaside",
        "Tokyo",
        "a small farm town",
        "Rome",
        "a ski resort",
        "New York",
        "a desert campsite",
        "Iceland",
        "a lake cabin",
        "Barcelona",
        "a big music festival",
        "Kyoto",
        "the countryside in autumn",
    ],
    "goal": [
        "stop procrastinating",
        "drink more water",
        "get better at chess",
        "keep my houseplants alive",
        "wake up earlier",
        "read more books",
        "spend less time on my phone",
        "make new friends as an adult",
        "stay calm before an exam",
        "keep my desk tidy",
        "learn to touch type",
        "cook more at home",
        "save for a new bike",
        "remember people's names",
        "run my first marathon",
        "write every day",
    ],
    "occasion": [
        "a rainy Sunday with kids",
        "a tenth birthday party",
        "a team lunch at work",
        "a first date",
        "a family reunion",
        "a long train ride",
        "a quiet evening at home",
        "a school fundraiser",
        "a farewell gift for a colleague",
        "a picnic in the park",
        "a board game night",
        "a surprise anniversary",
    ],
    "person": [
        "my landlord",
        "a new neighbour",
        "my child's teacher",
        "a former colleague",
        "my manager",
        "an old school friend",
        "a local bakery",
        "the city library",
        "my football coach",
    ],
    "request": [
        "move our meeting to next week",
        "borrow a ladder for the weekend",
        "recommend a good book",
        "fix a leaking tap",
        "join a volunteer day",
        "share the notes from last class",
        "lower the music after ten at night",
        "catch up over coffee",
    ],
    "thing": [
        "a used car",
        "a laptop for school",
        "running shoes",
        "a tent",
        "a new phone",
        "a rice cooker",
        "an office chair",
        "a bicycle for commuting",
        "a winter coat",
        "a first guitar",
    ],
    "character": [
        "a shy robot",
        "an old lighthouse keeper",
        "a lost kitten",
        "a girl who can talk to trees",
        "a grumpy wizard",
        "two rival bakers",
        "a boy who collects clouds",
        "a retired astronaut",
    ],
}
CHAT_TEMPLATES = [
    "Give me a simple recipe for {dish}.",
    "What goes well with {dish} for dinner?",
    "How long does {dish} keep in the fridge, and how should I store it?",
    "I am planning a short trip to {place}. What should I bring?",
    "What should I do on a first visit to {place}?",
    "How can I {goal}?",
    "I want to {goal}. Can you give me a plan for the first week?",
    "Suggest five ideas for {occasion}.",
    "What should I keep in mind when planning {occasion}?",
    "Write a short, friendly message to {person} asking them to {request}.",
    "What should I look for when buying {thing}?",
    "Is it better to buy {thing} new or second-hand?",
    "Write a short story about {character}.",
    "Write a bedtime story for a five-year-old about {character}.",
]
FOLLOW_UPS = [
    "Can you make that shorter?",
    "Thanks! Can you give me one more example?",
    "Explain the first point in more detail.",
    "Can you put that in a numbered list?",
    "What would you change if I had very little money?",
    "Which part of that is the most important, and why?",
    "Can you say that again for a ten-year-old?",
    "What is a common mistake people make with this?",
]


def chat_prompts(seed: int = 0) -> List[Dict[str, str]]:
    """Every chat template with every subject of its kind (first turns)."""
    rng = random.Random(f"chat-{seed}")
    prompts = []
    for i, template in enumerate(CHAT_TEMPLATES):
        kinds = re.findall(r"{(\w+)}", template)
        for j, subject in enumerate(CHAT_SUBJECTS[kinds[0]]):
            values = {kinds[0]: subject}
            values.update({k: rng.choice(CHAT_SUBJECTS[k]) for k in kinds[1:]})
            prompts.append({"id": f"chat-{i}-{j}", "source": "chat", "prompt": template.format(**values)})
    return prompts


def second_turns(firsts: List[Dict[str, str]], seed: int = 0) -> List[Dict[str, str]]:
    """One follow-up for each first turn (`follows`: its id): answered after it, with the
    target's answer to it as the context."""
    rng = random.Random(f"second-{seed}")
    return [
        {"id": f"{p['id']}-2", "source": p["source"], "prompt": rng.choice(FOLLOW_UPS), "follows": p["id"]}
        for p in firsts
    ]


# Fixed text (`train data --fixed-text`): the documentation and code of these modules, none of
# them a source of the prompts (whose held-out split the bench's prompts come from).
TEXT_MODULES = [
    "abc",
    "ast",
    "asyncio",
    "binascii",
    "bz2",
    "cmd",
    "codecs",
    "colorsys",
    "concurrent.futures",
    "configparser",
    "contextlib",
    "dataclasses",
    "decimal",
    "dis",
    "doctest",
    "email.message",
    "enum",
    "filecmp",
    "fileinput",
    "gettext",
    "graphlib",
    "gzip",
    "hashlib",
    "hmac",
    "http.client",
    "http.server",
    "imaplib",
    "importlib",
    "inspect",
    "io",
    "ipaddress",
    "locale",
    "logging",
    "lzma",
    "mailbox",
    "mimetypes",
    "netrc",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pickletools",
    "platform",
    "plistlib",
    "poplib",
    "pstats",
    "pydoc",
    "quopri",
    "re",
    "reprlib",
    "sched",
    "secrets",
    "selectors",
    "shlex",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "ssl",
    "struct",
    "subprocess",
    "symtable",
    "sysconfig",
    "tarfile",
    "tempfile",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "tracemalloc",
    "types",
    "typing",
    "unittest",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "warnings",
    "wave",
    "weakref",
    "xml.dom.minidom",
    "xml.etree.ElementTree",
    "zoneinfo",
    "numpy",
    "numpy.linalg",
    "numpy.fft",
    "numpy.ma",
    "numpy.polynomial.polynomial",
    "numpy.random",
    "click",
    "mlx_lm.generate",
    "mlx_lm.models.cache",
    "mlx_lm.sample_utils",
    "mlx_lm.tokenizer_utils",
    "mlx_lm.utils",
]


def _documented_objects(modules: List[str] = STDLIB_MODULES, methods: bool = False):
    """Each module, its public functions and classes (and with `methods`, the classes' public
    methods), defined there (or, with `methods`, in a submodule)."""
    import importlib

    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        yield name, module
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            home = getattr(obj, "__module__", None) or ""
            if (
                (inspect.isfunction(obj) or inspect.isclass(obj))
                and not attr.startswith("_")
                and (home == name or methods and home.startswith(name + "."))
            ):
                yield f"{name}.{attr}", obj
                if methods and inspect.isclass(obj):
                    for method in sorted(vars(obj)):
                        if inspect.isfunction(vars(obj)[method]) and not method.startswith("_"):
                            yield f"{name}.{attr}.{method}", vars(obj)[method]


def _source(obj, limit=1800) -> Optional[str]:
    try:
        code = inspect.getsource(obj)
    except (OSError, TypeError):
        return None
    return code if 80 < len(code) <= limit else None


def instruction_prompts(topics: List[str], activities: List[str], rng: random.Random) -> List[Dict[str, str]]:
    """Every instruction template with every subject of its kind."""
    prompts = []
    for i, template in enumerate(INSTRUCTIONS):
        subjects = activities if "{activity}" in template else topics
        for subject in subjects:
            other = rng.choice([t for t in topics if t != subject])
            text = template.format(topic=subject, activity=subject, other=other)
            prompts.append({"id": f"instr-{i}-{subject}", "source": "instructions", "prompt": text})
    return prompts


def document_prompts(modules: List[str]) -> List[Dict[str, str]]:
    """Explain or comment the code of the modules' functions and classes; summarize or rewrite
    their documentation."""
    prompts = []
    for name, obj in _documented_objects(modules):
        doc = inspect.getdoc(obj) or ""
        code = _source(obj) if not inspect.ismodule(obj) else None
        if code:
            prompts.append(
                {
                    "id": f"code-explain-{name}",
                    "source": "code",
                    "prompt": f"Explain what this Python code does:\n\n{code}",
                }
            )
            stripped = code.replace(f'"""{obj.__doc__}"""', "") if obj.__doc__ else code
            prompts.append(
                {
                    "id": f"code-doc-{name}",
                    "source": "code",
                    "prompt": f"Add a docstring and comments to this Python code and return it:\n\n{stripped}",
                }
            )
        if 200 < len(doc) < 2500:
            text = textwrap.shorten(doc, 1500, placeholder=" ...") if len(doc) > 1500 else doc
            prompts.append(
                {
                    "id": f"summarize-{name}",
                    "source": "summarize",
                    "prompt": f"Summarize the following documentation in a few sentences:\n\n{text}",
                }
            )
            prompts.append(
                {
                    "id": f"rewrite-{name}",
                    "source": "rewrite",
                    "prompt": f"Rewrite this text in plain, simple English:\n\n{text}",
                }
            )
    return prompts


def build_prompts(seed: int = 0) -> List[Dict[str, str]]:
    """Every prompt of every source, with a stable id."""
    rng = random.Random(seed)
    prompts = instruction_prompts(TOPICS, ACTIVITIES, rng)
    for i in range(300):
        template = WORD_PROBLEMS[i % len(WORD_PROBLEMS)]
        values = dict(a=rng.randint(12, 480), b=rng.randint(2, 60), c=rng.randint(2, 12), d=rng.randint(2, 9))
        prompts.append({"id": f"math-{i}", "source": "arithmetic", "prompt": template.format(**values)})
    prompts += document_prompts(STDLIB_MODULES)
    # Own random streams: the prompts above stay as they were before these sources.
    firsts = chat_prompts(seed)
    # Sources of 2026-12-06 (the weakest held-out kinds then: instructions, summaries, rewrites).
    more = instruction_prompts(MORE_TOPICS, MORE_ACTIVITIES, random.Random(f"instr-more-{seed}"))
    prompts += document_prompts(MORE_MODULES)
    instructions = [p for p in prompts if p["source"] == "instructions"] + more
    prompts += more + firsts + second_turns(firsts + instructions, seed)
    seen, unique = set(), []
    for p in prompts:
        if p["id"] not in seen:
            seen.add(p["id"])
            unique.append(p)
    rng.shuffle(unique)
    return unique


def fixed_text() -> List[Dict[str, str]]:
    """Text the target did not write, each piece as the answer to a question about it: the
    docstrings and the code of TEXT_MODULES. For soft labels (the target's distribution at each
    position), where answering is the bottleneck: rows cost a tokenization, not a generation."""
    rows = []
    for name, obj in _documented_objects(TEXT_MODULES, methods=True):
        doc = inspect.getdoc(obj) or ""
        if 120 < len(doc) <= 4000:
            rows.append(
                {
                    "id": f"text-doc-{name}",
                    "source": "text-doc",
                    "prompt": f"What does `{name}` do?",
                    "response": doc,
                }
            )
        code = _source(obj, limit=4000) if not inspect.ismodule(obj) else None
        if code:
            rows.append(
                {
                    "id": f"text-code-{name}",
                    "source": "text-code",
                    "prompt": f"Show me the Python source of `{name}`.",
                    "response": code,
                }
            )
    return rows


def write_fixed_text(tokenizer, out_dir, limit: Optional[int] = None, seed: int = 0) -> Dict[str, int]:
    """fixed_text() as `train data` rows (prompt in the chat template, response tokens ended
    like an answer), in a seeded order; rows already there (by id) are kept."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = {row["id"] for split in ("train", "heldout") for row in read_split(out_dir, split)}
    rows = fixed_text()
    random.Random(seed).shuffle(rows)
    rows = rows[:limit]
    counts = {"skipped": sum(r["id"] in done for r in rows), "written": 0, "total": len(rows)}
    eos = tokenizer.eos_token_id
    for split in ("train", "heldout"):
        with open(out_dir / f"{split}.jsonl", "a") as f:
            for r in rows:
                if r["id"] in done or split_of(r) != split:
                    continue
                prompt_tokens = tokenizer.apply_chat_template(
                    [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True
                )
                response_tokens = tokenizer.encode(r["response"], add_special_tokens=False) + [eos]
                f.write(
                    json.dumps(
                        dict(
                            r,
                            prompt_tokens=list(prompt_tokens),
                            response_tokens=[int(t) for t in response_tokens],
                        )
                    )
                    + "\n"
                )
                counts["written"] += 1
        counts[split] = len(read_split(out_dir, split))
    return counts


def is_heldout(prompt_id: str, fraction: float = 0.05) -> bool:
    digest = hashlib.sha256(prompt_id.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < fraction


def split_of(prompt: Dict[str, str]) -> str:
    """A second turn goes where its first turn went: its context is that turn's answer (a
    third turn and later: `first`, the conversation's first turn)."""
    return "heldout" if is_heldout(prompt.get("first", prompt.get("follows", prompt["id"]))) else "train"


def read_split(directory, split: str) -> List[dict]:
    path = Path(directory) / f"{split}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


KINDS = ("chat", "instruction", "arithmetic", "code", "summary", "rewrite")


def load_prompts_file(path) -> List[Dict[str, str]]:
    """The prompts of a JSONL file (gzipped if its name ends in .gz), in its order: each row
    {"id", "source", "kind", "prompt"} or a conversation {"id", ..., "turns": [user turns]},
    whose turn i > 1 becomes the prompt "ID-i" that `follows` the one before it (answered after
    it, with the target's answers as the context, in the first turn's split). The layout of
    `mlx-spec bench --prompts` ({"question_id", "category", ...}) is read as well."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    prompts, seen = [], set()
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")  # not splitlines(): U+2028 may be in a string
    except (OSError, UnicodeDecodeError) as e:
        raise MlxSpecError(f"cannot read prompts {path}: {e}") from None
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MlxSpecError(f"{path} line {number} is not JSON: {e.msg} (column {e.colno})") from None
            if not isinstance(row, dict):
                raise MlxSpecError(f"{path} line {number}: expected an object")
            if "question_id" in row and "id" not in row:
                row = dict(row, id=str(row["question_id"]), kind=row.get("category"), source=path.stem)
            turns = row.get("turns") or [row.get("prompt")]
            if not row.get("id") or not all(isinstance(t, str) and t for t in turns):
                raise MlxSpecError(f"{path} line {number}: expected an 'id' and a 'prompt' or 'turns'")
            base = {k: row[k] for k in ("source", "kind") if k in row}
            previous = None
            for i, text in enumerate(turns):
                p = dict(base, id=row["id"] if i == 0 else f"{row['id']}-{i + 1}", prompt=text)
                if previous:
                    p["follows"] = previous
                    if i > 1:
                        p["first"] = row["id"]  # its split (split_of)
                if p["id"] in seen:
                    raise MlxSpecError(f"{path} line {number}: id {p['id']} appears twice")
                seen.add(p["id"])
                prompts.append(p)
                previous = p["id"]
    return prompts


def generate_data(
    target,
    out_dir,
    limit: Optional[int] = None,
    max_tokens: int = 256,
    batch_size: int = 32,
    temp: float = 0.0,
    seed: int = 0,
    progress: Optional[Callable[[int], None]] = None,
    prompts: Optional[List[Dict[str, str]]] = None,
    window: Optional[int] = None,
    max_minutes: Optional[float] = None,
) -> Dict[str, int]:
    """Answer the prompts (default: build_prompts(seed)) with the target; append to
    out_dir/{train,heldout}.jsonl. Prompts already answered (by id) are skipped, so an
    interrupted run resumes. `window`: answer the prompts `window` at a time, in their order
    (None: all at once). `max_minutes`: start no batch after that long; counts["stopped"] is
    then the number of prompts left."""
    import mlx.core as mx
    from mlx_lm import batch_generate
    from mlx_lm.sample_utils import make_sampler

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    answered = {row["id"]: row for split in ("train", "heldout") for row in read_split(out_dir, split)}
    prompts = (build_prompts(seed) if prompts is None else prompts)[:limit]
    pending = [p for p in prompts if p["id"] not in answered]
    mx.random.seed(seed)
    tokenizer = target.tokenizer
    sampler = make_sampler(temp)
    counts = {"skipped": len(prompts) - len(pending), "written": 0, "waiting": 0, "stopped": 0}
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    if progress:
        progress(counts["skipped"])

    def context(p):  # the conversation before p; None: a turn before is not answered (cut by --limit)
        if "follows" not in p:
            return []
        before = answered.get(p["follows"])
        earlier = None if before is None else context(before)
        return (
            None
            if earlier is None
            else earlier
            + [
                {"role": "user", "content": before["prompt"]},
                {"role": "assistant", "content": before["response"]},
            ]
        )

    def context_length(p):
        return sum(len(m["content"]) for m in context(p) or [])

    def answer(batch):
        encoded = [
            tokenizer.apply_chat_template(
                context(p) + [{"role": "user", "content": p["prompt"]}], add_generation_prompt=True
            )
            for p in batch
        ]
        result = batch_generate(
            target.model,
            tokenizer,
            encoded,
            max_tokens=max_tokens,
            sampler=sampler,
            return_token_ids=True,
            completion_batch_size=batch_size,
            prefill_batch_size=min(batch_size, 8),
        )
        for p, prompt_tokens, text, response_tokens in zip(batch, encoded, result.texts, result.token_ids):
            row = dict(
                p,
                prompt_tokens=list(prompt_tokens),
                response=text,
                response_tokens=[int(t) for t in response_tokens],
            )
            with open(out_dir / f"{split_of(p)}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
            answered[p["id"]] = row
            counts["written"] += 1

    windows = [pending[i : i + window] for i in range(0, len(pending), window)] if window else [pending]
    for todo in windows:
        # Similar lengths share a batch: batch_generate left-pads every prompt to the longest.
        todo = sorted(todo, key=lambda p: len(p["prompt"]))
        # A turn that follows another comes after it (it needs its answer as context); those are
        # sorted by the length of their context.
        turn, later = [p for p in todo if "follows" not in p], [p for p in todo if "follows" in p]
        while turn and not counts["stopped"]:
            for start in range(0, len(turn), batch_size):
                if deadline is not None and time.monotonic() > deadline:
                    counts["stopped"] = len(pending) - counts["written"]
                    break
                answer(turn[start : start + batch_size])
                if progress:
                    progress(len(turn[start : start + batch_size]))
            turn = sorted((p for p in later if p["follows"] in answered), key=context_length)
            later = [p for p in later if p["follows"] not in answered]
        if counts["stopped"]:
            break
        counts["waiting"] += len(later)  # their first turn is not among the prompts (--limit)
        if progress and later:
            progress(len(later))
    counts["total"] = len(prompts)
    for split in ("train", "heldout"):
        counts[split] = len(read_split(out_dir, split))
    return counts


def iter_sequences(directory, split: str = "train") -> Iterator[List[int]]:
    """Prompt + response token ids of every stored example."""
    for row in read_split(directory, split):
        yield row["prompt_tokens"] + row["response_tokens"]
