"""`dflash2-decode serve` under concurrent clients: throughput, and a load test.

    python bench/bench_serve.py throughput --target /tmp/x8/target --draft /tmp/x8/dflash2 \\
        [--clients 1,2,4,8] [--max-tokens 64] [--block-size auto] [--fixed-block-size 4] [--rounds 2] \\
        [--out bench/results/serve_x8.json]
    python bench/bench_serve.py load [--target T --draft D] [--clients 8] [--requests 200] [--cancel 0.1]

throughput: four servers run side by side (subprocesses on loopback ports; idle ones cost
nothing): speculative batched (--max-running = the largest client count), speculative with
--max-running 1, and the same two target-only. For each round, client count c and server in
turn, c client threads send max(4, c) streamed greedy completions (held-out prompts cut to
--prompt-tokens tokens) and the bench records aggregate tok/s (completion tokens / wall time),
per-request tok/s, time to first token and inter-token latency ((last - first chunk) / (tokens - 1)).
Configurations alternate inside every round (in reverse order every other round, so none is
always first after the previous cell), so machine noise hits them alike. Every server's
greedy text must be the same for the same prompt (checked). On a shared machine the wall clock
mostly measures the neighbours, so the bench also reports tokens per CPU-second of the server
process (user + system, all its threads, from /proc): with one kernel thread that is the
throughput the same work would have on a core of its own. --fixed-block-size Q adds a fifth
server, speculative batched at that fixed Q (the behaviour before `auto`); each row records
the load average before it. --solo-clients 1,4 runs the two --max-running 1 servers at those
client counts only (they take the longest). --twin adds a second plain batched server: its ratio
to the first is the bench's own spread, the yardstick for spec / plain (docs/serving.md).

load: ONE server (the embedded pair by default); K client threads x M requests in all, mixed
streamed / not, random prompts, budgets, block sizes, greedy and seeded sampling; a share are
cancelled on purpose (a stream closed after its first chunk, with a budget too big to finish
first); a share send a batch of two prompts (two choices, each == its solo run); a share ask for
echo + logprobs (max_tokens 0..16, streamed or not: text == prompt + solo output, every
logprob == `decode/score.score` of prompt + output within 1e-4, the first null). Each request is classified: correct (== its solo run, serve/reference.py), wrong,
rejected (429 / 503), cancelled, lost (transport error, timeout, no finish_reason, a stream
without [DONE]); the counts are reconciled with the server's /metrics. Loopback only, bounded
in count and in time (--time-limit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout

import httpx  # noqa: E402

from acceptance import shown  # noqa: E402  (a path as recorded: relative to the checkout)

TIMEOUT_S = 120.0
FIXED = "spec batched fixed"  # throughput: the --fixed-block-size server
TWIN = "plain twin"  # throughput: --twin, a second plain batched server (two such: 0.93-1.03x a round here)
MAX_TRIES = 20  # load test: attempts per request while the queue is full


# ---------------------------------------------------------------- servers
class ServerProcess:
    """`python -m dflash2_numba serve ... --port 0` on loopback; the URL from its first stderr line."""

    def __init__(self, args: list[str], name: str, threads: int = 1):
        self.name = name
        # BLAS (the prefill of a prompt over 32 tokens) at the same thread count: on a busy machine
        # OpenBLAS's default (every core, spinning) took 13 s for a 48-token prefill of the
        # widened target instead of 0.5 s
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen([sys.executable, "-m", "dflash2_numba", "serve", "--host", "127.0.0.1",
                                      "--port", "0", "--threads", str(threads), *args], stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")), daemon=True).start()
        self.url = None

    def wait_ready(self, timeout: float = 600.0) -> "ServerProcess":
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: the server exited: {''.join(self.lines)}")
            m = re.search(r"(http://127\.0\.0\.1:\d+)", "".join(self.lines))
            if m:
                self.url = m.group(1)
                try:
                    if httpx.get(self.url + "/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: not ready after {timeout} s: {''.join(self.lines)}")

    def cpu_s(self) -> float:
        """CPU seconds the server process has used (user + system, every thread)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def metrics(self) -> dict:
        from dflash2_numba.serve.metrics import parse_metrics

        return parse_metrics(httpx.get(self.url + "/metrics", timeout=TIMEOUT_S).text)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(60)


