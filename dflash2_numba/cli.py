"""`dflash2-decode`: a thin click shell over the public API (spec §9).

    dflash2-decode generate [--target DIR] [--draft DIR] (--prompt T | --prompt-file P | --prompt-ids 1,2)
    dflash2-decode propose  [--target DIR] [--draft DIR] (prompt options) [--block-size Q] [--json PATH|-]
    dflash2-decode inspect  DIR [--json PATH|-]

Streams: `generate` writes the generated text to stdout as it is produced and the statistics
block to stderr. With `--json -` the JSON object goes to stdout INSTEAD of the streamed text
(so stdout stays parseable; the text is inside the object); with `--json PATH` the text still
streams and the object is written to PATH.

Without `--target`, the embedded default pair is used (see default.py), draft included unless
`--draft` names another. With `--target` and no `--draft`, decoding is target-only.

Errors: every refusal of this package (DFlashError) and every click usage error (`--block-size
abc`, an unknown option) prints ONE line `error: ClassName: message` on stderr and exits with
code 2. Output paths are opened (created) and prompt ids and prompt files read and checked
(cli_checks.py) before a model is loaded, so a refusal never follows partial output; a `--json`
file is written before the statistics, so a destination that fails only when written (a full
device) ends the run with the error as the last stderr line. A stdout that cannot be written
(`> /dev/full`, a closed pipe) is an OutputPathError too, not a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager

import click

from . import __version__
from .cli_checks import one_line, open_output, parse_prompt_ids, read_prompt_file
from .decode.sampling import SamplingParams
from .decode.width import parse_block_size
from .errors import DFlashError, GenerationArgumentError, OutputPathError
from .serve.command import make_serve_command
from .serve.protocol import REASONING_EFFORTS
from .serve.reasoning import ReplySplit, reasoning_parser


class _Group(click.Group):
    """Turns every DFlashError and every click usage error into one stderr line, exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DFlashError as e:
            click.echo(one_line(e), err=True)  # one line, whatever the message held
            ctx.exit(2)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:  # click's standalone mode would print usage + "Error: ..." on three lines
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:  # UsageError, BadParameter, NoSuchOption, ...: exit 2
            click.echo(one_line(e), err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)  # ctx.exit(n) comes back as n


@click.group(cls=_Group)
@click.version_option(version=__version__, prog_name="dflash2-decode")
def main():
    """Lossless speculative decoding with DFlash / DFlash2 drafts (numpy + numba)."""


# ---------------------------------------------------------------- shared options
def _prompt_options(f):
    f = click.option("--reasoning-effort", type=click.Choice(REASONING_EFFORTS), default=None,
                     help="With --chat: the template's reasoning_effort (gpt-oss; the template's default when "
                          "omitted).")(f)
    f = click.option("--think/--no-think", default=False, show_default=True,
                     help="With --chat: render the template with enable_thinking (Qwen3-style thinking on).")(f)
    f = click.option("--chat/--no-chat", default=False, show_default=True,
                     help="Render the prompt with the target's chat template (thinking off unless --think).")(f)
    f = click.option("--prompt-ids", default=None, help="Comma-separated prompt token ids, e.g. 1,2,3.")(f)
    f = click.option("--prompt-file", type=click.Path(dir_okay=False), default=None,
                     help="Read the prompt text from a UTF-8 file.")(f)
    f = click.option("--prompt", default=None, help="Prompt text.")(f)
    return f


def _model_options(f):
    f = click.option("--threads", type=int, default=None,
                     help="threads for the CPU kernels, numba's and BLAS's (default: the physical cores; 1 for a "
                          "model under 32M parameters).")(f)
    f = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)(f)
    f = click.option("--dtype", type=click.Choice(["f32", "bf16"]), default="f32", show_default=True,
                     help="f32: compute in float32 from bf16 weights; bf16: round activations like eager PyTorch.")(f)
    f = click.option("--draft", "draft_dir", type=click.Path(), default=None,
                     help="DFlash / DFlash2 draft directory (omit for target-only decoding).")(f)
    f = click.option("--target", "target_dir", type=click.Path(), default=None,
                     help="Hugging Face target directory (default: the embedded default pair).")(f)
    return f


