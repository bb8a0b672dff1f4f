"""What watching the KV dashboard costs a server under load: one `pagedllm serve --enable-dashboard` (the
default model), the same trace sent all at once (64 requests, streaming, over real HTTP) with the page's event
stream open and closed, alternating (closed, open, open, closed, ...) so the machine's drift hits both:

    PYTHONPATH=$PWD .venv/bin/python scripts/dashboard_overhead.py [--rounds 2] [--num-requests 64]
        [--traces sharegpt,alpaca]

"Open" is what a browser on /dashboard does: a client reading /dashboard/events (server-sent events) for the
whole run, so the engine core builds and publishes a block map at most every 0.5 s. Prints output tok/s per
run and, per trace, open / closed per pair and their median (the issue's target: >= 0.98).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading

import httpx


class EventReader(threading.Thread):
    """Reads the dashboard's event stream until stopped; counts the events (a watcher that received none
    would not be one)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.events = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        with httpx.stream("GET", f"{self.url}/dashboard/events", timeout=None) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data:"):
                    self.events += 1
                if self.stop_event.is_set():
                    return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2, help="pairs (closed and open) per trace")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--traces", default="sharegpt,alpaca")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()

    from pagedllm.bench.serving import ServerProcess, run_client
    from pagedllm.bench.workloads import WorkloadSpec, make_workload

    # no prefix caching: every run computes its prompts, as the first did
    serve_args = ["--enable-dashboard", "--no-prefix-caching"] + (["--model", args.model] if args.model else [])
    log = os.path.join(tempfile.mkdtemp(), "serve.log")
    server = ServerProcess(serve_args, log)
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        for trace in args.traces.split(","):
            requests = make_workload(WorkloadSpec(name=trace, num_requests=args.num_requests, max_model_len=2048))
            warm_up = make_workload(WorkloadSpec(name=trace, num_requests=8, max_model_len=2048, seed=1))
            run_client(server.url, warm_up, [float("inf")], progress=False)
            for r in range(args.rounds):
                for watched in ((False, True) if r % 2 == 0 else (True, False)):
                    reader = EventReader(server.url) if watched else None
                    if reader:
                        reader.start()
                    row = run_client(server.url, requests, [float("inf")], progress=False)[0]
                    if reader:
                        reader.stop_event.set()
                        assert reader.events > 0, "the dashboard stream sent nothing"
                    assert row["num_ok"] == len(requests), row["errors"]
                    mode = "open" if watched else "closed"
                    rates.setdefault((trace, mode), []).append(row["output_tok_s"])
                    events = f"  ({reader.events} dashboard events)" if reader else ""
                    print(f"{trace:<9} round {r + 1} dashboard {mode:<6} {row['output_tok_s']:8.1f} output tok/s"
                          f"{events}", flush=True)
    finally:
        server.stop()
    for trace in args.traces.split(","):
        ratios = [o / c for o, c in zip(rates[(trace, "open")], rates[(trace, "closed")])]
        print(f"{trace}: open/closed per pair " + ", ".join(f"{x:.3f}" for x in ratios)
              + f"; median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
