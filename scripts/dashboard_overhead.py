"""What watching the KV dashboard costs a server under load: one `pagedllm serve --enable-dashboard` (the
default model), the same trace sent all at once (streaming, over real HTTP) with the page's event stream closed
and open, the modes alternating (closed, open, open, closed, ...) so the machine's drift hits each:

    PYTHONPATH=$PWD .venv/bin/python scripts/dashboard_overhead.py [--rounds 2] [--num-requests 64]
        [--traces sharegpt,alpaca] [--watchers process[,thread]] [--threads] [--servers NAME=PYTHONPATH,...]

"Open" is what a browser on /dashboard does: a viewer reading /dashboard/events (server-sent events) for the
whole run, so the engine core builds and publishes a block map at most every 0.5 s. A browser is a process of
its own with its page already open, so the default viewer (`process`) is a spawned process that has received
its first event before the run starts. `thread` is how sessions 10-11 measured: a thread of this process,
started with the run, beside the measuring client's event loop (sharing its GIL). After an open run the viewer
is ended and the next run waits until a core's watch lease (10 s) would have lapsed, so no closed run is
watched (an older server keeps the maps coming for the lease; this one stops when the last viewer leaves).

Per run: output tok/s, the load average, what the viewer received (events, bytes, the maps' build times in
the core), the CPU seconds (from /proc/<pid>/task/*/schedstat) of the API server process, its engine core,
this measuring client and the viewer process, and how long the core's threads waited for a CPU (the machine's
contention as the engine felt it); `--threads` adds the server's and the core's threads. Per trace:
each open mode / closed per round and their median (the issue's target: >= 0.98), the ratios of the rounds
whose two runs were both quiet (the core waited < 15% of the run), and each mode's median CPU seconds per
process. CPU seconds are the steadier figure on a shared machine: other jobs move the throughput.

`--servers old=/work/main,new=.` runs a server per named PYTHONPATH, one at a time, started in turn each round
(order reversed every other round), to compare two versions in one session.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import json
import statistics
import tempfile
import threading
import time

import httpx

QUIET_WAIT = 0.15
"""A run counts as quiet when its engine core's threads waited for a CPU (runnable, another task on it) less
than this fraction of its wall time, summed over the threads."""
LEASE_S = 10.0
"""The core's watch lease (engine/core_proc.py KV_MAP_LEASE_S): how long maps may still come after the last
renewal, when the server does not end the watch itself."""


# --- CPU time from /proc -----------------------------------------------------------------------------


def _stat_fields(path: str) -> tuple[str, list[str]]:
    with open(path) as f:
        text = f.read()
    name = text[text.index("(") + 1:text.rindex(")")]
    return name, text[text.rindex(")") + 2:].split()  # fields from 3 (state) on


def _schedstat(pid: int) -> dict[str, tuple[float, float]]:
    """Per thread ("main" for the main thread, others by name, those of one name summed): (seconds on a CPU,
    seconds runnable but waiting for one), from /proc/<pid>/task/<tid>/schedstat, exact to the nanosecond
    (utime + stime are sampled at the 10 ms tick)."""
    out: dict[str, tuple[float, float]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = "main" if int(tid) == pid else _stat_fields(f"/proc/{pid}/task/{tid}/stat")[0]
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns, _ = f.read().split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended meanwhile
        run, wait = out.get(name, (0.0, 0.0))
        out[name] = (run + int(run_ns) / 1e9, wait + int(wait_ns) / 1e9)
    return out


def cpu_s(pid: int) -> float:
    """Seconds on a CPU of a process's live threads (not its children)."""
    return sum(run for run, _ in _schedstat(pid).values())


def wait_s(pid: int) -> float:
    """Seconds its live threads were runnable but waited for a CPU (taken by another task)."""
    return sum(wait for _, wait in _schedstat(pid).values())


def thread_cpu_s(pid: int) -> dict[str, float]:
    """Seconds on a CPU per thread."""
    return {name: run for name, (run, _) in _schedstat(pid).items()}