def _sampling_options(f):
    f = click.option("--seed", type=int, default=None, help="RNG seed (sampling reproducibility).")(f)
    f = click.option("--top-p", type=float, default=1.0, show_default=True)(f)
    f = click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")(f)
    f = click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")(f)
    f = click.option("--block-size", default="auto", show_default=True, metavar="auto|Q",
                     help="Verify width: auto = per step, the number of draft rows that maximises expected "
                          "tokens per second (measured costs, draft confidence); an integer Q in 2..B fixes "
                          "it (docs/adaptive_width.md).")(f)
    return f


def _template_kwargs(target, chat: bool, think: bool, effort: str | None) -> dict:
    """--think / --reasoning-effort as chat template variables (both need --chat; an effort
    needs a template that reads reasoning_effort)."""
    if think and not chat:
        raise GenerationArgumentError("--think renders the chat template with thinking on: it needs --chat")
    kwargs = {"enable_thinking": think}
    if effort is not None:
        if not chat:
            raise GenerationArgumentError("--reasoning-effort is a chat template variable: it needs --chat")
        if not target.tokenizer.takes("reasoning_effort"):
            raise GenerationArgumentError(f"--reasoning-effort: the chat template ({target.tokenizer.chat_template_source}) "
                                          "does not read reasoning_effort")
        kwargs["reasoning_effort"] = effort
    return kwargs


def _read_prompt(prompt, prompt_file, prompt_ids):
    given = [x is not None for x in (prompt, prompt_file, prompt_ids)]
    if sum(given) != 1:
        raise GenerationArgumentError("give exactly one of --prompt, --prompt-file, --prompt-ids")
    if prompt_file is not None:
        return read_prompt_file(prompt_file), None
    if prompt_ids is not None:
        return None, parse_prompt_ids(prompt_ids)
    return prompt, None


WEIGHT_FORMATS = ("bf16", "q8_0", "q4_0", "q4_k")  # --quantize / --draft-quantize


def _quantize_option(f):
    """--quantize (the weight format) and --kv-dtype (the KV cache's): how the model is held."""
    f = click.option("--kv-dtype", type=click.Choice(["f32", "bf16"]), default="f32", show_default=True,
                     help="KV cache element type (target and draft): bf16 halves the bytes attention reads at long "
                          "context; its logits differ from f32's by the rounding of K and V (docs/long_context.md). "
                          "CPU only.")(f)
    return click.option("--quantize", type=click.Choice(WEIGHT_FORMATS), default="bf16", show_default=True,
                        help="Weight format: bf16 = as stored; q8_0 / q4_0 / q4_k = llama.cpp's blocks, quantized at load "
                             "(target and draft, lm_head included).")(f)


def _draft_quantize_option(f):
    """--draft-quantize: the draft's weight format, when it should differ from the target's."""
    return click.option("--draft-quantize", type=click.Choice(("auto", "same") + WEIGHT_FORMATS),
                        default="auto", show_default=True,
                        help="The draft's weight format: auto = the one measured cheaper on this kernel path for "
                             "this target (a large draft beside a bf16 target on AVX-512 VNNI: q8_0; beside a q8_0 "
                             "target on AVX2: bf16), else the target's; same = the target's (--quantize). The "
                             "output is the target's either way.")(f)


def _load(target_dir, draft_dir, device, dtype, threads, need_draft=False, quantize=None, kv_dtype="f32",
          draft_quantize="auto"):
    from . import api
    from .default import default_pair
    from .kernels.backend import default_threads, set_threads

    set_threads(threads)
    if target_dir is None:
        target_dir, default_draft = default_pair()
        draft_dir = draft_dir or default_draft
    if need_draft and draft_dir is None:
        raise GenerationArgumentError("this command needs a draft: pass --draft DIR")
    target = api.load_target(target_dir, device=device, dtype=dtype, quantize=quantize, kv_dtype=kv_dtype)
    if draft_quantize not in ("auto", "same") and draft_dir is None:
        raise GenerationArgumentError(f"--draft-quantize {draft_quantize}: there is no draft (pass --draft DIR)")
    draft = api.load_draft(draft_dir, target, quantize=draft_quantize) if draft_dir is not None else None
    if draft is not None and draft.weight_format != (quantize or "bf16"):  # not the target's: say why
        click.echo(f"draft    {draft.weight_format} weights ({draft.format_reason})", err=True)
    if threads is None:  # the default: the physical cores, one thread for a small model
        set_threads(default_threads(target.checkpoint.parameter_count()))
    return target_dir, draft_dir, target, draft


