"""One runtime, an open-loop client and a weight update in the middle: does the leader answer
the requests that come after its update (issue 23 item 4, "the post-update stall")?

Starts ``shardline-runtime serve`` on ``--model-path`` (CPU, float32), sends 4-token completions
at ``--rate`` per second (a fresh connection each, as ``hack/scenario/traffic.py``), POSTs
``/update_weights_from_disk`` to ``--update-to`` after ``--before`` seconds, keeps sending for
``--after`` seconds once the update answered, waits up to ``--drain`` seconds for the last
answers, and prints per 5-s window of send time how many requests were answered and the slowest,
and how many never were. No cluster and no operator: only the runtime's own behaviour.

    python bench/update_stall.py --model-path /var/lib/shardline/models/llama-200m-39c11acd058e/rev-a \\
        --update-to /var/lib/shardline/models/llama-200m-39c11acd058e/rev-b --rate 0.3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import httpx


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--update-to", required=True)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--port", type=int, default=18731)
    parser.add_argument(
        "--before", type=float, default=10.0, help="seconds of traffic before the update"
    )
    parser.add_argument(
        "--after", type=float, default=35.0, help="seconds of traffic after it answered"
    )
    parser.add_argument(
        "--drain", type=float, default=60.0, help="seconds to wait for the last answers"
    )
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [
            "shardline-runtime",
            "serve",
            "--model-path",
            args.model_path,
            "--served-model-name",
            "m",
            "--revision",
            "a",
            "--host",
            "127.0.0.1",
            "--port",
            str(args.port),
            "--tp-size",
            "1",
            "--dtype",
            "float32",
            "--max-total-tokens",
            "4096",
            "--dist-init-addr",
            f"127.0.0.1:{args.port + 1}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        while True:
            if server.poll() is not None:
                sys.exit("the runtime exited before it was ready")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        records: list[tuple[float, float, bool]] = []  # (sent, seconds, ok)
        sent, stop = [0], threading.Event()

        def one() -> None:
            at = time.monotonic()
            try:
                ok = (
                    httpx.post(
                        f"{url}/v1/completions",
                        timeout=300,
                        json={"model": "m", "prompt": "Hello", "max_tokens": 4},
                    ).status_code
                    == 200
                )
            except httpx.HTTPError:
                ok = False
            records.append((at, time.monotonic() - at, ok))

        def send() -> None:
            next_at = time.monotonic()
            while not stop.is_set():
                threading.Thread(target=one, daemon=True).start()
                sent[0] += 1
                next_at += 1 / args.rate
                time.sleep(max(0.0, next_at - time.monotonic()))

        start = time.monotonic()
        threading.Thread(target=send, daemon=True).start()
        time.sleep(args.before)
        asked = time.monotonic()
        reply = httpx.post(
            f"{url}/update_weights_from_disk",
            timeout=900,
            json={"model_path": args.update_to, "revision": "b"},
        )
        answered = time.monotonic()
        print(
            f"update sent at {asked - start:.1f} s, answered after {answered - asked:.1f} s: "
            f"HTTP {reply.status_code}"
        )
        time.sleep(args.after)
        stop.set()
        deadline = time.monotonic() + args.drain
        while len(records) < sent[0] and time.monotonic() < deadline:
            time.sleep(0.5)
        for low in range(0, int(time.monotonic() - start), 5):
            window = [s for at, s, _ in records if low <= at - start < low + 5]
            slowest = f"{max(window):.2f}" if window else "-"
            print(f"sent {low:3d}-{low + 5:3d} s: {len(window)} answered, slowest {slowest} s")
        failed = sum(1 for _, _, ok in records if not ok)
        print(
            f"{sent[0]} sent, {len(records)} answered ({failed} not 200), "
            f"{sent[0] - len(records)} unanswered after {args.drain:.0f} s"
        )
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
