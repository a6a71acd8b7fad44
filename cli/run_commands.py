"""`edgepack run` and `edgepack compare`: the runtime shim from the command line."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .options import (
    ACTIVATIONS_CHOICE,
    KV_CHOICE,
    json_option,
    kernels_option,
    kernels_or_none,
    kv_option,
    require_signature_option,
    threads_option,
    threshold_option,
    trusted_key_option,
)
from .output import json_text, log_to_stderr, record
from .pointers import PackagePath

if TYPE_CHECKING:
    from edgepack.runtime_shim.session import Session
    from edgepack.runtime_shim.stats import GenerationStats


def _stats_json(st: GenerationStats, session: Session, rss_before_open: int) -> dict[str, Any]:
    """The statistics text ``run`` prints, as JSON: the counters, the derived rates and
    the memory: tensor bytes mapped, KV cache bytes the session holds, the layer arena
    (planned at open), the process's peak resident set and its resident set before the
    package was opened (the interpreter and the libraries: part of the peak)."""
    from edgepack.runtime_shim.stats import peak_rss_bytes

    return {
        **dataclasses.asdict(st),
        "prefill_tokens_per_s": st.prefill_tokens_per_s,
        "decode_tokens_per_s": st.decode_tokens_per_s,
        "kv_tokens": session.seq.length,
        "kv_bytes": len(session.seq.blocks) * session.model.kv_pool.bytes_per_block,
        "weights_mapped_bytes": session.model.weights_mapped_bytes,
        "arena_bytes": session.model.arena.nbytes,
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_before_open_bytes": rss_before_open,
    }


def _lookup_line(st: GenerationStats) -> str:
    if st.lookup == "off":
        return ""
    return (
        f"prompt lookup ({st.lookup}): {st.accepted_tokens} of {st.drafted_tokens} drafted "
        f"tokens accepted in {st.verify_passes} verify passes\n"
    )


def _stats_text(st: GenerationStats, session: Session, rss_before_open: int) -> str:
    stats = _stats_json(st, session, rss_before_open)
    mem = {k: v / 2**20 for k, v in stats.items() if k.endswith("_bytes")}
    return (
        f"{st.prompt_tokens} prompt tokens ({st.cached_prompt_tokens} cached), "
        f"{st.generated_tokens} generated ({st.finish_reason})\n"
        f"time to first token {st.time_to_first_token * 1000:.0f} ms\n"
        f"prefill {st.prefill_tokens_per_s:.1f} tok/s, "
        f"decode {st.decode_tokens_per_s:.1f} tok/s\n"
        f"precision fallbacks {st.precision_fallbacks}; kernels {st.kernel_path}; "
        f"kv {st.kv_mode} ({session.seq.length} tokens held); activations {st.activations}\n"
        f"{_lookup_line(st)}"
        f"memory: weights mapped {mem['weights_mapped_bytes']:.1f} MiB, "
        f"KV {mem['kv_bytes']:.2f} MiB, arena {mem['arena_bytes']:.2f} MiB, "
        f"peak RSS {mem['peak_rss_bytes']:.1f} MiB "
        f"({mem['rss_before_open_bytes']:.1f} MiB before the package was opened)"
    )


def _log_to_stderr(verbose: bool, quiet: bool = False) -> None:
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO
    log_to_stderr(logging.Formatter("%(message)s"), level)
    logging.getLogger("edgepack.native").setLevel(logging.WARNING)  # the runtime says it


def _prompt_text(prompt: str | None, prompt_file: str | None) -> str | None:
    """The text of ``-p`` (``-`` reads stdin) or ``-f``; at most one of them."""
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give -p/--prompt or -f/--file, not both")
    if prompt_file is not None:
        try:
            return Path(prompt_file).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise click.BadParameter(
                f"{prompt_file} is not UTF-8 text ({exc.reason})", param_hint="-f/--file"
            ) from None
    if prompt == "-":
        return sys.stdin.read()
    return prompt


def _user_turns(prompt_to: Any) -> Iterator[str]:
    """User turns from stdin, one a line: ``/exit`` or end of input ends the conversation.
    On a terminal each turn is asked for with ``> `` on ``prompt_to``."""
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            prompt_to.write("> ")
            prompt_to.flush()
        line = sys.stdin.readline()
        if not line:  # EOF
            return
        text = line.rstrip("\r\n")
        if text.strip() == "/exit":
            return
        if text.strip():
            yield text


@click.command()
@click.argument("package", type=PackagePath())
@click.option(
    "-p",
    "--prompt",
    default=None,
    metavar="TEXT",
    help="Prompt text ('-' reads stdin); with -cnv, the system message.",
)
@click.option(
    "-f",
    "--file",
    "prompt_file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="Read the prompt from this UTF-8 file (instead of -p).",
)
@click.option(
    "-cnv",
    "--conversation",
    is_flag=True,
    help="Chat turn by turn: user turns are read from stdin, one a line, until /exit or "
    "end of input; the KV cache carries over between turns.",
)
@click.option("--max-tokens", default=128, show_default=True, help="Tokens to generate (a turn).")
@click.option(
    "--chat", is_flag=True, help="Wrap the prompt as a user message of the chat template."
)
@click.option("--system", default=None, metavar="TEXT", help="System message (--chat, -cnv).")
@click.option(
    "--temperature",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="0 is greedy.",
)
@click.option(
    "--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 disables."
)
@click.option(
    "--top-p",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, 1, min_open=True),
    help="1 disables.",
)
@click.option("--seed", default=None, type=int, help="Sampling seed (default: random).")
@threads_option
@kv_option
@click.option(
    "--activations",
    default="auto",
    type=ACTIVATIONS_CHOICE,
    show_default=True,
    help="Matmul inputs (auto: int8 where the package allows).",
)
@kernels_option
@trusted_key_option("Require a signature by this public key (NAME.pub); repeatable.")
@click.option(
    "--verify",
    default="signature",
    type=click.Choice(["signature", "full", "none"]),
    show_default=True,
    help="signature: check the signature and hash every tensor (a verified-install "
    "record may stand in); full: also hash every section, always; none: check nothing.",
)
@threshold_option
@require_signature_option
@click.option(
    "--stats-json",
    "stats_file",
    default=None,
    type=click.Path(dir_okay=False, writable=True),
    help="Write the statistics (timings, tokens, tok/s, KV bytes, peak RSS) to this JSON "
    "file; with -cnv, one object per turn.",
)
@click.option(
    "--lookup",
    type=click.Choice(["auto", "on", "off"]),
    default=None,
    is_flag=False,
    flag_value="on",
    help="Prompt-lookup decoding (greedy only, same output): draft tokens from the "
    "prompt, verified in one pass. --lookup alone: on; auto: only while it is faster. "
    "[default: the runtime's]",
)
@click.option("-v", "--verbose", is_flag=True, help="Log precision fallbacks and more.")
@json_option("the generated text and the statistics, one object at the end")
@click.option(
    "-q", "--quiet", is_flag=True, help="Print only the generated text: no statistics or logs."
)
def run(
    package: str,
    prompt: str | None,
    prompt_file: str | None,
    conversation: bool,
    max_tokens: int,
    chat: bool,
    system: str | None,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int | None,
    threads: int | None,
    kv: str,
    activations: str,
    kernels: str,
    trusted_keys: tuple[str, ...],
    verify: str,
    threshold: int,
    require_signature: bool,
    stats_file: str | None,
    lookup: str | None,
    verbose: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Generate text from PACKAGE, streaming it; statistics go to stderr at the end
    (--json: nothing streams; one object with the text and the statistics). With -cnv,
    a conversation: each line of stdin is a user turn, each reply streams back."""
    from edgepack import runtime_shim
    from edgepack.runtime_shim.heap import release_library_code
    from edgepack.runtime_shim.stats import rss_bytes

    _log_to_stderr(verbose, quiet)
    text = _prompt_text(prompt, prompt_file)
    if conversation:
        if text is not None and system is not None:
            raise click.UsageError("with -cnv, -p/-f is the system message: give it or --system")
        system = system if text is None else text
    elif text is None:
        raise click.UsageError("give the prompt: -p TEXT, -p - (stdin), -f FILE, or -cnv")
    rss_before_open = rss_bytes()
    model = runtime_shim.open(
        package,
        trusted_keys=list(trusted_keys) or None,
        threads=threads,
        kv=kv,
        kernels=kernels_or_none(kernels),
        verify=verify,
        threshold=threshold,
        require_signature=require_signature,
        activations=activations,
    )
    sampling: dict[str, Any] = {
        "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed
    }  # fmt: skip
    if lookup is not None:
        sampling["lookup"] = {"on": True, "off": False}.get(lookup, lookup)
    with model, model.session() as session:
        if conversation:
            _converse(
                session, system, max_tokens, sampling, stats_file, as_json, quiet,
                rss_before_open,
            )  # fmt: skip
            return
        if chat:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": text})
            stream = session.chat(messages, max_tokens, **sampling)
        else:
            stream = session.generate(text, max_tokens, **sampling)
        # the one prompt is encoded: of the tokenizer only its decoder stays (13 MiB less
        # resident with SmolLM2's vocabulary, while the weights are, and the tokenizers
        # library's code), of the package no page before the prefill reads the weights
        # (its tokenizer section and header: 0.4 MiB), and of the libraries' code only what
        # generating runs faults back in (not the imports', open's and the tokenizer's:
        # 9 MiB less at the peak; the whole-process memory budget of issue 14)
        model.tokenizer.release_encoder()
        model.package.release_resident_pages()
        release_library_code()
        reply = _stream_out(stream, as_json)
        stats = _stats_json(session.stats, session, rss_before_open)
        if stats_file:
            Path(stats_file).write_text(json_text(stats) + "\n", encoding="utf-8")
        if as_json:
            click.echo(json_text({"text": reply, "stats": stats}))
        elif not quiet:
            click.echo(f"--\n{_stats_text(session.stats, session, rss_before_open)}", err=True)