def emit(text: str, nl: bool = True) -> None:
    """click.echo to stdout. A stdout that refuses the bytes (a full device, a closed pipe) is
    an OutputPathError; stdout then points at /dev/null so that the interpreter's final flush
    of what is still buffered cannot print a second, unhandled error."""
    try:
        click.echo(text, nl=nl)
    except OSError as e:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        raise OutputPathError(f"stdout: cannot write ({e.strerror})") from e


@contextmanager
def json_destination(dest):
    """`--json dest` opened now (cli_checks.open_output); a file this run created is removed
    again when the run fails before writing it."""
    out = open_output(dest)
    try:
        yield out
    except BaseException:
        if out is not None:
            out.discard()
        raise


def _write_json(obj, dest, out) -> None:
    text = json.dumps(obj, indent=2, ensure_ascii=False)
    if dest == "-":
        emit(text)
    else:
        out.write(text + "\n")


class _Reply:
    """`generate --chat`: the reply's content streams to stdout; its reasoning (what the
    tokenizer's thinking format marks, serve/reasoning.py) to stderr between two rule lines
    (--reasoning stderr) or nowhere (hide). Markers and the stop token are neither."""

    def __init__(self, tokenizer, prompt_ids, mode: str, show: bool):
        self.split = ReplySplit(tokenizer, reasoning_parser(tokenizer), prompt_ids)
        self.mode, self.show, self.open = mode, show, False
        self.reasoning, self.content = [], []

    def add(self, step) -> None:
        n = len(step.token_ids)
        for j, t in enumerate(step.token_ids):
            last = j == n - 1
            _, r, c = self.split.feed(t, stop_id=step.finish_reason == "stop" and last,
                                      last=step.finish_reason is not None and last)
            self.reasoning.append(r)
            self.content.append(c)
            if self.show and r and self.mode == "stderr":
                if not self.open:
                    click.echo("--- reasoning ---", err=True)
                    self.open = True
                click.echo(r, err=True, nl=False)
            if self.show and c:
                self._close()
                emit(c, nl=False)
        if step.finish_reason is not None:
            self._close()

    def _close(self) -> None:
        if self.open:
            click.echo("\n--- end of reasoning ---", err=True)
            self.open = False

    def fields(self) -> dict:
        return {"reasoning": "".join(self.reasoning), "content": "".join(self.content)}


# ---------------------------------------------------------------- generate
@main.command()
@_model_options
@_prompt_options
@_sampling_options
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--stop-token", "stop_tokens", type=int, multiple=True,
              help="Extra stop id (repeatable); added to the model's eos ids.")
@click.option("--baseline", is_flag=True, help="Also run target-only on the same prompt and report the speedup.")
@click.option("--draft-window", type=int, default=0, show_default=True, metavar="N",
              help="The draft attends to the last N context positions only (0 = all; the draft's own sliding "
                   "layers keep their windows). Output is the target's either way (docs/long_context.md).")
@click.option("--json", "json_dest", default=None, metavar="PATH|-",
              help="Write the result object to PATH, or to stdout with '-' (then text is not streamed).")
@click.option("--reasoning", type=click.Choice(["stderr", "hide", "raw"]), default="stderr", show_default=True,
              help="With --chat: where the reply's reasoning goes (a thinking format's: gpt-oss's analysis channel, "
                   "Qwen3's <think>); stdout gets the answer. raw: the generated text as is, markers included.")
