"""KV-cache memory: request/token pools and the prefix (radix) cache."""
