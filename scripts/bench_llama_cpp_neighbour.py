"""What a racer stack beside llama-server costs llama.cpp, and why.

``racer bench-llama-cpp --schedule both`` shows llama.cpp slower interleaved with a stack than alone.
This separates the causes. One ``llama-server`` (plain, ``--threads``) on the file answers every
prompt in each of these conditions, its prefill and decoding taken from its own ``timings``:

- ``alone``: no stack running (before the stack starts, and again after it stopped);
- ``stack idle``: a stack up, its last request at least ``--rest`` seconds ago;
- ``right after``: the same prompt just answered by the stack (mode ``racer``), then llama.cpp's;
- ``N s after``: the stack's answer, ``--rest`` seconds of nothing, then llama.cpp's: what a
  spinning thread or a warm cache leaves behind is gone by then, a slower clock may not be;
- ``right after a sweep``: this process reads ``--sweep-mib`` MiB (every last-level cache line
  evicted, no thread left running), then llama.cpp's request.

The conditions are rotated prompt by prompt. During each llama.cpp request the CPU time of every
thread of the stack's three processes is read (``/proc/PID/task/TID/schedstat``, nanoseconds), and
during each stack request llama-server's: a thread that spins on after its work shows up there.
Where llama.cpp's running threads are is sampled too: the clock of their CPUs, where the system
exposes cpufreq (a chip that slows its clock after the stack's all-core prefills shows there), and
how often two of them shared one physical core (one CPU, or SMT siblings): one waits for the other,
and at every operation both wait for the slower (another process on one of its cores shows here).

    PYTHONPATH=. python scripts/bench_llama_cpp_neighbour.py --server ~/.cache/racer/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import threading
import time
from collections import defaultdict

import numpy as np

from racer import stack
from racer.bench import llama_cpp as L
from racer.bench.harness import table
from racer.prompts import DEFAULT_PROMPTS, load_spec_bench


def thread_times(pids: list[int]) -> dict[tuple[int, str], int]:
    """(pid, thread name) -> nanoseconds on a CPU, summed over the threads of that name."""
    out: dict[tuple[int, str], int] = defaultdict(int)
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                    out[(pid, name)] += int(f.read().split()[0])
            except OSError:
                continue
    return out


def _core(cpu: str) -> str:
    """The physical core a CPU is a hardware thread of (its SMT siblings share it)."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list") as f:
            return f.read().strip()
    except OSError:
        return cpu


