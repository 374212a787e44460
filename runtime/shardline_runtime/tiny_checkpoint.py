"""Tiny checkpoints for tests, benchmarks and the demo.

No model can be downloaded here, so everything that needs a model (the test suite, the
benchmarks, ``make demo``) builds one: a byte-level BPE tokenizer trained on a small built-in
corpus, and a randomly initialised HuggingFace model of a supported architecture written with
``save_pretrained`` as safetensors. The files are exactly what a real HuggingFace checkpoint
directory holds (``config.json``, ``model.safetensors`` or shards plus
``model.safetensors.index.json``, ``tokenizer.json``, ``tokenizer_config.json`` with a chat
template), so the runtime loads them through its real loading path.

Command line::

    python -m shardline_runtime.tiny_checkpoint OUT_DIR --arch llama --seed 0 [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "qwen2_moe", "mixtral")

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A Hermes / Qwen2.5-style template (tools in the system turn, calls as <tool_call> blocks, tool
# results as <tool_response> in a user turn): for the tool-calling tests and --tool-call-parser
# hermes.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\nYou may call functions. Signatures within <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Answer a call as <tool_call>\n{"name": <name>, "arguments": <arguments>}\n</tool_call>'
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    '<tool_call>\n{"name": {{ call.function.name | tojson }}, "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the model serves tokens over a tensor parallel group of pods each rank holds a shard of "
    "every weight matrix and the scheduler batches requests continuously while the cache keeps "
    "keys and values for every layer kubernetes restarts the whole group when one member fails "
    "weights roll in place from disk and graphs are captured again before the pod is ready "
    "hello world how are you today the quick brown fox jumps over the lazy dog again and again "
    "one two three four five six seven eight nine ten eleven twelve a b c d e f g h i j k"
).split()

_EXTRA_TEXT = [
    "机器学习 模型 推理 服务 张量 并行 你好 世界 今天 天气 很好",
    "東京 大阪 日本語 テキスト こんにちは ありがとう",
    "emoji 🙂 🚀 🎉 ✨ 🔥 👍 🤖 😀 — naïve café résumé Ωμέγα Привет",
    "def forward(self, x): return self.linear(x) + 1  # code {json: [1, 2, 3]}",
]


def _corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        out.append(" ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + ".")
    out.extend(_EXTRA_TEXT * 20)
    return out


def train_tokenizer(
    out_dir: str | Path,
    vocab_size: int = 512,
    add_bos: bool = False,
    chat_template: str = CHAT_TEMPLATE,
):
    """Train a byte-level BPE tokenizer and save it as a HuggingFace fast tokenizer.

    Args:
        out_dir: directory to write ``tokenizer.json`` and ``tokenizer_config.json`` into.
        vocab_size: total vocabulary size including the special tokens (ids 0..4 are
            ``<|pad|> <|bos|> <|eos|> <|im_start|> <|im_end|>``).
        add_bos: give the tokenizer a post-processor that prepends ``<|bos|>`` when special
            tokens are added (Llama-style), instead of none.
        chat_template: the Jinja chat template saved with the tokenizer.

    Returns:
        The ``transformers.PreTrainedTokenizerFast`` that was saved.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if add_bos:
        bos_id = tok.token_to_id("<|bos|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return fast


def tiny_config(arch: str = "llama", vocab_size: int = 512, **overrides: Any):
    """Return a small ``transformers`` config of ``arch`` (one of ``ARCHITECTURES``).

    Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, 512 positions,
    float32; the MoE archs have 8 experts, top-2, expert intermediate 32 (Mixtral: 64), and
    Qwen2-MoE a shared expert of 48. ``overrides`` are passed to the config class (e.g. ``num_key_value_heads=1``,
    ``rope_scaling={...}``, ``tie_word_embeddings=True``).

    Raises:
        ValueError: ``arch`` is not one of ``ARCHITECTURES``.
    """
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
    }
    if arch not in classes:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = 16
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = None
    if arch in ("qwen3_moe", "qwen2_moe"):
        kwargs.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = 48
    if arch == "mixtral":
        kwargs.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def make_tiny_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    add_bos: bool = False,
    chat_template: str = CHAT_TEMPLATE,
    **overrides: Any,
) -> Path:
    """Write a randomly initialised checkpoint of ``arch`` into ``out_dir``.

    Args:
        out_dir: target directory (created).
        arch: one of ``ARCHITECTURES``.
        seed: ``torch.manual_seed`` for the weights; two seeds give two "revisions".
        vocab_size: model vocabulary (>= the tokenizer's 512 entries).
        max_shard_size: e.g. ``"20KB"`` to force several safetensors shards plus
            ``model.safetensors.index.json``.
        tokenizer: also train and save the tokenizer into ``out_dir``.
        add_bos / chat_template: passed to :func:`train_tokenizer`.
        overrides: passed to :func:`tiny_config`.

    Returns:
        ``Path(out_dir)``; every file in it is readable by all users (the runtime pods run as
        uid 10001, not as the writer).
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, vocab_size=vocab_size, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    if tokenizer:
        train_tokenizer(
            out, vocab_size=min(512, vocab_size), add_bos=add_bos, chat_template=chat_template
        )
    # save_pretrained writes shards 0600; the runtime pods read them as uid 10001.
    for written in out.iterdir():
        if written.is_file():
            written.chmod(written.stat().st_mode | 0o444)
    return out


def make_cycle_checkpoint(src: str | Path, dst: str | Path, cycle: list[int], logit: float) -> Path:
    """Copy the llama checkpoint ``src`` to ``dst`` with weights that continue ``cycle``: after
    token ``cycle[j]`` the next-token logit of ``cycle[j + 1]`` (wrapping) is ``logit`` and every
    other id's is 0 (after ``tests/serving/parrot_checkpoint.py``: attention and MLP outputs
    zeroed, so the last hidden state is the normalised embedding; cycle embeddings are basis
    vectors). Greedy output then repeats the cycle; at temperature 1 it continues it with
    probability ``e^logit / (e^logit + vocab - 1)``. Used by the speculative-decoding tests and
    ``bench/speculative.py`` as a model that copies its context.

    Raises:
        ValueError: ``cycle`` repeats an id, or is longer than the hidden size.
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if len(set(cycle)) != len(cycle):
        raise ValueError(f"cycle repeats a token id: {cycle}")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    (path,) = sorted(Path(dst).glob("*.safetensors"))
    weights = load_file(str(path))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    hidden = embed.shape[1]
    if len(cycle) > hidden:
        raise ValueError(f"cycle of {len(cycle)} tokens exceeds hidden size {hidden}")
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    weights["model.norm.weight"].fill_(1.0)
    head.zero_()
    for j, token in enumerate(cycle):
        embed[token] = torch.zeros(hidden)
        embed[token, j] = 1.0
        # the final RMSNorm scales a basis vector by sqrt(hidden)
        head[cycle[(j + 1) % len(cycle)], j] = logit / hidden**0.5
    save_file(weights, str(path), metadata={"format": "pt"})
    return Path(dst)


