"""Multi-LoRA serving: PEFT adapters in a fixed pool of slots, applied per request (issue 15)."""
