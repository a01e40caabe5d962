"""`ferrum bench`: prefill and decode speed beside a peer (`ferrum bench [MODEL] --shape ...`), and
its subcommands `turns` (time to first token with the KV cache reused), `first-token` (a cold
`ferrum run` up to its first byte) and `prefix` (the prefix cache against cold prompts). Each imports its implementation only when it runs."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from ferrum_mac.bench.shapes import SHAPES  # the names for `bench --help`; it imports nothing heavy
from ferrum_mac.cli.options import Device


class BenchGroup(TyperGroup):
    """A group whose own command takes an optional MODEL: click would read `turns` in `ferrum bench
    turns` as that MODEL, so when the first word names a subcommand the group goes without it."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        ctx.meta[SUBCOMMAND_FIRST] = bool(args) and args[0] in self.commands
        if not ctx.meta[SUBCOMMAND_FIRST]:
            ctx.allow_interspersed_args = True  # `ferrum bench MODEL --runs 1`: options after MODEL, as before
        rest = super().parse_args(ctx, args)
        ctx.params.setdefault("model", None)
        return rest

    def get_params(self, ctx: typer.Context) -> list:
        params = super().get_params(ctx)
        if ctx.meta.get(SUBCOMMAND_FIRST):  # (the subcommand's usage line reads them too)
            return [p for p in params if p.param_type_name != "argument"]
        return params


SUBCOMMAND_FIRST = "ferrum.bench.subcommand_first"


bench_app = typer.Typer(
    cls=BenchGroup,
    invoke_without_command=True,
    subcommand_metavar="[turns|first-token|prefix [ARGS]...]",
    rich_markup_mode=None,
)


@bench_app.callback()
def speed(
    ctx: typer.Context,
    model: Annotated[
        Optional[str], typer.Argument(metavar="MODEL", help="Model folder, .gguf file or name (omit with --shape).")
    ] = None,
    shape: Annotated[Optional[str], typer.Option(help=f"Random weights of a real shape: {', '.join(SHAPES)}.")] = None,
    quant: Annotated[
        str, typer.Option(help="With --shape: bf16 or 4bit; with --backend torch also 8bit, and a MODEL's weights.")
    ] = "bf16",
    prompt_tokens: Annotated[int, typer.Option("--prompt-tokens", help="Prompt length for prefill.")] = 512,
    new_tokens: Annotated[int, typer.Option("--new-tokens", help="Tokens to decode.")] = 128,
    runs: Annotated[int, typer.Option(help="Timed runs per side, alternating; the best is reported.")] = 5,
    peer: Annotated[bool, typer.Option(help="Also run mlx-lm on the same weights.")] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    batch: Annotated[int, typer.Option(help="Also time decode_batch over this many sequences (aggregate tok/s).")] = 0,
    backend: Annotated[
        str, typer.Option(help="mlx (beside mlx-lm) or torch (beside transformers, with the roofline).")
    ] = "auto",
    device: Device = None,
) -> None:
    """Prefill and decode speed, time to first token and peak memory, beside mlx-lm (or transformers).
    `ferrum bench turns` and `ferrum bench first-token` measure a chat's turns and a cold start."""
    if ctx.invoked_subcommand is not None:
        given = [name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"]
        if given:  # `ferrum bench MODEL turns`, `ferrum bench --runs 3 turns`: they would be ignored
            raise typer.BadParameter(
                f"{ctx.invoked_subcommand} comes first, then its own arguments: "
                f"`ferrum bench {ctx.invoked_subcommand} --help` lists them",
                ctx=ctx,
            )
        return
    from ferrum_mac.bench import run_bench

    run_bench(
        model=model,
        shape=shape,
        quant=quant,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        runs=runs,
        peer=peer,
        json_out=json_out,
        batch=batch,
        backend=backend,
        device=device,
    )


@bench_app.command()
def turns(
    model: Annotated[
        Optional[str], typer.Argument(metavar="MODEL", help="Model to open (default $FERRUM_MODEL or smollm2:135m).")
    ] = None,
    turns: Annotated[int, typer.Option(help="The turn timed: the conversation holds the turns before it.")] = 20,
    answer_tokens: Annotated[int, typer.Option("--answer-tokens", help="Most tokens in each earlier answer.")] = 24,
    runs: Annotated[int, typer.Option(help="Timed runs per side; the best is reported.")] = 3,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a line.")] = False,
) -> None:
    """Time to first token at turn N reusing the conversation's KV cache, beside re-prefilling its history."""
    from ferrum_mac.bench.turns import run_turns

    run_turns(model, turns, answer_tokens, runs, json_out)


@bench_app.command(
    "first-token",
    # everything after the first word that is not --runs goes to `ferrum run`, its options included
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
def first_token(
    run_args: Annotated[
        Optional[list[str]],
        typer.Argument(
            metavar="RUN_ARGS", help="Arguments of `ferrum run` (default: hi); put -- before them to pass -h."
        ),
    ] = None,
    runs: Annotated[int, typer.Option(help="Timed starts; the best and the median are reported.")] = 5,
) -> None:
    """Time from process start to the first byte of `ferrum run`'s answer, the model already on disk."""
    from ferrum_mac.bench.first_token import run_first_token

    run_first_token(run_args or ["hi"], runs)


@bench_app.command()
def prefix(
    model: Annotated[
        Optional[str],
        typer.Option(help="Model to open (default $FERRUM_MODEL or smollm2:135m; not with --shape)."),
    ] = None,
    shape: Annotated[Optional[str], typer.Option(help=f"Random weights of a real shape: {', '.join(SHAPES)}.")] = None,
    quant: Annotated[str, typer.Option(help="With --shape: bf16 or 4bit (mlx).")] = "bf16",
    backend: Annotated[str, typer.Option(help="auto, mlx or torch.")] = "auto",
    device: Device = None,
    conversation_tokens: Annotated[int, typer.Option(help="(a), (b): the conversation sent again.")] = 1500,
    last_message_tokens: Annotated[int, typer.Option(help="(a), (b): its last message, which changes.")] = 40,
    steps: Annotated[int, typer.Option(help="(c): requests in the agent replay.")] = 20,
    step_tokens: Annotated[int, typer.Option(help="(c): new tokens each step adds (the issue's goal: 300).")] = 100,
    answer_tokens: Annotated[int, typer.Option(help="(c), (d): tokens in each answer.")] = 16,
    shared_tokens: Annotated[
        int, typer.Option(help="(d): the system prompt the requests share (the issue's goal: 4000).")
    ] = 1000,
    requests: Annotated[int, typer.Option(help="(d): requests sent together.")] = 16,
    own_tokens: Annotated[int, typer.Option(help="(d): each request's own message.")] = 64,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of lines.")] = False,
) -> None:
    """The prefix cache beside cold prompts: (a) a conversation sent again, (b) after a restart,
    (c) an agent replay, (d) concurrent requests sharing a system prompt, each with its goal."""
    from ferrum_mac.bench.prefix import PrefixBenchSizes, run_prefix

    sizes = PrefixBenchSizes(
        conversation_tokens=conversation_tokens,
        last_message_tokens=last_message_tokens,
        steps=steps,
        step_tokens=step_tokens,
        answer_tokens=answer_tokens,
        shared_tokens=shared_tokens,
        requests=requests,
        own_tokens=own_tokens,
    )
    run_prefix(model, shape, quant, backend, device, sizes, json_out)