@_quantize_option
@_draft_quantize_option
def generate(target_dir, draft_dir, device, threads, dtype, prompt, prompt_file, prompt_ids, chat, think,
              reasoning_effort, block_size, temperature, top_k, top_p, seed, max_new_tokens, stop_tokens, baseline,
              draft_window, json_dest, reasoning, quantize, kv_dtype, draft_quantize):
    """Generate text; stream it to stdout, statistics to stderr."""
    from .decode.loop import generate as run_generate, resolve_prompt_ids, stream_generate
    from .decode.stats import peak_rss_mb
    from .decode.warmup import warm_up

    with json_destination(json_dest) as out:
        SamplingParams(temperature, top_k, top_p, seed)  # refused before the (slow) model load
        block_size = parse_block_size(block_size)  # "auto" | int >= 2; 2..B once the draft is known
        prompt, ids = _read_prompt(prompt, prompt_file, prompt_ids)
        target_dir, draft_dir, target, draft = _load(target_dir, draft_dir, device, dtype, threads, quantize=quantize,
                                                     kv_dtype=kv_dtype, draft_quantize=draft_quantize)
        ids = resolve_prompt_ids(target, prompt, ids, chat, **_template_kwargs(target, chat, think, reasoning_effort))
        kwargs = dict(max_new_tokens=max_new_tokens, block_size=block_size, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, stop_token_ids=stop_tokens, prompt_ids=ids,
                      draft_window=draft_window)

        # compile first (cold cache: one notice), so that no timing below pays the JIT
        compile_s = warm_up(target, draft, baseline=baseline, **kwargs)

        tokens, parts, finish, stats = [], [], None, None
        reply = _Reply(target.tokenizer, ids, reasoning, show=json_dest != "-") if chat and reasoning != "raw" else None
        for step in stream_generate(target, draft, **kwargs):
            tokens.extend(step.token_ids)
            parts.append(step.text)
            finish, stats = step.finish_reason, step.stats
            if reply is not None:
                reply.add(step)
            elif json_dest != "-" and step.text:
                emit(step.text, nl=False)
        if json_dest != "-":
            emit("")  # the text's last line before the stats block on stderr

        if baseline:
            base = run_generate(target, None, **dict(kwargs, block_size=None, draft_window=0))
            stats.set_baseline(base.stats)
            if temperature == 0.0 and base.output_ids != tokens:
                i = next((j for j, (a, b) in enumerate(zip(base.output_ids, tokens)) if a != b),
                         min(len(base.output_ids), len(tokens)))
                click.echo(f"warning: greedy speculative output differs from target-only at token {i}", err=True)
        stats.compile_s = compile_s
        stats.peak_rss_mb = peak_rss_mb()

        if json_dest is not None:  # before the stats: a failed write is the last stderr line
            s = stats.to_dict()
            _write_json({
                "target": str(target_dir), "draft": None if draft_dir is None else str(draft_dir),
                "draft_kind": None if draft is None else draft.kind,
                "draft_format": None if draft is None else draft.weight_format, "block_size": stats.block_size,
                "width": stats.width,
                "prompt_ids": ids, "output_ids": tokens, "text": "".join(parts), "finish_reason": finish,
                **(reply.fields() if reply is not None else {}),
                "stats": {k: s[k] for k in (
                    "steps", "tau", "acceptance_lengths", "acceptance_histogram", "block_rows",
                    "width_histogram", "drafted_steps",
                    "per_position_acceptance", "prefill_s", "draft_s", "verify_s", "decode_s",
                    "tokens_per_s", "baseline_tokens_per_s", "speedup", "peak_rss_mb")},
            }, json_dest, out)
        click.echo(stats.format(), err=True)


# ---------------------------------------------------------------- score
@main.command()
@_model_options
@_prompt_options
@click.option("--continuation", default=None,
              help="Text scored after the prompt (tokenised on its own, as evaluators do); the total is "
                   "log p(continuation | prompt).")
@click.option("--top", "top_n", type=int, default=0, show_default=True, help="Top alternatives per position (0..20).")
@click.option("--json", "json_dest", default=None, metavar="PATH|-", help="Write the scores to PATH or stdout ('-').")
@_quantize_option
def score(target_dir, draft_dir, device, threads, dtype, prompt, prompt_file, prompt_ids, chat, think,
          reasoning_effort, continuation, top_n, json_dest, quantize, kv_dtype):
    """The target's log-probability of each prompt token (what the server's echo + logprobs report)."""
    from .decode.logprobs import MAX_TOP_LOGPROBS
    from .decode.loop import resolve_prompt_ids
    from .decode.score import score as run_score

    with json_destination(json_dest) as out:
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise GenerationArgumentError(f"--top must be in 0..{MAX_TOP_LOGPROBS}, got {top_n}")
        prompt, ids = _read_prompt(prompt, prompt_file, prompt_ids)
        _, _, target, _ = _load(target_dir, None, device, dtype, threads, quantize=quantize, kv_dtype=kv_dtype)
        ids = resolve_prompt_ids(target, prompt, ids, chat, **_template_kwargs(target, chat, think, reasoning_effort))
        n_context = len(ids)
        if continuation is not None:
            ids = ids + target.tokenizer.encode(continuation, add_special_tokens=False)
            if len(ids) == n_context:
                raise GenerationArgumentError("--continuation encodes to no tokens")
        lps = run_score(target, ids, top_n)
        tok = target.tokenizer
        rows = [{"id": x.token_id, "token": tok.decode([x.token_id]), "logprob": x.logprob,
                 "top": [{"id": j, "token": tok.decode([j]), "logprob": v} for j, v in x.top]} for x in lps]
        total = sum(x.logprob for x in lps[max(1, n_context if continuation is not None else 1):])
        if json_dest is not None:
            _write_json({"prompt_ids": ids, "n_context": n_context, "tokens": rows,
                         "logprob_sum": total, "scored_from": n_context if continuation is not None else 1},
                        json_dest, out)
    if json_dest == "-":
        return
    for i, r in enumerate(rows):
        lp = "null" if r["logprob"] is None else f"{r['logprob']:.6f}"
        mark = " *" if continuation is not None and i >= n_context else ""
        emit(f"{i:5d} {r['id']:7d} {r['token']!r:20} {lp}{mark}")
    what = "log p(continuation | prompt)" if continuation is not None else "sum over tokens 1.."
    emit(f"{what}: {total:.6f}")