def _stream_out(stream: Iterator[str], as_json: bool) -> str:
    """The reply, streamed to stdout as it comes (not under --json), then a newline."""
    if as_json:
        return "".join(stream)
    out = sys.stdout
    pieces = []
    for piece in stream:
        pieces.append(piece)
        out.write(piece)
        out.flush()
    out.write("\n")
    out.flush()
    return "".join(pieces)


def _converse(
    session: Session,
    system: str | None,
    max_tokens: int,
    sampling: dict[str, Any],
    stats_file: str | None,
    as_json: bool,
    quiet: bool,
    rss_before_open: int,
) -> None:
    """The -cnv loop: the whole conversation is rendered with the chat template each
    turn, so the session reuses the K/V of every earlier turn (its common prefix) and
    computes only the new one."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    turns: list[dict[str, Any]] = []
    for user in _user_turns(sys.stderr):
        messages.append({"role": "user", "content": user})
        reply = _stream_out(session.chat(messages, max_tokens, **sampling), as_json)
        messages.append({"role": "assistant", "content": reply})
        stats = _stats_json(session.stats, session, rss_before_open)
        turns.append({"user": user, "text": reply, "stats": stats})
        if not (quiet or as_json):
            st = session.stats
            click.echo(
                f"[{st.prompt_tokens} prompt tokens ({st.cached_prompt_tokens} cached), "
                f"{st.generated_tokens} generated; prefill {st.prefill_tokens_per_s:.1f} "
                f"tok/s, decode {st.decode_tokens_per_s:.1f} tok/s]",
                err=True,
            )
    if stats_file:
        document = {"turns": [t["stats"] for t in turns]}
        Path(stats_file).write_text(json_text(document) + "\n", encoding="utf-8")
    if as_json:
        click.echo(json_text({"turns": turns}))
    elif turns and not quiet:
        click.echo(f"--\n{_stats_text(session.stats, session, rss_before_open)}", err=True)


@click.command()
@click.argument("package_a", type=click.Path(exists=True, dir_okay=False))
@click.argument("package_b", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--text",
    "text_file",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="UTF-8 text to run both packages on.",
)
@click.option("--max-tokens", default=256, show_default=True, help="Tokens of the text used.")
@click.option("--kv-a", default="float", type=KV_CHOICE, show_default=True)
@click.option("--kv-b", default="float", type=KV_CHOICE, show_default=True)
@click.option("--activations-a", default="float", type=ACTIVATIONS_CHOICE, show_default=True)
@click.option("--activations-b", default="float", type=ACTIVATIONS_CHOICE, show_default=True)
@click.option(
    "--device",
    is_flag=True,
    help="Run B as a device would (int8 KV, int8 activations): --kv-b int8 --activations-b auto.",
)
@click.option(
    "--isolated",
    is_flag=True,
    help="Feed every layer of B the reference input from A (per-layer error, no accumulation).",
)
@kernels_option
@threads_option
def compare(
    package_a: str,
    package_b: str,
    text_file: str,
    max_tokens: int,
    kv_a: str,
    kv_b: str,
    activations_a: str,
    activations_b: str,
    device: bool,
    isolated: bool,
    kernels: str,
    threads: int | None,
) -> None:
    """Per-layer cosine similarity and SNR (dB) of PACKAGE_B against PACKAGE_A.

    By default both run with float activations and a float KV cache, so the figures
    measure the packages' difference (their weights); --device adds B's runtime
    approximations."""
    from edgepack.runtime_shim.compare import compare_packages
    from edgepack.runtime_shim.errors import InvalidRequestError

    if device:
        kv_b, activations_b = "int8", "auto"
    try:
        text = Path(text_file).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"--text {text_file} is not UTF-8 text ({exc.reason})") from None
    report = compare_packages(
        package_a,
        package_b,
        text,
        max_tokens=max_tokens,
        kv_a=kv_a,
        kv_b=kv_b,
        activations_a=activations_a,
        activations_b=activations_b,
        kernels=kernels_or_none(kernels),
        threads=threads,
        isolated=isolated,
    )
    record(
        a={"package": package_a, "kv": kv_a, "activations": activations_a},
        b={"package": package_b, "kv": kv_b, "activations": activations_b},
        isolated=isolated,
        **dataclasses.asdict(report),
    )
    click.echo(f"A = {package_a} (kv {kv_a}, activations {activations_a})")
    click.echo(f"B = {package_b} (kv {kv_b}, activations {activations_b})")
    click.echo(f"mode: {'isolated per layer' if isolated else 'end to end'}")
    click.echo(report.format())


COMMANDS = [run, compare]
