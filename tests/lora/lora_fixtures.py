"""PEFT adapters on the tiny checkpoints, made with the real ``peft`` package."""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(base_path, out_dir, r: int = 4, alpha: int = 8, seed: int = 1,
                      target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                      use_rslora: bool = False) -> Path:
    """Save a LoRA of ``base_path`` with random (non-zero) A and B to ``out_dir``."""
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=False,
                          use_rslora=use_rslora, lora_dropout=0.0)
    lora = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # peft's random init makes B small; widen it so deltas are visible
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.mul_(4.0)
    lora.save_pretrained(str(out_dir))
    return Path(out_dir)


def peft_logits(base_path, adapter_path, prompt: list[int]) -> torch.Tensor:
    """Logits (len(prompt), vocab) of transformers + peft with the adapter applied."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    lora = peft.PeftModel.from_pretrained(model, str(adapter_path)).eval()
    with torch.no_grad():
        return lora(torch.tensor([prompt])).logits[0]


def run_with_adapters(runner, prompts: list[list[int]], names: list[str | None]):
    """Prefill ``prompts`` (request ``i`` with adapter ``names[i]``, None: the base) then one
    greedy decode; returns (prefill last-token logits, decode logits, greedy tokens)."""
    import harness

    seqs = harness.new_seqs(runner, len(prompts))
    orig = runner.forward

    def forward(fb):
        fb.lora_names = list(names)
        return orig(fb)

    runner.forward = forward
    try:
        out1 = harness.extend(runner, seqs, prompts).next_token_logits.clone()
        nxt = out1.argmax(-1).tolist()
        out2 = harness.decode(runner, seqs, nxt).next_token_logits.clone()
    finally:
        runner.forward = orig
        harness.release(runner, seqs)
    return out1, out2, nxt


def tp_lora_worker(rank: int, tp_size: int, port: int, base: str, adapters: dict, prompts, names, out_dir: str) -> None:
    """One TP rank: load ``adapters`` ({name: path}), run the mixed batch, save the logits."""
    import os

    import harness
    from shardline_runtime.distributed import destroy_distributed_environment

    torch.set_num_threads(1)
    runner = harness.make_runner(base, tp_rank=rank, tp_size=tp_size, dist_init_addr=f"127.0.0.1:{port}",
                                 enable_lora=True, max_lora_rank=8, max_loras_per_batch=2,
                                 lora_paths=tuple(f"{n}={p}" for n, p in adapters.items()))
    torch.save(run_with_adapters(runner, prompts, names), os.path.join(out_dir, f"rank{rank}.pt"))
    destroy_distributed_environment()


def run_tp_lora(tp_size: int, base, adapters: dict, prompts, names, out_dir, timeout_s: float = 300):
    """``tp_lora_worker`` in ``tp_size`` spawned gloo processes; returns each rank's results."""
    import time

    import harness
    import torch.multiprocessing as mp

    port = harness.free_port()
    args = (tp_size, port, str(base), {k: str(v) for k, v in adapters.items()}, prompts, names, str(out_dir))
    ctx = mp.spawn(tp_lora_worker, args=args, nprocs=tp_size, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"TP={tp_size} LoRA workers did not finish within {timeout_s}s")
    return [torch.load(f"{out_dir}/rank{r}.pt") for r in range(tp_size)]


def peft_greedy(base_path, adapter_path, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of transformers (+ peft when ``adapter_path`` is given)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    if adapter_path is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter_path))
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
