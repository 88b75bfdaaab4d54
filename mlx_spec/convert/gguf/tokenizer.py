"""The tokenizer of a GGUF file, rebuilt from its metadata as a `tokenizers` tokenizer
(vocabulary, merges, pre-tokenizer, special tokens, chat template)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from mlx_spec.errors import MlxSpecError

from .reader import md_int

# GGUF token types (llama.cpp's llama_token_type)
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4
_TOKEN_UNUSED, _TOKEN_BYTE = 5, 6

# Pre-tokenizer regexes (what `tokenizer.ggml.pre` names), written for `tokenizers`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# pre name -> (kind, regex); kind: "bytelevel" (GPT-2 regex), "digits" (each digit alone, then
# the GPT-2 regex), "split" (a custom regex, then byte-level mapping without the GPT-2 regex)
_PRE_TOKENIZERS = {
    "default": ("bytelevel", None),
    "gpt2": ("bytelevel", None),
    "gpt-2": ("bytelevel", None),
    "smollm": ("digits", None),
    "starcoder": ("digits", None),
    "refact": ("digits", None),
    "llama-bpe": ("split", _LLAMA3_SPLIT),
    "llama3": ("split", _LLAMA3_SPLIT),
    "qwen2": ("split", _QWEN2_SPLIT),
}
# Pre-tokenizers for which llama.cpp does not apply BPE merges to a word already in the vocab.
_IGNORE_MERGES_PRE = {"llama-bpe", "llama3"}


def _split_merge(m: str) -> Tuple[str, str]:
    # like llama.cpp: the separator is the first space after the first character
    i = m.find(" ", 1)
    if i < 0:
        raise MlxSpecError(f"bad BPE merge in GGUF metadata: {m!r}")
    return m[:i], m[i + 1 :]


def build_tokenizer(md: Dict[str, Any]):
    """A `tokenizers.Tokenizer` plus tokenizer_config / special_tokens_map dicts from metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = md.get("tokenizer.ggml.model")
    if kind is None:
        raise MlxSpecError("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
    if kind != "gpt2":
        raise MlxSpecError(f"unsupported tokenizer: tokenizer.ggml.model = {kind}")
    pre = md.get("tokenizer.ggml.pre", "default") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise MlxSpecError(f"unsupported tokenizer: tokenizer.ggml.pre = {pre}")

    tokens: List[str] = list(md.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise MlxSpecError("GGUF file has no tokenizer.ggml.tokens")
    types = list(md.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise MlxSpecError("GGUF tokenizer.ggml.token_type and tokens differ in length")
    merges = [_split_merge(m) for m in (md.get("tokenizer.ggml.merges") or [])]

    vocab: Dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated string keeps its first id

    model = models.BPE(
        vocab=vocab,
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
        ignore_merges=pre in _IGNORE_MERGES_PRE,
    )
    tok = Tokenizer(model)

    pre_kind, regex = _PRE_TOKENIZERS[pre]
    if pre_kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre_kind == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()

    specials = [t for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED]
    if specials:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token_id(kind: str) -> Optional[int]:
        i = md.get(f"tokenizer.ggml.{kind}_token_id")
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    ids = {k: token_id(k) for k in ("bos", "eos", "padding", "unknown")}
    names = {k: (tokens[i] if i is not None else None) for k, i in ids.items()}
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and ids["bos"] is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and ids["eos"] is not None

    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos or add_eos:
        bos, eos = names["bos"], names["eos"]

        def seq(piece: str, type_id: int) -> List[str]:
            return (
                ([f"{bos}:{type_id}"] if add_bos else [])
                + [f"{piece}:{type_id}"]
                + ([f"{eos}:{type_id}"] if add_eos else [])
            )

        used = {bos: ids["bos"]} if add_bos else {}
        if add_eos:
            used[eos] = ids["eos"]
        template = processors.TemplateProcessing(
            single=" ".join(seq("$A", 0)),
            pair=" ".join(seq("$A", 0) + seq("$B", 1)),
            special_tokens=list(used.items()),
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level

    special_map: Dict[str, Any] = {}
    for key, kind in (
        ("bos_token", "bos"),
        ("eos_token", "eos"),
        ("pad_token", "padding"),
        ("unk_token", "unknown"),
    ):
        if names[kind] is not None:
            special_map[key] = names[kind]
    extra = [t for t in specials if t not in special_map.values()]
    if extra:
        special_map["additional_special_tokens"] = extra

    tok_config: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": md_int(md, f"{md.get('general.architecture')}.context_length", 2048),
        **{k: v for k, v in special_map.items() if k != "additional_special_tokens"},
    }
    template = md.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok_config["chat_template"] = template
    return tok, tok_config, special_map