# ---------------------------------------------------------------- propose
@main.command()
@_model_options
@_prompt_options
@_sampling_options
@click.option("--json", "json_dest", default=None, metavar="PATH|-", help="Write the proposal object to PATH or stdout ('-').")
@_quantize_option
@_draft_quantize_option
def propose(target_dir, draft_dir, device, threads, dtype, prompt, prompt_file, prompt_ids, chat, think,
            reasoning_effort, block_size, temperature, top_k, top_p, seed, json_dest, quantize, kv_dtype,
            draft_quantize):
    """One draft proposal round, stopping before verification."""
    from .decode.loop import propose_once, resolve_prompt_ids

    with json_destination(json_dest) as out:
        SamplingParams(temperature, top_k, top_p, seed)
        block_size = parse_block_size(block_size)
        prompt, ids = _read_prompt(prompt, prompt_file, prompt_ids)
        _, _, target, draft = _load(target_dir, draft_dir, device, dtype, threads, need_draft=True, quantize=quantize,
                                    kv_dtype=kv_dtype, draft_quantize=draft_quantize)
        ids = resolve_prompt_ids(target, prompt, ids, chat, **_template_kwargs(target, chat, think, reasoning_effort))
        res = propose_once(target, draft, prompt_ids=ids, block_size=block_size,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        if json_dest is not None:
            _write_json(res, json_dest, out)
    if json_dest == "-":
        return
    tok = getattr(target, "tokenizer", None)
    show = (lambda i: repr(tok.decode([i]))) if tok is not None else str
    emit(f"draft kind {draft.kind}, prompt {len(res['prompt_ids'])} tokens, "
               f"anchor {res['anchor']} {show(res['anchor'])} at position {res['anchor_position']}")
    chosen = res.get("chosen_slots")
    for j, (pos, d) in enumerate(zip(res["positions"], res["draft_ids"])):
        line = f"  pos {pos}: draft {d} {show(d)}"
        if chosen is not None:
            line += f" (slot {chosen[j]})"
        emit(line)
        slot = (res.get("slots") or [None] * len(res["draft_ids"]))[j]
        if slot:
            cands = ", ".join(f"{c} {show(c)} {s:.3f}" for c, s in
                              zip(slot["candidate_ids"], slot["candidate_scores"]))
            emit(f"      candidates: {cands}")


# ---------------------------------------------------------------- inspect
@main.command()
@click.argument("model_dir", type=click.Path())
@click.option("--json", "json_dest", default=None, metavar="PATH|-", help="Write the report to PATH or stdout ('-').")
@click.option("--no-hash", is_flag=True, help="Skip the sha256 of the files.")
def inspect(model_dir, json_dest, no_hash):
    """Resolved config, architecture, tensor inventory and sha256 of a target or draft directory."""
    from .inspect_model import format_inspect, inspect_model

    with json_destination(json_dest) as out:
        report = inspect_model(model_dir, hash_files=not no_hash)
        if json_dest is not None:
            _write_json(report, json_dest, out)
    if json_dest != "-":
        emit(format_inspect(report))


main.add_command(make_serve_command(_model_options, _load, lambda f: _quantize_option(_draft_quantize_option(f))))  # serve/command.py


if __name__ == "__main__":
    sys.exit(main())
