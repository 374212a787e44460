"""``python3 -m hack.node_agent --kubeconfig K --nodes a,b --slot N --state-dir D``."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from .agent import Agent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m hack.node_agent",
                                description="run pods bound to fake nodes as local processes")
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--nodes", required=True, help="comma-separated node names")
    p.add_argument("--slot", type=int, required=True, help="1..200: pod IPs 127.BASE.SLOT.N")
    p.add_argument("--slot-base", type=int, default=77)
    p.add_argument("--state-dir", type=Path, required=True, help="per-pod logs and files")
    p.add_argument("--cluster-id", required=True, help="names this agent's /etc/hosts block")
    args = p.parse_args(argv)
    if not 1 <= args.slot <= 254 or not 1 <= args.slot_base <= 254:
        p.error("--slot and --slot-base must be in 1..254")
    args.state_dir.mkdir(parents=True, exist_ok=True)
    agent = Agent(args.kubeconfig, [n for n in args.nodes.split(",") if n], args.slot,
                  args.slot_base, args.state_dir, args.cluster_id)
    done = threading.Event()

    def on_signal(signum, _frame):
        agent.log(f"signal {signum}: stopping pods")
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    watcher = threading.Thread(target=agent.run, name="watch", daemon=True)
    watcher.start()
    done.wait()
    agent.shutdown()
    agent.log("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
