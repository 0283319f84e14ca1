"""``kvroute sim``: N simulated vLLM replicas on ports BASE..BASE+N-1, in one process (each with
``--data-parallel-size`` engine ranks)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated, Any

import typer

from kvroute.event_loop import run_event_loop
from kvroute.fleet.kv_event_wire import ENCODINGS, KVEventsConfig, parse_kv_events_config
from kvroute.log_setup import setup_logging
from kvroute.sim.faults import Fault
from kvroute.sim.presets import PRESETS
from kvroute.startup import fail, host_port, listen_error


def _cost_overrides(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            fail("sim", f"--cost: expected NAME=NUMBER, got {item!r}")
    return out


async def _serve(preset: str, replicas: int, host: str, port: int, speed: float, model: str | None,
                 faults: list[Fault], overrides: dict[str, Any]) -> None:
    from kvroute.sim.server import start_sim_fleet

    fleet = await start_sim_fleet(preset, replicas, host=host, base_port=port, speed=speed, model=model,
                                  **overrides)
    for replica in fleet.replicas:
        for fault in faults:
            replica.faults.set(fault)
    try:
        cfg = fleet.replicas[0].config
        dp = fleet.replicas[0].data_parallel_size
        ranks = f" (data_parallel_size={dp})" if dp > 1 else ""
        typer.echo(
            f"kvroute sim: {replicas} x {preset}{ranks} serving {cfg.model!r} (block_size={cfg.block_size}, "
            f"num_gpu_blocks={cfg.num_gpu_blocks}, max_num_seqs={cfg.max_num_seqs}, "
            f"enable_prefix_caching={cfg.enable_prefix_caching}, speed={speed})"
        )
        for url in fleet.urls:
            typer.echo(f"  {url}")
        for replica in fleet.replicas:
            for rank in replica.ranks:
                if rank.kv_publisher is not None:
                    info = rank.kv_publisher.describe()
                    replay = f", replay {info['replay_endpoint']}" if info["replay_endpoint"] else ""
                    of = f"replica {replica.index} rank {rank.index}" if replica.data_parallel_size > 1 \
                        else f"rank {replica.index}"
                    typer.echo(f"  kv events of {of}: {info['endpoint']}{replay} "
                               f"({info['encoding']}, topic {info['topic']!r})")
        await asyncio.Event().wait()
    finally:
        await fleet.close()


def sim(
    preset: Annotated[str, typer.Option(help=f"Engine preset: {', '.join(PRESETS)}.")] = "a4000-qwen3-4b",
    replicas: Annotated[int, typer.Option(min=1, help="Number of replicas.")] = 1,
    data_parallel_size: Annotated[int, typer.Option(
        "--data-parallel-size", min=1,
        help="Engine ranks behind each replica's server, each with its own KV cache (vLLM's flag; "
             "the header X-data-parallel-rank pins one).")] = 1,
    port: Annotated[int, typer.Option(help="First port (replica i: PORT+i; 0: free).")] = 8100,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    speed: Annotated[float, typer.Option(min=0.001, help="Model seconds per wall second.")] = 1.0,
    served_model_name: Annotated[str | None, typer.Option(help="Model name to serve.")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(help="Most sequences running at once.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Context length limit.")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(help="Token budget per step.")] = None,
    block_size: Annotated[int | None, typer.Option(help="Tokens per KV block.")] = None,
    num_gpu_blocks_override: Annotated[int | None, typer.Option(help="KV blocks (default: memory).")] = None,
    enable_prefix_caching: Annotated[bool | None, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching", help="Prefix caching.")] = None,
    enable_chunked_prefill: Annotated[bool | None, typer.Option(
        "--enable-chunked-prefill/--no-enable-chunked-prefill", help="Chunked prefill.")] = None,
    mamba_cache_mode: Annotated[str | None, typer.Option(help="Hybrid models: none or align.")] = None,
    prefix_match_unit: Annotated[int | None, typer.Option(help="Finest hit boundary (tokens).")] = None,
    kv_cache_dtype: Annotated[str | None, typer.Option(help="auto or fp8.")] = None,
    mamba_cache_blocks: Annotated[int | None, typer.Option(help="Mamba state slots (hybrid).")] = None,
    answer_mode: Annotated[bool, typer.Option(
        "--answer-mode/--no-answer-mode",
        help="Answer a trailing arithmetic question exactly, as a model would (kvroute canary "
             "checks the answers); off: filler words only.")] = True,
    corrupt_rate: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of bad replies.")] = 0.0,
    output_tokens_min: Annotated[int | None, typer.Option(help="Shortest natural reply (tokens).")] = None,
    output_tokens_max: Annotated[int | None, typer.Option(help="Longest natural reply (tokens).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of fault and corruption draws.")] = 0,
    fault: Annotated[list[str] | None, typer.Option(
        help="Fault KIND[:RATE] (error, hang, drop, corrupt; slow:FACTOR).")] = None,
    cost: Annotated[list[str] | None, typer.Option(
        help="Cost parameter NAME=VALUE (a, b, c, d0, d1, d_kv, ...).")] = None,
    kv_events_config: Annotated[str | None, typer.Option(
        help="vLLM's KV-event publishing, as JSON: enable_kv_cache_events, publisher, endpoint, "
             "replay_endpoint, topic, buffer_steps, hwm, max_queue_size (replica i's rank r: ports + "
             "i * data-parallel-size + r).")] = None,
    kv_events_encoding: Annotated[str, typer.Option(
        help="KV events as the newest vLLM sends them (map: events tagged 'type', replay with the "
             "topic) or as older vLLM (array).")] = "map",
    tokenizer: Annotated[str | None, typer.Option(
        help="A model's folder (tokenizer.json and its chat template) to render and tokenize "
             "prompts with, as vLLM does, instead of the simulator's 4-bytes-a-token "
             "pseudo-tokenizer: a router with the same folder as its per-model setting "
             "'tokenizer' predicts the replicas' caches exactly (needs kvroute[tokenizer]).")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error.")] = "info",
    log_format: Annotated[str, typer.Option(help="text or json (one JSON object a line).")] = "text",
) -> None:
    """Run simulated vLLM replicas whose latency and counters behave like vLLM with prefix caching."""
    try:
        setup_logging(log_level, log_format)
    except ValueError as exc:
        fail("sim", str(exc))
    named = {
        "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
        "max_num_batched_tokens": max_num_batched_tokens, "block_size": block_size,
        "num_gpu_blocks_override": num_gpu_blocks_override, "enable_prefix_caching": enable_prefix_caching,
        "enable_chunked_prefill": enable_chunked_prefill, "mamba_cache_mode": mamba_cache_mode,
        "prefix_match_unit": prefix_match_unit, "kv_cache_dtype": kv_cache_dtype,
        "mamba_cache_blocks": mamba_cache_blocks, "output_tokens_min": output_tokens_min,
        "output_tokens_max": output_tokens_max,
    }
    overrides: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
    overrides.update(answer_mode=answer_mode, corrupt_rate=corrupt_rate, seed=seed,
                     data_parallel_size=data_parallel_size)
    overrides.update(_cost_overrides(cost or []))
    if tokenizer is not None:
        from kvroute.api.tokenizer_settings import EXTRA, extra_missing

        if (missing := extra_missing()) is not None:
            fail("sim", f"--tokenizer needs {missing}: {EXTRA}")
        overrides["tokenizer"] = tokenizer
    try:
        faults = [Fault.from_flag(text) for text in fault or []]
    except ValueError as exc:
        fail("sim", f"--fault: {exc}")
    if kv_events_encoding not in ENCODINGS:
        fail("sim", f"--kv-events-encoding: choose one of {', '.join(ENCODINGS)}")
    if kv_events_config is not None:
        try:
            events: KVEventsConfig = parse_kv_events_config(kv_events_config)
        except ValueError as exc:
            fail("sim", str(exc))
        overrides.update(kv_events=events, kv_events_encoding=kv_events_encoding)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            run_event_loop(_serve(preset, replicas, host, port, speed, served_model_name, faults, overrides))
    except OSError as exc:
        ports = str(port) if replicas == 1 or not port else f"{port}-{port + replicas - 1}"
        fail("sim", listen_error(host_port(host, ports), exc), code=1)
    except (ValueError, TypeError, KeyError) as exc:
        fail("sim", str(exc.args[0] if exc.args else exc))