def make_draft_checkpoint(
    src: str | Path,
    dst: str | Path,
    num_layers: int | None = None,
    noise: float = 0.0,
    seed: int = 0,
) -> Path:
    """Copy the single-file llama checkpoint ``src`` to ``dst`` as a draft model of it: only its
    first ``num_layers`` decoder layers (all when None; a layer-skip draft), and Gaussian noise of
    ``noise`` times its standard deviation added to ``lm_head.weight``, so the draft's argmax
    agrees with the target's often but not always. Used by the speculative-decoding tests and
    ``bench/speculative.py`` as a STANDALONE draft.

    Raises:
        ValueError: ``num_layers`` outside [1, the source's layers].
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    config_path = Path(dst) / "config.json"
    config = json.loads(config_path.read_text())
    layers = config["num_hidden_layers"]
    keep = layers if num_layers is None else num_layers
    if not 1 <= keep <= layers:
        raise ValueError(f"num_layers must be in [1, {layers}], got {num_layers}")
    (path,) = sorted(Path(dst).glob("*.safetensors"))
    weights = {
        name: t
        for name, t in load_file(str(path)).items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < keep
    }
    head = weights["lm_head.weight"]
    gen = torch.Generator().manual_seed(seed)
    head += noise * head.std() * torch.randn(head.shape, generator=gen, dtype=head.dtype)
    save_file(weights, str(path), metadata={"format": "pt"})
    config["num_hidden_layers"] = keep
    config_path.write_text(json.dumps(config, indent=2))
    return Path(dst)


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=ARCHITECTURES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument(
        "--max-shard-size",
        default=None,
        help="shard the safetensors files at this size, with units, e.g. 20KB or 1MB "
        "(writes model.safetensors.index.json)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="config override, e.g. --set num_hidden_layers=4 --set hidden_size=128",
    )
    args = parser.parse_args(argv)
    if args.max_shard_size and args.max_shard_size.strip().isdigit():
        parser.error("--max-shard-size needs a unit, e.g. 20KB or 1MB (got a bare number)")
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = _parse_value(value)
    path = make_tiny_checkpoint(
        args.out_dir,
        arch=args.arch,
        seed=args.seed,
        vocab_size=args.vocab_size,
        max_shard_size=args.max_shard_size,
        **overrides,
    )
    print(path)


if __name__ == "__main__":
    main()
