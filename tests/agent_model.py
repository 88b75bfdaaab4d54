"""A tiny chat model that calls tools and thinks: the default model's tokenizer with <think> and
</think> added (as single tokens, so mlx-lm's tokenizer wrapper detects a thinking model), a
Qwen-style chat template that renders tools and <tool_call> blocks (mlx-lm infers its json_tools
parser from it), and weights trained here, in seconds, to answer a few conversations with the
replies given, token for token, greedy. Real formats: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json."""

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from tiny import save_model, tiny_config, tiny_model

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    "{% endif %}# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}\n<|im_start|>user\n{{ message['content'] }}<|im_end|>"
    "{%- elif message['role'] == 'assistant' %}\n<|im_start|>assistant\n{{ message['content'] }}"
    "{%- for tool_call in message.get('tool_calls', []) %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}<tool_call>\n"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}<|im_end|>"
    "{%- elif message['role'] == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ message['content'] }}"
    "\n</tool_response><|im_end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINKING = ["<think>", "</think>"]  # tokens of their own: mlx-lm's wrapper then detects thinking


def _tokenizer(path: Path, texts) -> None:
    """A byte-level BPE tokenizer trained on `texts` (a few hundred tokens: the model trains in
    seconds), written as tokenizer.json and tokenizer_config.json with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer.add_tokens(THINKING)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "unk_token": None,
            }
        )
    )


def prompt_of(tokenizer, conversation) -> list:
    """A conversation's prompt: its messages through the chat template (with its tools and
    template arguments), then its `suffix` text (a reply due to begin with a tool call)."""
    text = tokenizer.apply_chat_template(
        conversation["messages"],
        tools=conversation.get("tools"),
        add_generation_prompt=True,
        tokenize=False,
        **conversation.get("template", {}),
    )
    return tokenizer.encode(text + conversation.get("suffix", ""), add_special_tokens=False)


def agent_model_dir(path, conversations, steps=600, seed=0) -> Path:
    """conversations: [{"messages", "tools", "template", "suffix", "reply"}]: the model is
    trained until greedy decoding writes each reply after its prompt (then its end-of-turn
    token)."""
    from mlx_lm.utils import load_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    texts = [TEMPLATE] + [json.dumps(c) for c in conversations]
    _tokenizer(path, texts)
    vocab_size = len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]) + len(THINKING)
    model_config = tiny_config(vocab_size=vocab_size, hidden_size=128, context=2048)
    save_model(tiny_model(model_config, seed=seed, scale=1.0), model_config, path)  # for the tokenizer
    tokenizer = load_tokenizer(path)
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    samples = []
    for conversation in conversations:
        reply = tokenizer.encode(conversation["reply"], add_special_tokens=False) + end
        samples.append((prompt_of(tokenizer, conversation), reply))
    model = tiny_model(model_config, seed=seed, scale=1.0)
    optimizer = optim.Adam(learning_rate=optim.cosine_decay(3e-3, steps))

    def loss_fn(model, inputs, targets, weights):
        logits = model(inputs)
        return (nn.losses.cross_entropy(logits, targets) * weights).sum() / weights.sum()

    width = max(len(p) + len(r) for p, r in samples)
    inputs, targets, weights = [], [], []
    for prompt, reply in samples:
        sequence = prompt + reply
        pad = width - len(sequence)
        inputs.append(sequence[:-1] + [0] * pad)
        targets.append(sequence[1:] + [0] * pad)
        weights.append([0.0] * (len(prompt) - 1) + [1.0] * len(reply) + [0.0] * pad)
    inputs, targets, weights = mx.array(inputs), mx.array(targets), mx.array(weights)
    step = nn.value_and_grad(model, loss_fn)
    for _ in range(steps):
        loss, grads = step(model, inputs, targets, weights)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
    save_model(model, model_config, path)
    return path