def children(pid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                _, f = _stat_fields(f"/proc/{entry}/stat")
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(f[1]) == pid:
                pids.append(int(entry))
    return pids


def engine_core_pid(server_pid: int) -> int:
    """The server's busiest child: the engine core (the other is multiprocessing's resource tracker)."""
    return max(children(server_pid), key=cpu_s)


# --- the watcher --------------------------------------------------------------------------------------


def read_events(url: str, counts, stop: threading.Event | None = None) -> None:
    """Read the event stream as the page does (lines, each event's JSON parsed) until stopped (a thread) or
    ended (a process): counts[0] events, counts[1] bytes, counts[2] and counts[3] the sum and the largest of
    the cores' map build times they carried."""
    with httpx.stream("GET", f"{url}/dashboard/events", timeout=None) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            counts[1] += len(line) + 1
            if line.startswith("data: "):
                counts[0] += 1
                for replica in json.loads(line[6:])["replicas"]:
                    build_s = replica["map"]["build_time_s"]
                    counts[2] += build_s
                    counts[3] = max(counts[3], build_s)
            if stop is not None and stop.is_set():
                return


class Watcher:
    """A dashboard viewer for one run. "process": a process of its own, as a browser is, its page open (the
    first map received) before the run starts. "thread": a thread of this process started with the run, beside
    the measuring client's event loop (the measurement of sessions 10-11)."""

    def __init__(self, url: str, kind: str) -> None:
        self.kind = kind
        if kind == "process":
            ctx = multiprocessing.get_context("spawn")
            self.counts = ctx.Array("d", 4, lock=False)
            self.worker = ctx.Process(target=read_events, args=(url, self.counts), daemon=True)
        else:
            self.counts = [0, 0, 0.0, 0.0]
            self.stop_event = threading.Event()
            self.worker = threading.Thread(target=read_events, args=(url, self.counts, self.stop_event), daemon=True)
        self.worker.start()
        self.start_counts = (0, 0)
        self.cpu_start_s = 0.0
        if kind == "process":
            deadline = time.monotonic() + 60
            while self.counts[0] == 0:
                assert time.monotonic() < deadline and self.worker.is_alive(), "the dashboard stream sent nothing"
                time.sleep(0.05)
            self.start_counts = (self.counts[0], self.counts[1])
            self.cpu_start_s = cpu_s(self.worker.pid)
        self.cpu_s = 0.0

    def stop(self) -> dict:
        """End the viewer; what it received during the run."""
        if self.kind == "process":
            self.cpu_s = cpu_s(self.worker.pid) - self.cpu_start_s
            self.worker.terminate()  # the connection closes, as a closed tab's does
            self.worker.join()
        else:
            self.stop_event.set()  # the thread ends at its next line; its CPU time is the client's
        events = int(self.counts[0])
        return {"events": events - int(self.start_counts[0]), "bytes": int(self.counts[1] - self.start_counts[1]),
                "build_ms_mean": 1e3 * self.counts[2] / max(events, 1), "build_ms_max": 1e3 * self.counts[3]}


# --- a run ------------------------------------------------------------------------------------------


def measured_run(server, requests, watcher_kind: str | None, threads: bool) -> dict:
    from pagedllm.bench.serving import run_client

    core = engine_core_pid(server.proc.pid)
    pids = {"server": server.proc.pid, "core": core, "client": os.getpid()}
    watcher = Watcher(server.url, watcher_kind) if watcher_kind else None
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    core_wait_before = wait_s(core)
    threads_before = {name: thread_cpu_s(pids[name]) for name in ("server", "core")} if threads else {}
    load = os.getloadavg()[0]
    row = run_client(server.url, requests, [float("inf")], progress=False)[0]
    assert row["num_ok"] == len(requests), row["errors"]
    result = {"tok_s": row["output_tok_s"], "duration_s": row["duration_s"], "load": load,
              "cpu": {name: cpu_s(pid) - before[name] for name, pid in pids.items()},
              "core_wait_s": wait_s(core) - core_wait_before}
    if threads:
        result["threads"] = {}
        for name in ("server", "core"):
            now = thread_cpu_s(pids[name])
            result["threads"][name] = {t: now[t] - threads_before[name].get(t, 0.0) for t in now
                                       if now[t] - threads_before[name].get(t, 0.0) >= 0.005}
    if watcher:
        result.update(watcher.stop())
        assert result["events"] > 0, "the dashboard stream sent nothing during the run"
        result["cpu"]["watcher"] = watcher.cpu_s
        time.sleep(LEASE_S + 1.0)  # the next run is not watched, even by a lease an older server leaves running
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2, help="rounds (closed and each watcher) per trace")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--traces", default="sharegpt,alpaca")
    parser.add_argument("--model", default=None)
    parser.add_argument("--watchers", default="process",
                        help="comma-separated open modes beside closed: process (a viewer of its own, as a browser "
                             "is) and/or thread (in this client's process, as sessions 10-11 measured)")
    parser.add_argument("--threads", action="store_true", help="also CPU seconds per thread of the server and core")
    parser.add_argument("--servers", default=None,
                        help="NAME=PYTHONPATH,...: a server per version, started in turn each round "
                             "(default: one server from this PYTHONPATH)")
    args = parser.parse_args()

    from pagedllm.bench.serving import ServerProcess, run_client
    from pagedllm.bench.workloads import WorkloadSpec, make_workload

    # no prefix caching: every run computes its prompts, as the first did
    serve_args = ["--enable-dashboard", "--no-prefix-caching"] + (["--model", args.model] if args.model else [])
    versions = dict(v.split("=", 1) for v in args.servers.split(",")) if args.servers else {"this": None}
    modes = ["closed", *args.watchers.split(",")]
    assert set(modes) <= {"closed", "process", "thread"}, modes
    traces = args.traces.split(",")
    log_dir = tempfile.mkdtemp()
    results: dict[tuple[str, str, str], list[dict]] = {}

    def start(version: str):
        env = dict(os.environ)
        if versions[version] is not None:
            os.environ["PYTHONPATH"] = os.path.abspath(versions[version])
        try:
            return ServerProcess(serve_args, os.path.join(log_dir, f"serve-{version}.log"))
        finally:
            os.environ.clear()
            os.environ.update(env)

    servers = {} if len(versions) > 1 else {"this": start("this")}
    try:
        for r in range(args.rounds):
            for version in (list(versions) if r % 2 == 0 else list(reversed(versions))):
                server = servers.get(version) or start(version)
                try:
                    for trace in traces:
                        requests = make_workload(WorkloadSpec(name=trace, num_requests=args.num_requests,
                                                              max_model_len=2048))
                        warm_up = make_workload(WorkloadSpec(name=trace, num_requests=8, max_model_len=2048, seed=1))
                        run_client(server.url, warm_up, [float("inf")], progress=False)
                        for mode in (modes if r % 2 == 0 else list(reversed(modes))):
                            res = measured_run(server, requests, None if mode == "closed" else mode, args.threads)
                            results.setdefault((version, trace, mode), []).append(res)
                            cpu = " ".join(f"{k} {v:5.2f}" for k, v in res["cpu"].items())
                            seen = (f"  {res['events']} events, {res['bytes'] / 1e3:.0f} kB, maps built in "
                                    f"{res['build_ms_mean']:.2f} ms (max {res['build_ms_max']:.2f})"
                                    if mode != "closed" else "")
                            print(f"{version:<5} {trace:<9} round {r + 1} {mode:<7} {res['tok_s']:7.1f} tok/s "
                                  f"{res['duration_s']:5.1f} s  load {res['load']:4.1f}  CPU s: {cpu}; core waited "
                                  f"{res['core_wait_s']:5.2f} s{seen}",
                                  flush=True)
                            for proc, per_thread in res.get("threads", {}).items():
                                print(f"      {proc} threads: " + ", ".join(
                                    f"{t} {s:.2f}" for t, s in sorted(per_thread.items(), key=lambda x: -x[1])))
                finally:
                    if version not in servers:
                        server.stop()
    finally:
        for server in servers.values():
            server.stop()
    for version in versions:
        for trace in traces:
            closed = results[(version, trace, "closed")]
            for mode in modes[1:]:
                pairs = list(zip(results[(version, trace, mode)], closed))
                ratios = [o["tok_s"] / c["tok_s"] for o, c in pairs]
                # a run whose core waited for a CPU more than QUIET_WAIT of its time shared the machine
                quiet = [o["tok_s"] / c["tok_s"] for o, c in pairs
                         if max(o["core_wait_s"] / o["duration_s"], c["core_wait_s"] / c["duration_s"]) < QUIET_WAIT]
                print(f"{version} {trace}: {mode} open / closed per round " + ", ".join(f"{x:.3f}" for x in ratios)
                      + f"; median {statistics.median(ratios):.3f}; rounds with both runs quiet: "
                      + (", ".join(f"{x:.3f}" for x in quiet) or "none"))
            for mode in modes:
                runs = results[(version, trace, mode)]
                print(f"    {mode:<7} median CPU s: " + ", ".join(
                    f"{n} {statistics.median(run['cpu'][n] for run in runs):.2f}" for n in runs[0]["cpu"])
                      + f"; core waited {statistics.median(run['core_wait_s'] for run in runs):.2f} s"
                      + f"; tok/s {statistics.median(run['tok_s'] for run in runs):.1f}")


if __name__ == "__main__":
    main()