class Placement:
    """Samples, every 20 ms while it runs, where a process's running threads are: the clock of their
    CPUs (cpufreq's scaling_cur_freq, MHz, where the system exposes it: a chip that slows its clock
    after the other server's all-core work shows here) and whether two of them share a physical core
    (the same CPU, one waiting for the other, or SMT siblings: two threads on one core's units)."""

    def __init__(self, pid: int):
        self.pid, self.mhz_samples, self.shared, self.pairs = pid, [], 0, 0
        self.freq = os.path.exists("/sys/devices/system/cpu/cpu0/cpufreq")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(0.02):
            cpus = []
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                try:
                    with open(f"/proc/{self.pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if fields[0] == "R":
                    cpus.append(fields[36])  # field 39: the CPU it last ran on
            if len(cpus) >= 2:
                self.pairs += 1
                cores = [_core(c) for c in cpus]
                self.shared += len(set(cores)) < len(cores)
            for cpu in cpus if self.freq else ():
                try:
                    with open(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq") as f:
                        self.mhz_samples.append(int(f.read()) / 1000)
                except (OSError, ValueError):
                    continue

    def mhz(self) -> float | None:
        return statistics.mean(self.mhz_samples) if self.mhz_samples else None


def delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - v for k, v in before.items()} | {k: v for k, v in after.items() if k not in before}


def sweep(buf: np.ndarray) -> None:
    buf += 1  # read and write every line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="llama-server binary")
    ap.add_argument("--model", default="default", help="'default' (the bundled file) or a GGUF file")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--rest", type=float, default=2.0, help="seconds between the stack's answer and llama.cpp's")
    ap.add_argument("--sweep-mib", type=int, default=256)
    ap.add_argument("--dtype", default="gguf", help="the stack's dtype")
    ap.add_argument("--repeat", type=int, default=2, help="rounds of the conditions over the prompts")
    ap.add_argument("--json", default="", help="write every llama.cpp request's condition and timings here")
    args = ap.parse_args()

    path = L.gguf_file(args.model)
    api = L.choose_api("auto", path)
    prompts = load_spec_bench(DEFAULT_PROMPTS, args.per_category)
    buf = np.zeros(args.sweep_mib * 2**20 // 8, dtype=np.int64)
    runs: dict[str, list[L.Answer]] = defaultdict(list)
    racer_cpu: dict[str, list[dict]] = defaultdict(list)  # condition -> per llama request: {(svc, thread): ns}
    clocks: dict[str, list[float]] = defaultdict(list)  # condition -> llama.cpp's CPUs' mean MHz per request
    shared: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # condition -> [samples on one core, samples]
    llama_cpu: list[float] = []  # llama-server's CPU seconds during each stack request, per its wall second

    with contextlib.ExitStack() as up:
        proc, url = L._llama_server(args.server, path, args.threads, [])
        up.callback(L._stop, proc)

        def llama(text: str) -> L.Answer:
            body = L._payload(api, text) | {"max_tokens": args.max_new_tokens, "temperature": 0.0, "top_k": 1}
            return L._stream(url + "/v1" + L._endpoint(api), body | {"cache_prompt": False})

        def timed(label: str, text: str) -> None:
            with Placement(proc.pid) as where:
                runs[label].append(llama(text))
            if where.mhz() is not None:
                clocks[label].append(where.mhz())
            shared[label][0] += where.shared
            shared[label][1] += where.pairs

        def alone(label: str) -> None:
            for p in prompts:
                timed(label, p.text)

        llama(prompts[0].text)  # warm-up
        for _ in range(args.repeat):
            alone("alone (before the stack)")

        before = L._children()
        model = L.racer_model(args.model, path)
        with stack.running(
            model=model, dtype=args.dtype, any_ports=True, http_port=1, env={"RACER_PREFIX_CACHE": "0"}
        ) as target:
            pids = sorted(L._children() - before)
            names = {}
            for pid in pids:
                with open(f"/proc/{pid}/cmdline", encoding="utf-8") as f:
                    names[pid] = f.read().split("\0")[-2]  # racer serve SERVICE
            base, key = f"http://127.0.0.1:{target.http_port}/v1", stack.client_key()
            served = L._get(base + "/models", key)["data"][0]["id"]

            def racer(text: str) -> L.Answer:
                body = L._payload(api, text) | {"model": served, "max_tokens": args.max_new_tokens}
                body |= {"share": False, "speculation": {"mode": "racer", "budget": 0}, "return_token_ids": True}
                t0 = thread_times([proc.pid])
                w0 = time.perf_counter()
                a = L._stream(base + L._endpoint(api), body, key)
                spent = sum(delta(t0, thread_times([proc.pid])).values()) / 1e9
                llama_cpu.append(spent / (time.perf_counter() - w0))
                return a

            racer(prompts[0].text)  # warm-up
            idle0 = thread_times(pids)
            time.sleep(5)
            idle = {k: v / 5e9 for k, v in delta(idle0, thread_times(pids)).items() if v}

            def measured(label: str, text: str) -> None:
                t0 = thread_times(pids)
                w0 = time.perf_counter()
                timed(label, text)
                wall = time.perf_counter() - w0
                racer_cpu[label].append({k: v / 1e9 / wall for k, v in delta(t0, thread_times(pids)).items() if v})

            def idle_cond(text):
                time.sleep(args.rest)
                measured("stack idle", text)

            def right_after(text):
                racer(text)
                measured("right after a stack request", text)

            def after_rest(text):
                racer(text)
                time.sleep(args.rest)
                measured(f"{args.rest:g} s after a stack request", text)

            def after_sweep(text):
                sweep(buf)
                measured("right after a cache sweep", text)

            conds = [idle_cond, right_after, after_rest, after_sweep]
            for r in range(args.repeat):
                for i, p in enumerate(prompts):
                    k = (i + r) % len(conds)
                    for cond in conds[k:] + conds[:k]:
                        cond(p.text)
        for _ in range(args.repeat):
            alone("alone (after the stack)")

    def dec(a: list[L.Answer]) -> float:
        return sum(x.server["predicted_n"] for x in a) / sum(x.server["predicted_ms"] for x in a) * 1e3

    def pre(a: list[L.Answer]) -> float:
        return sum(x.server["prompt_n"] for x in a) / sum(x.server["prompt_ms"] for x in a) * 1e3

    rows = []
    for label, a in runs.items():
        per = sorted(x.server["predicted_n"] / x.server["predicted_ms"] * 1e3 for x in a)
        cpu = racer_cpu.get(label)
        stack_cpu = f"{statistics.mean(sum(d.values()) for d in cpu):.3f}" if cpu else "-"
        spread = f"{per[0]:.1f} / {statistics.median(per):.1f} / {per[-1]:.1f}"
        mhz = f"{statistics.mean(clocks[label]):.0f}" if clocks.get(label) else "-"
        one_core = f"{shared[label][0] / shared[label][1]:.0%}" if shared[label][1] else "-"
        rows.append((label, str(len(a)), f"{pre(a):.0f}", f"{dec(a):.1f}", spread, stack_cpu, mhz, one_core))
    print(f"\nllama.cpp {args.threads} threads on {path.name}, {args.max_new_tokens} tokens; its own timings")
    head = ["condition", "requests", "prefill tok/s", "decode tok/s (all)", "decode tok/s min / median / max"]
    head += ["stack's CPU during it (cores)", "llama.cpp's CPUs' clock MHz", "its running threads sharing a core"]
    print(table(head, rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({label: [x.server for x in a] for label, a in runs.items()}, f, indent=1)
    print("\nthe stack's threads busy during llama.cpp's requests (cores, mean; over 0.005 shown):")
    for label, cpu in racer_cpu.items():
        total: dict = defaultdict(float)
        for d in cpu:
            for k, v in d.items():
                total[k] += v / len(cpu)
        shown = ", ".join(f"{names.get(pid, pid)}/{name} {v:.3f}" for (pid, name), v in total.items() if v > 0.005)
        print(f"- {label}: {shown or 'none'}")
    shown = ", ".join(f"{names.get(pid, pid)}/{name} {v:.4f}" for (pid, name), v in idle.items() if v > 0.0005)
    print(f"- the stack idle for 5 s: {shown or 'none'}")
    print(
        f"\nllama-server's CPU during the stack's requests: {statistics.mean(llama_cpu):.3f} cores mean, "
        f"{max(llama_cpu):.3f} max"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