# ---------------------------------------------------------------- one request
def stream_request(url: str, body: dict, cancel_after_first: bool = False) -> dict:
    """One streamed completion; times of every content chunk, the text, finish_reason, usage."""
    out = {"text": "", "finish_reason": None, "usage": None, "done": False, "chunk_times": [], "status": None,
           "error": None, "t0": time.perf_counter(), "token_logprobs": []}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200:
                resp.read()
                out["error"] = resp.text
                return out
            for line in resp.iter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    out["error"] = obj["error"]
                    continue
                if obj.get("usage"):
                    out["usage"] = obj["usage"]
                for ch in obj.get("choices", []):
                    if ch.get("logprobs"):
                        out["token_logprobs"] += ch["logprobs"]["token_logprobs"]
                    if ch.get("text"):
                        out["text"] += ch["text"]
                        out["chunk_times"].append(time.perf_counter())
                        if cancel_after_first:
                            out["cancelled"] = True
                            return out  # leaving the block closes the connection mid-stream
                    if ch.get("finish_reason"):
                        out["finish_reason"] = ch["finish_reason"]
    except (httpx.HTTPError, ValueError) as e:
        out["error"] = f"transport: {e!r}"
    out["t1"] = time.perf_counter()
    return out


def plain_request(url: str, body: dict) -> dict:
    out = {"status": None, "error": None, "t0": time.perf_counter()}
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)
        out["status"] = r.status_code
        obj = r.json()
        if r.status_code == 200:
            ch = obj["choices"][0]
            out.update(text=ch["text"], finish_reason=ch["finish_reason"], usage=obj["usage"], done=True,
                       choices=obj["choices"], token_logprobs=(ch["logprobs"] or {}).get("token_logprobs"))
        else:
            out["error"] = obj.get("error")
    except (httpx.HTTPError, ValueError) as e:
        out["error"] = f"transport: {e!r}"
    out["t1"] = time.perf_counter()
    return out


# ---------------------------------------------------------------- throughput
def run_clients(url: str, bodies: list[dict], clients: int) -> tuple[list[dict], float]:
    """`clients` threads share the list of request bodies; -> (results in order, wall seconds)."""
    todo = queue.Queue()
    for i, b in enumerate(bodies):
        todo.put((i, b))
    results = [None] * len(bodies)

    def worker():
        while True:
            try:
                i, b = todo.get_nowait()
            except queue.Empty:
                return
            results[i] = stream_request(url, b)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def summarize(results: list[dict], wall: float) -> dict:
    toks = [r["usage"]["completion_tokens"] for r in results]
    ttft = [r["chunk_times"][0] - r["t0"] for r in results]
    itl = [(r["chunk_times"][-1] - r["chunk_times"][0]) / (n - 1) for r, n in zip(results, toks) if n > 1]
    per_req = [n / (r["t1"] - r["t0"]) for r, n in zip(results, toks)]
    return {"requests": len(results), "tokens": sum(toks), "wall_s": wall, "aggregate_tok_s": sum(toks) / wall,
            "per_request_tok_s": statistics.mean(per_req), "ttft_ms": 1000 * statistics.median(ttft),
            "itl_ms": 1000 * statistics.median(itl) if itl else None}


