"""Model building blocks: tensor-parallel linears, vocab-parallel embedding/LM head, RMSNorm, RoPE, SwiGLU, RadixAttention, logits processor, sampler."""
