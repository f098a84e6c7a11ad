"""lm-evaluation-harness `local-completions` against `dflash2-decode serve`, offline, checked
against transformers (docs/lm_eval.md).

    python bench/lm_eval_check.py [--out bench/results/lm_eval_check.json] [--batch-size 4]

1. starts `python -m dflash2_numba serve` (the embedded pair, DFlash2 draft) on a free loopback port;
2. runs `lm_eval run --model local-completions` (HF_*_OFFLINE=1) on the two custom tasks of
   docs/lm_eval/ (a multiple-choice log-likelihood task and a greedy generation task) with
   --log_samples;
3. recomputes every choice's log p(continuation | context) with transformers (float32, the same
   target directory; the context / continuation split as lm-eval's causal `_encode_pair` makes
   it) and every generation with transformers' greedy `generate`, cut at the task's `until`;
4. prints and writes: lm-eval's table numbers, the largest |lm-eval - transformers| over all
   choices (must be <= 2e-3), generations equal (must be all), and the server's counters.
Exit status 0 only when everything holds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "dflash2_numba" / "assets" / "default" / "target"
TASKS = ROOT / "docs" / "lm_eval"
TOL = 2e-3
MAX_GEN = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 300) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not become ready within {timeout} s")


def transformers_reference(mc_samples, gen_samples):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    diffs, rows = [], []
    for s in mc_samples:
        for k, arg in enumerate(s["arguments"].values()):
            context, continuation = arg["arg_0"], arg["arg_1"]
            n = len(context) - len(context.rstrip())  # lm-eval's _encode_pair (causal)
            if n:
                continuation, context = context[-n:] + continuation, context[:-n]
            whole = tok(context + continuation, add_special_tokens=False).input_ids
            n_ctx = len(tok(context, add_special_tokens=False).input_ids)
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            ref = sum(float(lp[i - 1, whole[i]]) for i in range(n_ctx, len(whole)))
            got = float(s["resps"][k][0][0])
            diffs.append(abs(got - ref))
            rows.append({"doc": s["doc_id"], "choice": k, "n_continuation_tokens": len(whole) - n_ctx,
                         "lm_eval": got, "transformers": ref, "abs_diff": abs(got - ref)})
    gens = []
    for s in gen_samples:
        arg = s["arguments"]["gen_args_0"]
        ids = tok(arg["arg_0"], add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=arg["arg_1"]["max_gen_toks"], do_sample=False,
                                 eos_token_id=4000, pad_token_id=4000)[0, len(ids):].tolist()
        text = tok.decode([t for t in out if t != 4000])
        for u in arg["arg_1"]["until"]:
            text = text.split(u)[0]
        gens.append({"doc": s["doc_id"], "lm_eval": s["resps"][0][0], "transformers": text,
                     "equal": s["resps"][0][0] == text})
    return rows, gens


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lm_eval_check.json"))
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    server = subprocess.Popen([sys.executable, "-m", "dflash2_numba", "serve", "--port", str(port), "--threads", "1",
                               "--max-running", "4", "--max-waiting", "16"], cwd=ROOT, env=env)
    try:
        wait_ready(url)
        out_dir = tempfile.mkdtemp(prefix="lm_eval_")
        cmd = ["lm_eval", "run", "--model", "local-completions", "--model_args",
               f"model=dflash2-default,base_url={url}/v1/completions,tokenizer={TARGET.relative_to(ROOT)},"
               "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,tokenized_requests=True",
               "--batch_size", str(args.batch_size), "--tasks", "dflash2_py_mc,dflash2_py_gen",
               "--include_path", str(TASKS.relative_to(ROOT)), "--log_samples", "--output_path", out_dir]
        t0 = time.perf_counter()
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        lm_eval_s = time.perf_counter() - t0
        print(run.stdout[-3000:])
        if run.returncode != 0:
            print(run.stderr[-4000:], file=sys.stderr)
            return 1
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            counters = {ln.split()[0]: float(ln.split()[1]) for ln in r.read().decode().splitlines()
                        if ln.startswith("dflash2:request") and " " in ln}
    finally:
        server.terminate()
        server.wait(60)

    def samples(task):
        (path,) = glob.glob(f"{out_dir}/*/samples_{task}_*.jsonl")
        return [json.loads(line) for line in open(path)]

    (results_path,) = glob.glob(f"{out_dir}/*/results_*.json")
    results = json.load(open(results_path))["results"]
    rows, gens = transformers_reference(samples("dflash2_py_mc"), samples("dflash2_py_gen"))
    worst = max(r["abs_diff"] for r in rows)
    report = {
        "command": " ".join(cmd[:5] + ["'" + cmd[5] + "'"] + cmd[6:]).replace(url, "http://127.0.0.1:PORT")
                   .replace(out_dir, "OUT"),
        "lm_eval_seconds": round(lm_eval_s, 1),
        "results": {t: {k: v for k, v in r.items() if k != "alias"} for t, r in results.items()},
        "choices": len(rows), "max_abs_diff_vs_transformers": worst, "tolerance": TOL,
        "generations": len(gens), "generations_equal": sum(g["equal"] for g in gens),
        "server_counters": counters, "per_choice": rows, "per_generation": gens,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    ok = worst <= TOL and all(g["equal"] for g in gens)
    print(f"{len(rows)} choices: max |lm-eval - transformers| = {worst:.2e} (tolerance {TOL}); "
          f"{report['generations_equal']}/{len(gens)} generations equal transformers' greedy; "
          f"lm-eval took {lm_eval_s:.1f} s; {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