def throughput(args) -> None:
    from dflash2_numba.tokenizer import Tokenizer

    clients = [int(c) for c in args.clients.split(",")]
    solo_clients = clients if not args.solo_clients else [int(c) for c in args.solo_clients.split(",")]
    tok = Tokenizer.from_dir(args.target)
    prompts = json.loads((ROOT / "bench" / "data" / "heldout_prompts.json").read_text())
    ids = [tok.encode(p)[:args.prompt_tokens] for p in prompts]
    common = ["--target", str(args.target), "--max-waiting", "64"]
    spec = ["--draft", str(args.draft), "--block-size", str(args.block_size)]
    top = str(max(clients))
    configs = {"spec batched": spec + ["--max-running", top], "spec R=1": spec + ["--max-running", "1"],
               "plain batched": ["--max-running", top], "plain R=1": ["--max-running", "1"]}
    if args.fixed_block_size:
        configs[FIXED] = ["--draft", str(args.draft), "--block-size", str(args.fixed_block_size), "--max-running", top]
    if args.twin:
        configs[TWIN] = ["--max-running", top]
    servers = {}
    for name, extra in configs.items():  # one at a time: their warm-ups would fight for the cores
        servers[name] = ServerProcess(common + extra, name, args.threads).wait_ready()
        print(f"{name}: ready at {servers[name].url}", file=sys.stderr, flush=True)
    rows, texts = [], {}
    try:
        for rnd in range(args.rounds):
            for c in clients:
                n = max(args.min_requests, c)
                bodies = [{"model": "x", "prompt": ids[(rnd * 17 + c * 5 + i) % len(ids)], "max_tokens": args.max_tokens,
                           "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                          for i in range(n)]
                order = list(servers.items())  # every other round the other way round: no server always goes first
                for name, srv in (order if rnd % 2 == 0 else order[::-1]):
                    if name.endswith("R=1") and c not in solo_clients:
                        continue
                    model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
                    for b in bodies:
                        b["model"] = model
                    load1 = os.getloadavg()[0]
                    before, cpu0 = srv.metrics(), srv.cpu_s()
                    results, wall = run_clients(srv.url, bodies, c)
                    after, cpu = srv.metrics(), srv.cpu_s() - cpu0
                    s = summarize(results, wall)
                    s.update(server_cpu_s=cpu, tok_per_cpu_s=s["tokens"] / cpu)
                    steps = after["engine_steps_total"] - before["engine_steps_total"]
                    drafts = after["spec_decode_num_drafts_total"] - before["spec_decode_num_drafts_total"]
                    acc = after["spec_decode_num_accepted_tokens_total"] - before["spec_decode_num_accepted_tokens_total"]
                    s.update(round=rnd, clients=c, config=name, engine_steps=steps, load_before=load1,
                             rows_per_step=(after["engine_step_rows_total"] - before["engine_step_rows_total"]) / steps,
                             tau=1 + acc / drafts if drafts else 1.0)
                    rows.append(s)
                    for b, r in zip(bodies, results):
                        texts.setdefault(str(b["prompt"]), set()).add(r["text"])
                    print(f"round {rnd} c={c} {name:14s} {s['aggregate_tok_s']:7.1f} tok/s aggregate, "
                          f"{s['tok_per_cpu_s']:7.1f} tok per server CPU-s, "
                          f"{s['per_request_tok_s']:6.1f} per request, ttft {s['ttft_ms']:7.1f} ms, "
                          f"itl {s['itl_ms'] or 0:6.1f} ms, tau {s['tau']:.2f}", file=sys.stderr, flush=True)
    finally:
        codes = {name: srv.stop() for name, srv in servers.items()}
    same = all(len(v) == 1 for v in texts.values())
    report = {"machine": machine(), "target": shown(args.target), "draft": shown(args.draft), "Q": args.block_size,
              "fixed_Q": args.fixed_block_size,
              "threads": args.threads, "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
              "rows": rows, "greedy_texts_identical_across_servers": same, "exit_codes": codes}
    report["table"] = table(rows, clients, list(configs))
    print(report["table"])
    print(f"greedy texts identical across the four servers: {same}; exit codes {codes}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


def table(rows: list[dict], clients: list[int], configs: list[str]) -> str:
    """Markdown: per client count, each config's aggregate tok/s (mean over rounds) and ratios."""
    def mean(c, name, key):
        vals = [r[key] for r in rows if r["clients"] == c and r["config"] == name and r[key] is not None]
        return statistics.mean(vals) if vals else float("nan")

    out = []
    for key, what in (("tok_per_cpu_s", "tokens per server CPU-second"), ("aggregate_tok_s", "aggregate tok/s (wall)")):
        extra = [n for n in (FIXED, TWIN) if n in configs]  # each against plain batched
        head = "| clients | " + " | ".join(configs) + \
            " | spec batched / spec R=1 | spec / plain (batched) | spec / plain (R=1) |" + \
            "".join(f" {n} / plain (batched) |" for n in extra)
        lines = [f"{what}, mean of the rounds:", "", head, "|" + "---|" * (head.count("|") - 1)]
        for c in clients:
            v = {n: mean(c, n, key) for n in configs}
            lines.append(f"| {c} | " + " | ".join(f"{v[n]:.1f}" for n in configs) +
                         f" | {v['spec batched'] / v['spec R=1']:.2f}x | {v['spec batched'] / v['plain batched']:.2f}x"
                         f" | {v['spec R=1'] / v['plain R=1']:.2f}x |" +
                         "".join(f" {v[n] / v['plain batched']:.2f}x |" for n in extra))
        out.append("\n".join(lines))
    head = "| clients | spec tau | TTFT ms spec batched / R=1 | ITL ms spec batched / R=1 | per-request tok/s spec batched / R=1 |"
    lines = ["latency (wall, medians; mean of the rounds):", "", head, "|---|---|---|---|---|"]
    for c in clients:
        lines.append(f"| {c} | {mean(c, 'spec batched', 'tau'):.2f} | {mean(c, 'spec batched', 'ttft_ms'):.0f} / "
                     f"{mean(c, 'spec R=1', 'ttft_ms'):.0f} | {mean(c, 'spec batched', 'itl_ms'):.0f} / "
                     f"{mean(c, 'spec R=1', 'itl_ms'):.0f} | {mean(c, 'spec batched', 'per_request_tok_s'):.1f} / "
                     f"{mean(c, 'spec R=1', 'per_request_tok_s'):.1f} |")
    out.append("\n".join(lines))
    return "\n\n".join(out)


def machine() -> dict:
    from dflash2_numba.kernels import isa

    model = next((line.split(":", 1)[1].strip() for line in
                  subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                  if line.startswith("Model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "isa": isa.describe()["isa"],
            "load_at_end": os.getloadavg()}


# ---------------------------------------------------------------- load test
def load(args) -> None:
    import dflash2_numba as dn
    from dflash2_numba.default import default_pair
    from dflash2_numba.kernels.backend import set_threads
    from dflash2_numba.decode.score import score
    from dflash2_numba.serve.reference import solo_answer

    target_dir, draft_dir = (args.target, args.draft) if args.target else default_pair()
    set_threads(1)
    target = dn.load_target(target_dir)
    draft = dn.load_draft(draft_dir, target)
    tok = target.tokenizer
    prompts = [tok.encode(p) for p in json.loads((ROOT / "bench" / "data" / "heldout_prompts.json").read_text())]
    rng = random.Random(args.seed)
    specs = []
    for i in range(args.requests):
        cancel = rng.random() < args.cancel
        temp = rng.choice([0.0, 0.8])
        kind = "cancel" if cancel else rng.choices(["plain", "batch", "logprobs"], [0.7, 0.15, 0.15])[0]
        spec = {"prompt": prompts[i % len(prompts)][:rng.randint(4, 64)], "max_tokens": 400 if cancel else rng.randint(1, 64),
                "block_size": rng.randint(2, draft.block_size), "temperature": temp,
                "seed": rng.randint(0, 10 ** 6) if temp else None, "stream": cancel or rng.random() < 0.5,
                "cancel": cancel, "kind": kind, "n_prompts": 1}
        if kind == "batch":  # two prompts, two choices; not streamed
            spec.update(prompt=[spec["prompt"], prompts[(i + 7) % len(prompts)][:rng.randint(4, 64)]], stream=False,
                        n_prompts=2)
        if kind == "logprobs":
            spec.update(max_tokens=rng.choice([0, 1, rng.randint(2, 16)]), echo=True, logprobs=2)
        specs.append(spec)
    t0 = time.perf_counter()
    for s in specs:
        if s["cancel"]:
            continue
        ps = s["prompt"] if s["kind"] == "batch" else [s["prompt"]]
        s["expected"] = [solo_answer(target, draft, p, max_tokens=s["max_tokens"], block_size=s["block_size"],
                                     temperature=s["temperature"], seed=s["seed"]) if s["max_tokens"] else None
                         for p in ps]
        if s["kind"] == "logprobs":
            out = s["expected"][0].token_ids if s["max_tokens"] else []
            s["expected_logprobs"] = [x.logprob for x in score(target, s["prompt"] + out)]
            s["expected_text"] = tok.decode(s["prompt"]) + (s["expected"][0].text if s["max_tokens"] else "")
            s["expected_finish"] = s["expected"][0].finish_reason if s["max_tokens"] else "length"
    print(f"solo references: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    srv = ServerProcess(["--target", str(target_dir), "--draft", str(draft_dir),
                         "--max-running", str(args.max_running), "--max-waiting", str(args.max_waiting)],
                        "load").wait_ready()
    model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
    before = srv.metrics()
    todo = queue.Queue()
    for i, s in enumerate(specs):
        todo.put(i)
    results: list = [None] * len(specs)
    t_end = time.monotonic() + args.time_limit

    attempts = [0] * len(specs)  # a 429 / 503 puts the request back (after Retry-After / 5), MAX_TRIES at most

    def worker():
        while time.monotonic() < t_end:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            s = specs[i]
            body = {"model": model, "prompt": s["prompt"], "max_tokens": s["max_tokens"], "temperature": s["temperature"],
                    "seed": s["seed"], "block_size": s["block_size"]}
            if s["kind"] == "logprobs":
                body.update(echo=True, logprobs=s["logprobs"])
            attempts[i] += 1
            if s["stream"]:
                body.update(stream=True, stream_options={"include_usage": True})
                results[i] = stream_request(srv.url, body, cancel_after_first=s["cancel"])
            else:
                results[i] = plain_request(srv.url, body)
            if results[i]["status"] in (429, 503) and attempts[i] < MAX_TRIES:
                time.sleep(0.2)
                todo.put(i)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # the engine frees cancelled slots at its next step
    after = srv.metrics()
    code = srv.stop()
    counts = {k: 0 for k in ("correct", "wrong", "rejected", "cancelled", "lost", "not_sent")}
    wrong = []
    for s, r in zip(specs, results):
        kind = classify(s, r)
        counts[kind] += 1
        if kind == "wrong":
            wrong.append({"spec": {k: v for k, v in s.items() if k != "expected"}, "got": r.get("text")})
    d = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    success = sum(v for k, v in d.items() if k.startswith("request_success_total"))
    rejected = sum(v for k, v in d.items() if k.startswith("requests_rejected_total"))
    sent = len(specs) - counts["not_sent"]
    # an engine request per prompt: a batch of two counts twice in the server's counters
    w = [s["n_prompts"] for s in specs]
    kinds = [classify(s, r) for s, r in zip(specs, results)]
    weighted = {k: sum(n for n, c in zip(w, kinds) if c == k) for k in counts}
    tried = sum(a * n for a, n in zip(attempts, w))
    sent_w = sum(n for n, r in zip(w, results) if r is not None)
    reconcile = {
        "server requests_total == attempts (per prompt)": (d["requests_total"], tried),
        "server successes == correct + wrong (per prompt)": (success, weighted["correct"] + weighted["wrong"]),
        "server rejected == rejected attempts (per prompt)": (rejected, tried - sent_w + weighted["rejected"]),
        "server cancelled == cancelled": (d["requests_cancelled_total"], counts["cancelled"]),
        "server errors == 0": (d["request_errors_total"], 0),
        "running + waiting == 0 at the end": (after["requests_running"] + after["requests_waiting"], 0),
    }
    ok = all(a == b for a, b in reconcile.values())
    report = {"machine": machine(), "target": shown(target_dir), "draft": shown(draft_dir), "clients": args.clients,
              "requests": len(specs), "cancel_share": args.cancel, "max_running": args.max_running,
              "max_waiting": args.max_waiting, "wall_s": wall, "counts": counts,
              "kinds": {k: sum(s["kind"] == k for s in specs) for k in ("plain", "batch", "logprobs", "cancel")},
              "rejected_attempts": sum(attempts) - sent + counts["rejected"], "reconcile": reconcile,
              "reconciled": ok, "server_exit_code": code, "wrong_examples": wrong[:5]}
    print(json.dumps({k: report[k] for k in ("counts", "kinds", "rejected_attempts", "reconcile", "reconciled", "server_exit_code", "wall_s")},
                     indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(0 if ok and counts["wrong"] == 0 and counts["lost"] == 0 else 1)


def classify(spec: dict, r: dict | None) -> str:
    if r is None:
        return "not_sent"
    if spec["cancel"] and r.get("cancelled"):
        return "cancelled"
    if r["status"] in (429, 503):
        return "rejected"
    if r["status"] != 200 or r.get("error") or not r.get("finish_reason") or not r.get("done"):
        return "lost"
    e = spec.get("expected")
    if e is None:  # a cancel-on-purpose request that ended before its first chunk arrived
        return "lost"
    if spec["kind"] == "batch":
        chs = sorted(r.get("choices") or [], key=lambda c: c["index"])
        got = [(c["text"], c["finish_reason"]) for c in chs]
        want = [(x.text, x.finish_reason) for x in e]
        n = sum(x.completion_tokens for x in e)
        return "correct" if got == want and r["usage"]["completion_tokens"] == n else "wrong"
    if spec["kind"] == "logprobs":
        lps, want = r.get("token_logprobs") or [], spec["expected_logprobs"]
        same = (len(lps) == len(want) and lps[0] is None
                and all(abs(a - b) <= 1e-4 for a, b in zip(lps[1:], want[1:])))
        n = e[0].completion_tokens if e[0] is not None else 0
        got = (r["text"], r["usage"]["completion_tokens"], r["finish_reason"])
        return "correct" if same and got == (spec["expected_text"], n, spec["expected_finish"]) else "wrong"
    e = e[0]
    got = (r["text"], r["usage"]["completion_tokens"], r["finish_reason"])
    return "correct" if got == (e.text, e.completion_tokens, e.finish_reason) else "wrong"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    options = {  # mode -> (flag, type, default)
        "throughput": [("--target", Path, None), ("--draft", Path, None), ("--clients", str, "1,2,4,8"),
                       ("--max-tokens", int, 64), ("--prompt-tokens", int, 48), ("--min-requests", int, 4),
                       ("--block-size", str, "auto"), ("--fixed-block-size", int, None),
                       ("--solo-clients", str, None), ("--threads", int, 1), ("--rounds", int, 2), ("--out", str, None),
                       ("--twin", bool, False)],
        "load": [("--target", Path, None), ("--draft", Path, None), ("--clients", int, 8), ("--requests", int, 200),
                 ("--cancel", float, 0.1), ("--max-running", int, 4), ("--max-waiting", int, 3), ("--seed", int, 0),
                 ("--time-limit", float, 600.0), ("--out", str, None)],
    }
    for mode, flags in options.items():
        p = sub.add_parser(mode)
        for flag, kind, default in flags:
            if kind is bool:
                p.add_argument(flag, action="store_true")
            else:
                p.add_argument(flag, type=kind, default=default,
                               required=mode == "throughput" and flag in ("--target", "--draft"))
    args = ap.parse_args()
    (throughput if args.mode == "throughput" else load)(args)


if __name__ == "__main__":
    main()
