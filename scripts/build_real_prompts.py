"""Build benchmarks/training/real/prompts.jsonl.gz (real instruction and chat prompts for
drafter training, answered by `mlx-spec train data --prompts-file`) and
benchmarks/real_dev_prompts.jsonl (a dev set drawn from their held-out split).

The sources are public data sets on GitHub, read from snapshots fetched beforehand into MIRROR
(bare git directories MIRROR/<owner>+<name>/repo, as the session's `fetch` tool writes them);
every file is read at the commit pinned in SOURCES, so the output is reproducible. Only data is
read (never any code of those repositories), and only training splits: no benchmark's test
questions (GSM8K test, HumanEval, MBPP, MT-Bench, Spec-Bench), no evaluation sets.

Each row: {"id", "source", "kind", "prompt"} or, for a conversation, {"id", "source", "kind",
"turns": [first user turn, second user turn]} (the target answers each turn in turn, its own
answer as the context, as `mlx-spec bench` does). Kinds: chat, instruction, arithmetic, code,
summary, rewrite. An instruction with an `input` is one user message: the instruction, a blank
line, the input. Duplicates (same text up to case and spacing) are dropped, the first source
in SOURCES order keeping its copy; prompts longer than MAX_TOKENS tokens of the default model's
tokenizer (all turns together) are dropped. The id is the source and a hash of the text (stable
when sources are added); the rows take the kinds in turn, each kind in the order of a hash of
the id (answering follows the file's order: a part answered holds every kind alike).

Usage: .venv/bin/python scripts/build_real_prompts.py [--mirror /work/.mirror]
"""

import argparse
import gzip
import hashlib
import io
import json
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlx_spec.train.data import is_heldout, load_prompts_file  # noqa: E402

OUT = ROOT / "benchmarks" / "training" / "real" / "prompts.jsonl.gz"
DEV = ROOT / "benchmarks" / "real_dev_prompts.jsonl"
MAX_TOKENS = 400
SGD_CONVERSATIONS = 1500  # task-oriented dialogues are many and alike: a sample
# The dev set: this many held-out prompts of each kind (chat: a third of them conversations).
DEV_PER_KIND = {"chat": 24, "instruction": 24, "arithmetic": 16, "code": 16, "summary": 14, "rewrite": 14}

ALPACA = ("tatsu-lab/stanford_alpaca", "761dc5bfbdeeffa89b8bff5d038781a4055f796a")
# alpaca_data.json (22 MB) is not in the snapshot (files of 4 MiB and more are left out); a
# 5,000-instruction subset of it is, in pull request 152's branch.
ALPACA_5000 = ("tatsu-lab/stanford_alpaca", "5e69c50054c48cd3b919c46d13bb2d92a62f4498")
CODEALPACA = ("sahil280114/codealpaca", "2f78ddc5c682ed6738ad092bbbfa59ba915afcb0")
GPTEACHER = ("teknium1/GPTeacher", "481075123c29854bddb82655badeef6a438f2436")
GSM8K = ("openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c")
WILD = ("XueFuzhao/InstructionWild", "047fa6b9abd4a0b2d5ed6f0f9bbc14df5bd6b1d6")
SGD = ("google-research-datasets/dstc8-schema-guided-dialogue", "e852981ae34990f4358979625854259302feaa78")
SELF_INSTRUCT = ("yizhongw/self-instruct", "0b26ccaa415992100fa32df62d41b994cf928e23")
T0 = "data/finetuning/t0_train_50k/data_per_template/"


class Mirror:
    def __init__(self, root):
        self.root = Path(root)

    def git(self, repo, *args):
        git_dir = self.root / repo.replace("/", "+") / "repo"
        if not git_dir.exists():
            raise SystemExit(f"no snapshot of {repo} in {git_dir}: fetch github:{repo} first")
        result = subprocess.run(["git", "--git-dir", str(git_dir), *args], capture_output=True)
        if result.returncode:
            raise SystemExit(f"git {' '.join(args)} in {repo}: {result.stderr.decode().strip()}")
        return result.stdout

    def text(self, source, path):
        repo, commit = source
        return self.git(repo, "show", f"{commit}:{path}").decode("utf-8")

    def json(self, source, path):
        return json.loads(self.text(source, path))

    def jsonl(self, source, path):
        rows = []
        for line in self.text(source, path).splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # InstructionWild's user_3 has two lines with bad escapes
                    continue
        return rows

    def files(self, source, folder):
        repo, commit = source
        names = self.git(repo, "ls-tree", "-r", "-l", commit, folder).decode().splitlines()
        # no size: the blob is not in the snapshot (a file of 4 MiB or more)
        return [line.split("\t")[1] for line in names if line.split()[3].isdigit()]


