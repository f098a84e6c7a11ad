"""Prefill against llama.cpp on the same weights: seconds to take a --prompt-len token prompt
into the KV cache (the last row's logits out), both engines alternately, median of --rounds.

    python bench/prefill_vs_llamacpp.py [--quantize bf16|q8_0|q4_0] [--prompt-len 512] [--threads 1,2]
        [--rounds 5] [--llama-no-extra-bufts] [--out JSON]
    DFLASH2_ISA=avx2 python bench/prefill_vs_llamacpp.py ...    # our AVX2 path (build llama.cpp for AVX2 too)

The model and the GGUF are bench_vs_llamacpp.py's (the ~120M random Qwen3, its own GGUF writer and
llama.cpp's quantizer, every matrix in the format); the engines are its NumbaEngine and
LlamaCppEngine (llama.cpp evaluates the prompt in one n_batch = 512 batch). Records the CPU, our
instruction-set path, llama.cpp's system info and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", choices=("bf16", "q8_0", "q4_0"), default="bf16")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llama-no-extra-bufts", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    os.environ.setdefault("NUMBA_NUM_THREADS", str(max(threads)))
    sys.argv = [sys.argv[0]]  # bench_vs_llamacpp parses its own argv only under __main__
    sys.path.insert(0, str(HERE))
    import numpy as np

    import bench_vs_llamacpp as bvl
    from acceptance import cpu_model

    ns = argparse.Namespace(quantize=args.quantize, model="dense", threads=threads, prompt_len=args.prompt_len,
                            tokens=1, check_tokens=1, llama_no_extra_bufts=args.llama_no_extra_bufts)
    src = bvl.model_dir(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash2_numba")
    ours, llama = bvl.NumbaEngine(src, ns), bvl.LlamaCppEngine(src, ns)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 1000, args.prompt_len)]
    runs = {"dflash2-numba": lambda: ours.prompt_logits(prompt), "llama.cpp": lambda: llama.prompt_logits(prompt)}
    load_before = os.getloadavg()
    out = {}
    for t in threads:
        ours.set_threads(t)
        llama.set_threads(t)
        first = {name: run() for name, run in runs.items()}  # warm-up (compilation, pages)
        secs = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                secs[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(s) for name, s in secs.items()}
        z, o = first["llama.cpp"], first["dflash2-numba"]
        out[str(t)] = {"seconds": secs, "median_s": med, "tokens_per_s": {n: args.prompt_len / s for n, s in med.items()},
                       "ours_over_llama": med["llama.cpp"] / med["dflash2-numba"],
                       "same_argmax": bool(z.argmax() == o.argmax()),
                       "logit_diff_over_max": float(np.abs(z - o).max() / np.abs(o).max())}
        print(f"{t} thread(s): dflash2-numba {args.prompt_len / med['dflash2-numba']:.0f} tok/s, llama.cpp "
              f"{args.prompt_len / med['llama.cpp']:.0f} tok/s -> {out[str(t)]['ours_over_llama']:.2f}x "
              f"(same argmax {out[str(t)]['same_argmax']})", flush=True)
    record = {"cpu": cpu_model(), "isa": bvl.isa_facts(), "llama_cpp_system_info": llama.system_info,
              "quantize": args.quantize, "prompt_len": args.prompt_len, "load_average": [load_before, os.getloadavg()],
              "threads": out}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
