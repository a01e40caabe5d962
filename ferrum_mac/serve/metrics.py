"""The scheduler's counters in the Prometheus text format."""

from __future__ import annotations

from ferrum_mac.grammar import engine as grammar_engine
from ferrum_mac.grammar.guard import GuardStats
from ferrum_mac.llm import PrefixStats
from ferrum_mac.serve.batching.scheduler import SchedulerStats


def prometheus_text(stats: SchedulerStats, up: bool = True) -> str:
    """`up`: whether the scheduler's loop runs (0 means nothing will be generated: restart)."""
    lines = [
        *metric("ferrum_scheduler_up", "gauge", "1 while the scheduler loop runs, 0 once it has stopped.", int(up)),
        "# HELP ferrum_requests_total Requests finished, by how they ended.",
        "# TYPE ferrum_requests_total counter",
    ]
    lines += [f'ferrum_requests_total{{reason="{reason}"}} {n}' for reason, n in sorted(stats.requests.items())]
    lines += [
        *metric("ferrum_prompt_tokens_total", "counter", "Prompt tokens admitted.", stats.prompt_tokens),
        *metric("ferrum_generation_tokens_total", "counter", "Tokens generated.", stats.generated_tokens),
        *metric("ferrum_active_sequences", "gauge", "Sequences being prefilled or decoded.", stats.active),
        *metric("ferrum_waiting_requests", "gauge", "Requests queued for admission.", stats.waiting),
        *metric(
            "ferrum_kv_tokens_in_use", "gauge", "Tokens held in the KV caches of active sequences.", stats.kv_tokens
        ),
        *metric(
            "ferrum_kv_tokens_allocated",
            "gauge",
            "Token positions the KV buffers hold, used or not.",
            stats.kv_tokens_allocated,
        ),
        *metric("ferrum_kv_tokens_used", "gauge", "Tokens cached in the KV buffers.", stats.kv_tokens_used),
        *metric("ferrum_scheduler_steps_total", "counter", "Forward steps run.", stats.steps),
        *metric(
            "ferrum_speculation_proposed_tokens_total",
            "counter",
            "Guessed tokens verified (speculative decoding).",
            stats.proposed_tokens,
        ),
        *metric(
            "ferrum_speculation_accepted_tokens_total",
            "counter",
            "Guessed tokens kept: the sampler drew them too.",
            stats.accepted_tokens,
        ),
    ]
    if stats.prefix is not None:
        lines += prefix_cache_lines(stats.prefix)
    return "\n".join(lines) + "\n"


def prefix_cache_lines(p: PrefixStats) -> list[str]:
    """The model's prefix cache counters (absent when it keeps none)."""
    lines = [
        *metric("ferrum_prefix_lookups_total", "counter", "Prompts looked up in the prefix cache.", p.lookups),
        *metric("ferrum_prefix_hits_total", "counter", "Lookups that reused at least one cached token.", p.hits),
        *metric("ferrum_prefix_reused_tokens_total", "counter", "Prompt tokens taken from the cache.", p.reused_tokens),
        *metric(
            "ferrum_prefix_missed_tokens_total",
            "counter",
            "Prompt tokens the lookups left to compute.",
            p.missed_tokens,
        ),
        "# HELP ferrum_prefix_misses_total Lookups that stopped short of the prompt, by why.",
        "# TYPE ferrum_prefix_misses_total counter",
    ]
    lines += [f'ferrum_prefix_misses_total{{reason="{reason}"}} {n}' for reason, n in sorted(p.misses.items())]
    lines += [
        *metric("ferrum_prefix_cached_tokens", "gauge", "Tokens the prefix cache holds.", p.cached_tokens),
        *metric("ferrum_prefix_evicted_blocks_total", "counter", "KV blocks evicted from the cache.", p.evicted_blocks),
        *metric(
            "ferrum_prefix_disk_written_bytes_total",
            "counter",
            "Bytes of KV blocks written to disk.",
            p.disk_bytes_written,
        ),
        *metric(
            "ferrum_prefix_disk_read_bytes_total", "counter", "Bytes of KV blocks read from disk.", p.disk_bytes_read
        ),
        *metric(
            "ferrum_prefix_disk_loaded_tokens_total",
            "counter",
            "Prompt tokens loaded from disk instead of computed.",
            p.disk_tokens_loaded,
        ),
    ]
    return lines


def grammar_lines(checks: GuardStats) -> str:
    """What compiling grammars has cost: the bounded checks of new ones (`grammar.guard`), and
    the compiles in this process (each grammar once per model while it stays cached)."""
    compiles = grammar_engine.STATS
    lines = [
        "# HELP ferrum_grammar_checks_total Grammars checked before compiling, by outcome.",
        "# TYPE ferrum_grammar_checks_total counter",
    ]
    lines += [f'ferrum_grammar_checks_total{{outcome="{outcome}"}} {n}' for outcome, n in sorted(checks.checks.items())]
    lines += [
        *metric(
            "ferrum_grammar_check_seconds_total",
            "counter",
            "Seconds spent checking grammars.",
            round(checks.seconds, 6),
        ),
        *metric("ferrum_grammar_compiles_total", "counter", "Grammars compiled for a model.", compiles.compiled),
        *metric(
            "ferrum_grammar_compile_cache_hits_total",
            "counter",
            "Grammars a model had compiled already.",
            compiles.cached,
        ),
        *metric(
            "ferrum_grammar_compile_seconds_total",
            "counter",
            "Seconds spent compiling grammars for models.",
            round(compiles.seconds, 6),
        ),
    ]
    return "\n".join(lines) + "\n"


def metric(name: str, kind: str, help_text: str, value) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