CODE = re.compile(
    r"\b(python|java|javascript|typescript|c\+\+|c#|golang|rust|ruby|php|sql|html|css|bash|"
    r"code|function|program|programming|algorithm|regex|regular expression|json|api|"
    r"pseudocode|array|linked list|database query)\b",
    re.I,
)
SUMMARY = re.compile(r"\b(summari[sz]e|summary|summarization|tl;?dr|sum up|main points|key points)\b", re.I)
REWRITE = re.compile(
    r"^\s*(please\s+)?(rewrite|re-write|rephrase|paraphrase|reword|edit|revise|restate|"
    r"proofread|simplify|shorten|condense)\b|"
    r"\b(rewrite|rephrase|paraphrase|passive voice|active voice|grammatical errors)\b|"
    r"\bmake (this|the|it|these|that)\b.*\b(more|less|shorter|longer|simpler|clearer|formal)\b|"
    r"\b(convert|change|transform|turn) (this|the|it|these|following|given)\b.*"
    r"\b(sentence|text|paragraph|passage|statement|tense|voice)\b|"
    r"\bcorrect (the|this|any)\b.*\b(grammar|spelling|errors?|sentence)\b",
    re.I,
)
ARITHMETIC = re.compile(
    r"\b(calculate|compute|how many|how much|solve|equation|percent|percentage|average|"
    r"sum of|product of|divided|multiply|multiplied|area|perimeter|volume|interest)\b|"
    r"\d\s*[-+*/x×^]\s*\d",
    re.I,
)


def kind_of(instruction, text, default="instruction"):
    """A kind by the words of the instruction (and, for code and arithmetic, the whole text)."""
    if CODE.search(instruction) or re.search(r"```|def \w+\(|#include|</?\w+>|;\s*$", text, re.M):
        return "code"
    if SUMMARY.search(instruction):
        return "summary"
    if REWRITE.search(instruction):
        return "rewrite"
    if ARITHMETIC.search(instruction) and re.search(r"\d", text):
        return "arithmetic"
    return default


def joined(instruction, input_text=""):
    """An instruction and its input as one user message, as people write them."""
    instruction, input_text = instruction.strip(), (input_text or "").strip()
    if input_text.lower() in ("", "<noinput>", "noinput", "none", "n/a"):
        return instruction
    return f"{instruction}\n\n{input_text}"


def alpaca_like(rows, source, default="instruction", kind=None):
    out = []
    for r in rows:
        instruction = r.get("instruction", "")
        text = joined(instruction, r.get("input", ""))
        out.append({"source": source, "kind": kind or kind_of(instruction, text, default), "prompt": text})
    return out


def seed_tasks(rows, source, kind=None):
    """Self-instruct's seed tasks: the instruction with each instance's input."""
    out = []
    for r in rows:
        for instance in r["instances"]:
            text = joined(r["instruction"], instance.get("input", ""))
            out.append({"source": source, "kind": kind or kind_of(r["instruction"], text), "prompt": text})
    return out


def sgd_conversations(mirror):
    """The first two user turns of dialogues of the schema-guided dialogue TRAIN split, sampled
    evenly over the services (stable: by a hash of the dialogue id)."""
    by_service = defaultdict(list)
    for path in mirror.files(SGD, "train/"):
        if not re.search(r"dialogues_\d+\.json$", path):
            continue
        for dialogue in mirror.json(SGD, path):
            users = [t["utterance"].strip() for t in dialogue["turns"] if t["speaker"] == "USER"]
            if len(users) >= 2 and len(users[0].split()) >= 4 and len(users[1].split()) >= 3:
                key = hashlib.sha256(dialogue["dialogue_id"].encode()).hexdigest()
                by_service["+".join(sorted(dialogue["services"]))].append((key, users[:2]))
    for items in by_service.values():
        items.sort()
    picked, depth = [], 0
    while len(picked) < SGD_CONVERSATIONS and any(depth < len(v) for v in by_service.values()):
        for service in sorted(by_service):
            if depth < len(by_service[service]) and len(picked) < SGD_CONVERSATIONS:
                picked.append(by_service[service][depth][1])
        depth += 1
    return [{"source": "sgd", "kind": "chat", "turns": turns} for turns in picked]


