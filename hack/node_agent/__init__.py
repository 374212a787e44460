"""Node agent for the local cluster (test infrastructure, not product): runs pods bound to
fake nodes as local processes. Start with ``python3 -m hack.node_agent``."""
