"""What translating to another provider costs the gateway, end to end (`python -m
benches.e2e.providers`).

One bundled mock (HTTP/2 + TLS) and one Velox (2 workers) with a VELOX_CONFIG file of two
upstreams on that mock: `oa` of kind "openai" (the pass-through path) and `claude` of kind
"anthropic" (each request translated to the Messages API, each answer back), routes `oa` and
`claude`. The client is the official openai SDK (AsyncOpenAI, its defaults: no max_tokens),
64 requests in flight over 64 connections; each round runs `oa` then `claude` (or the other
order, alternating), plain and streamed (the SDK's default stream, no include_usage, so the
gateway asks for the usage and strips it). Per run: the gateway's CPU seconds (its process tree,
/proc) per request, and requests/s. The figure is the ratio of the medians of CPU per request,
anthropic / openai (the issue's target: within 1.15). Runs under the shared benchmark lock;
the generator shares the 2 cores, as in every end-to-end run, but its CPU is not counted.

Results: benches/results/providers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from benches.e2e.machine import bench_lock, facts, tree_cpu
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

OUT = Path(__file__).resolve().parents[1] / "results" / "providers.json"
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello in a few words, please."}]
ENV = {"OA_KEY": "sk-oa-0123456789", "ANTHROPIC_KEY": "sk-ant-0123456789"}


def config(mock: MockUpstream) -> str:
    common = f'origin = "{mock.origin}"\nca_file = "{mock.ca_file}"\nconnections = 2\n'
    return (f'[[upstream]]\nname = "oa"\napi_key_env = "OA_KEY"\n{common}'
            f'[[upstream]]\nname = "claude"\nkind = "anthropic"\napi_key_env = "ANTHROPIC_KEY"\n'
            f'{common}'
            '[[route]]\nmodel = "oa"\ntargets = [{ upstream = "oa", model = "gpt-4o" }]\n'
            '[[route]]\nmodel = "claude"\n'
            'targets = [{ upstream = "claude", model = "claude-sonnet-4" }]\n')


async def load(base_url: str, model: str, stream: bool, total: int, concurrency: int) -> int:
    """`total` SDK calls, `concurrency` at once over as many connections; returns how many
    were answered in full."""
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency,
                                                 max_keepalive_connections=concurrency),
                             timeout=60)
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="sk-bench", max_retries=0,
                                http_client=http)
    left = list(range(total))
    ok = 0

    async def worker() -> None:
        nonlocal ok
        while left:
            left.pop()
            if stream:
                text = [c.choices[0].delta.content or "" async for c in
                        await client.chat.completions.create(model=model, messages=MESSAGES,
                                                             stream=True) if c.choices]
                ok += bool("".join(text))
            else:
                out = await client.chat.completions.create(model=model, messages=MESSAGES)
                ok += bool(out.choices[0].message.content)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return ok


def run(gw: GatewayProcess, model: str, stream: bool, total: int, concurrency: int
        ) -> dict[str, Any]:
    roots = [gw.pid]
    cpu0, t0 = tree_cpu(roots), time.monotonic()
    ok = asyncio.run(load(gw.base_url, model, stream, total, concurrency))
    cpu, wall = tree_cpu(roots) - cpu0, time.monotonic() - t0
    return {"model": model, "stream": stream, "requests": total, "answered": ok,
            "cpu_us_per_request": round(cpu / total * 1e6, 1), "rps": round(total / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, MockUpstream(certdir=tmp) as mock:
        path = Path(tmp) / "velox.toml"
        path.write_text(config(mock))
        env = {"VELOX_CONFIG": str(path), "VELOX_WORKERS": "2", "VELOX_RATE_LIMIT_RPM": "0",
               "VELOX_ACCESS_LOG": "0", "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}", **ENV}
        with GatewayProcess(env, log_path=Path(tmp) / "velox.log") as gw, bench_lock():
            for stream in (False, True):
                for model in ("oa", "claude"):  # warm-up: pools, caches, the lazy imports
                    run(gw, model, stream, 200, args.concurrency)
                for number in range(args.rounds):
                    order = ("oa", "claude") if number % 2 == 0 else ("claude", "oa")
                    for model in order:
                        record = run(gw, model, stream, args.requests, args.concurrency)
                        results.append({"round": number, **record})
                        print(json.dumps(results[-1]), flush=True)
    summary = {}
    for stream in (False, True):
        med = {m: statistics.median(r["cpu_us_per_request"] for r in results
                                    if r["model"] == m and r["stream"] == stream)
               for m in ("oa", "claude")}
        summary["streamed" if stream else "plain"] = {
            "openai_cpu_us_per_request": med["oa"], "anthropic_cpu_us_per_request":
            med["claude"], "ratio": round(med["claude"] / med["oa"], 3)}
    print(json.dumps(summary, indent=1))
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"machine": facts(["openai"]), "summary": summary, "runs": results},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