def t0_prompts(mirror, prefix, kind, source, skip=()):
    """T0 training-mixture prompts (as the self-instruct repository ships them, one file per
    template): one template's wording per underlying example (the templates share examples; an
    example is known by its longest line), the template chosen by a hash."""
    out, seen = [], set()
    for path in sorted(mirror.files(SELF_INSTRUCT, T0)):
        name = path.rsplit("/", 1)[1]
        if not name.startswith(prefix) or any(s in name for s in skip):
            continue
        for r in mirror.jsonl(SELF_INSTRUCT, path):
            text = r["prompt"].replace("\r\n", "\n").strip()
            key = max(text.splitlines(), key=len)
            if key not in seen:
                seen.add(key)
                out.append({"source": source, "kind": kind, "prompt": text})
    return out


def collect(mirror):
    """Every source's rows, in the order that decides which copy of a duplicate stays."""
    rows = []
    gsm8k = mirror.jsonl(GSM8K, "grade_school_math/data/train.jsonl")  # the TRAIN split only
    rows += alpaca_like([{"instruction": r["question"]} for r in gsm8k], "gsm8k-train", kind="arithmetic")
    rows += alpaca_like(mirror.json(ALPACA_5000, "data/alpaca_5000.json"), "alpaca")
    rows += seed_tasks(mirror.jsonl(ALPACA, "seed_tasks.jsonl"), "alpaca-seed")
    rows += alpaca_like(
        mirror.json(GPTEACHER, "Codegen/codegen-instruct.json"), "gpteacher-code", kind="code"
    )
    rows += alpaca_like(mirror.json(CODEALPACA, "data/code_alpaca_2k.json"), "codealpaca", kind="code")
    rows += seed_tasks(mirror.jsonl(CODEALPACA, "seed_tasks.jsonl"), "codealpaca-seed", kind="code")
    rows += alpaca_like(
        mirror.json(GPTEACHER, "Roleplay/roleplay-simple-deduped-roleplay-instruct.json"),
        "gpteacher-roleplay",
        kind="chat",
    )
    for name in ("user_1", "user_2", "user_3"):
        rows += alpaca_like(mirror.jsonl(WILD, f"data_v2/{name}.jsonl"), "instructionwild", default="chat")
    rows += sgd_conversations(mirror)
    rows += t0_prompts(mirror, "samsum_", "summary", "samsum", skip=("Write_a_dialogue",))
    rows += t0_prompts(mirror, "xsum_", "summary", "xsum")
    rows += t0_prompts(
        mirror, "cnn_dailymail_", "summary", "cnn-dailymail", skip=("generate_story", "spice_up")
    )
    rows += t0_prompts(mirror, "glue_mrpc_generate_paraphrase", "rewrite", "mrpc")
    return rows


def normalized(text):
    return re.sub(r"\s+", " ", text.strip().lower())


def build(mirror, tokenizer):
    from mlx_spec.bench_suite import SUITE
    from mlx_spec.train.data import build_prompts

    # Never a prompt of the bench suites or of the assembled sources.
    taken = {normalized(p["prompt"]) for p in build_prompts()} | {normalized(s["prompt"]) for s in SUITE}
    for line in (ROOT / "benchmarks" / "heldout_prompts.jsonl").read_text().splitlines():
        q = json.loads(line)
        taken |= {normalized(t) for t in q.get("turns", [q.get("prompt", "")])}
    kept, dropped = [], Counter()
    for row in collect(mirror):
        turns = row.get("turns") or [row["prompt"]]
        turns = [t.replace("\r\n", "\n").strip() for t in turns]
        keys = [normalized(t) for t in turns]
        if any(len(k) < 8 for k in keys):
            dropped[row["source"], "short"] += 1
            continue
        if any(k in taken for k in keys if len(turns) == 1) or (len(turns) > 1 and "\n".join(keys) in taken):
            dropped[row["source"], "duplicate"] += 1
            continue
        if sum(len(tokenizer.encode(t)) for t in turns) > MAX_TOKENS:
            dropped[row["source"], "long"] += 1
            continue
        taken.add(keys[0] if len(turns) == 1 else "\n".join(keys))
        digest = hashlib.sha256("\n".join(turns).encode()).hexdigest()[:12]
        out = {"id": f"{row['source']}-{digest}", "source": row["source"], "kind": row["kind"]}
        out.update({"turns": turns} if len(turns) > 1 else {"prompt": turns[0]})
        kept.append(out)
    return interleaved(kept), dropped


def interleaved(rows):
    """The kinds in turn, each in the order of a hash of the id: the prompts answered first (a
    run cut short) are as many of each kind as there are, not the larger sources'."""
    by_kind = defaultdict(list)
    for r in sorted(rows, key=lambda r: hashlib.sha256(f"order-{r['id']}".encode()).hexdigest()):
        by_kind[r["kind"]].append(r)
    out = []
    for i in range(max(map(len, by_kind.values()))):
        out += [by_kind[kind][i] for kind in sorted(by_kind) if i < len(by_kind[kind])]
    return out


def dev_set(rows):
    """DEV_PER_KIND held-out prompts of each kind (a hash of the id decides which; chat: a third
    conversations, and no source more than half of a kind)."""
    chosen = []
    for kind, count in DEV_PER_KIND.items():
        pool = sorted(
            (r for r in rows if r["kind"] == kind and is_heldout(r["id"])),
            key=lambda r: hashlib.sha256(f"dev-{r['id']}".encode()).hexdigest(),
        )
        picked, per_source = [], Counter()
        if kind == "chat":
            picked = [r for r in pool if "turns" in r][: count // 3]
            per_source.update(r["source"] for r in picked)
        for r in pool:
            if (
                len(picked) < count
                and r not in picked
                and ("turns" not in r or kind != "chat")
                and per_source[r["source"]] < max(count // 2, 1)
            ):
                picked.append(r)
                per_source[r["source"]] += 1
        for r in pool:  # a kind with too few sources: fill up
            if len(picked) < count and r not in picked:
                picked.append(r)
        chosen += picked
    return [
        {
            "question_id": r["id"],
            "category": r["kind"],
            **({"turns": r["turns"]} if "turns" in r else {"prompt": r["prompt"]}),
        }
        for r in chosen
    ]


def write_gzip(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, filename="") as f:  # reproducible bytes
        for row in rows:
            f.write((json.dumps(row) + "\n").encode("utf-8"))
    path.write_bytes(buffer.getvalue())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", default="/work/.mirror", help="folder of the fetched snapshots")
    args = parser.parse_args()
    from mlx_lm.utils import load_tokenizer

    from mlx_spec.api import model_path

    rows, dropped = build(Mirror(args.mirror), load_tokenizer(model_path()))
    write_gzip(OUT, rows)
    dev = dev_set(rows)
    DEV.write_text("".join(json.dumps(q) + "\n" for q in dev))
    prompts = load_prompts_file(OUT)
    print(f"{len(rows)} rows, {len(prompts)} prompts -> {OUT.relative_to(ROOT)}")
    for source, n in sorted(Counter(r["source"] for r in rows).items()):
        kinds = Counter(r["kind"] for r in rows if r["source"] == source)
        print(
            f"  {source}: {n} rows ({', '.join(f'{k} {v}' for k, v in kinds.most_common())}); dropped: "
            + (", ".join(f"{why} {c}" for (s, why), c in sorted(dropped.items()) if s == source) or "none")
        )
    print("kinds:", dict(Counter(r["kind"] for r in rows).most_common()))
    print(f"{len(dev)} dev prompts -> {DEV.relative_to(ROOT)}:", dict(Counter(q["category"] for q in dev)))


if __name__ == "__main__":
    main()
