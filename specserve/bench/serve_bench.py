"""``specserve bench-serve``: load on OpenAI-compatible servers at 127.0.0.1 at fixed concurrencies.

For each server (running already, ``--server LABEL=URL``, or started here one after the other,
``--configs none,medusa-tree-dynamic``: ``specserve serve`` in a subprocess per speculative configuration) and
each concurrency, ``concurrency`` clients send streamed chat requests (temperature 0) back to back
until ``--num-requests`` have finished. Reported per row: output tokens/s (tokens delivered / wall time
of the level), time to first token, inter-token latency ((last token - first token) / (tokens - 1) per
request) and end-to-end latency, each as p50 / p90 / p99 over the level's requests; a PNG plots
throughput and latency against concurrency."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from specserve.bench.harness import PRESETS, load_prompts

class BenchServeError(ValueError):
    pass


@dataclass
class Row:
    server: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_ms: tuple[float, float, float]
    itl_ms: tuple[float, float, float]
    e2e_s: tuple[float, float, float]
    errors: int


def percentiles(xs: list[float], qs=(50, 90, 99)) -> tuple[float, ...]:
    """Nearest-rank percentiles (0.0 for no values)."""
    if not xs:
        return tuple(0.0 for _ in qs)
    s = sorted(xs)
    return tuple(s[min(len(s) - 1, max(0, -(-q * len(s) // 100) - 1))] for q in qs)


def parse_configs(spec: str) -> list[tuple[str, dict | None]]:
    """``none,medusa-tree-dynamic`` or ``fast={"method": "ngram"}`` entries (';' separates JSON entries)."""
    out = []
    for part in [p.strip() for p in (spec.split(";") if "{" in spec else spec.split(",")) if p.strip()]:
        if "=" in part:
            label, js = part.split("=", 1)
            try:
                cfg = json.loads(js)
            except ValueError:
                raise BenchServeError(f"--configs: {label}: not valid JSON: {js!r}") from None
            out.append((label.strip(), cfg))
        elif part in PRESETS:
            out.append((part, PRESETS[part]))
        else:
            raise BenchServeError(f"--configs: unknown configuration {part!r}; known: {', '.join(PRESETS)} "
                                  "(or LABEL={json speculative_config})")
    return out


# ---- one level ---------------------------------------------------------------------------------
async def _one(h, url: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> tuple:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with h.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise BenchServeError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise BenchServeError(chunk["error"].get("message", "error"))
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    end = time.perf_counter()
    first = first or end
    last = last or end
    return first - t0, (last - first) / (tokens - 1) if tokens > 1 else None, end - t0, tokens


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                    max_tokens: int, ignore_eos: bool, api_key: str | None, label: str) -> Row:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results, errors = [], 0
    counter = iter(range(num_requests))

    async def worker(h):
        nonlocal errors
        for i in counter:
            try:
                results.append(await _one(h, url, model, prompts[i % len(prompts)], max_tokens, ignore_eos))
            except (BenchServeError, httpx.HTTPError):
                errors += 1

    async with httpx.AsyncClient(timeout=600, headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as h:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(h) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r[3] for r in results)
    return Row(label, concurrency, len(results), tokens, wall, tokens / wall if wall > 0 else 0.0,
               tuple(1000 * x for x in percentiles([r[0] for r in results])),
               tuple(1000 * x for x in percentiles([r[1] for r in results if r[1] is not None])),
               percentiles([r[2] for r in results]), errors)


def server_model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# ---- servers started here ----------------------------------------------------------------------
class LaunchedServer:
    """``specserve serve --port 0`` in a subprocess with one speculative configuration."""

    def __init__(self, spec: dict | None, serve_args: list[str], log=print):
        cmd = [sys.executable, "-m", "specserve", "serve", "--port", "0", *serve_args]
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
        self.url = None
        for line in self.proc.stdout:
            m = re.search(r"at (http://[^ ]+)/v1", line)
            self.url = self.url or (m and m.group(1))
            if line.strip() == "[specserve] ready":
                break
        if self.url is None or self.proc.poll() is not None:
            self.stop()
            raise BenchServeError(f"the server did not start: {shlex.join(cmd[1:])}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- report ------------------------------------------------------------------------------------
def format_table(rows: list[Row]) -> str:
    def trio(t, fmt):
        return " / ".join(fmt.format(x) for x in t)

    lines = ["| concurrency | server | requests | output tok/s | TTFT ms p50/p90/p99 | ITL ms p50/p90/p99 "
             "| e2e s p50/p90/p99 | errors |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r.concurrency, [x.server for x in rows].index(r.server))):
        lines.append(f"| {r.concurrency} | {r.server} | {r.requests} | {r.output_tok_s:.1f} | "
                     f"{trio(r.ttft_ms, '{:.0f}')} | {trio(r.itl_ms, '{:.1f}')} | {trio(r.e2e_s, '{:.2f}')} | "
                     f"{r.errors} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    servers = list(dict.fromkeys(r.server for r in rows))
    panels = [("output tokens/s", lambda r: (r.output_tok_s,)), ("TTFT ms (p50, p99 dashed)", lambda r: r.ttft_ms),
              ("inter-token latency ms (p50, p99 dashed)", lambda r: r.itl_ms),
              ("end-to-end latency s (p50, p99 dashed)", lambda r: r.e2e_s)]
    for ax, (name, get) in zip(axes, panels):
        for k, s in enumerate(servers):
            rs = sorted((r for r in rows if r.server == s), key=lambda r: r.concurrency)
            xs = [r.concurrency for r in rs]
            color = f"C{k}"
            ax.plot(xs, [get(r)[0] for r in rs], "o-", color=color, label=s)
            if len(get(rs[0])) == 3:
                ax.plot(xs, [get(r)[2] for r in rs], "--", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.concurrency for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent clients")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(servers: list[tuple[str, str]], configs: list[tuple[str, dict | None]], concurrencies: list[int],
        num_requests: int, max_tokens: int, prompts: list[str], serve_args: list[str], api_key: str | None,
        ignore_eos: bool, log=print) -> list[Row]:
    """Every server, every concurrency; servers of ``configs`` are started (and stopped) one at a time."""
    rows = []

    def bench(label: str, url: str) -> None:
        model = server_model(url, api_key)
        asyncio.run(run_level(url, model, prompts, 1, 1, max_tokens, ignore_eos, api_key, label))  # warm-up
        for c in concurrencies:
            row = asyncio.run(run_level(url, model, prompts, c, max(num_requests, c), max_tokens, ignore_eos,
                                        api_key, label))
            log(f"[bench-serve] {label} concurrency {c}: {row.output_tok_s:.1f} tok/s, {row.requests} requests, "
                f"{row.errors} errors")
            rows.append(row)

    for label, url in servers:
        bench(label, url.rstrip("/").removesuffix("/v1"))
    for label, spec in configs:
        log(f"[bench-serve] starting a server: {label}")
        srv = LaunchedServer(spec, serve_args)
        try:
            bench(label, srv.url)
        finally:
            srv.stop()
    return rows


def write_json(rows: list[Row], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=1)


def main(args) -> int:
    """``specserve bench-serve`` (its flags: ``entrypoints/cli.py``)."""
    servers = []
    for s in args.server:
        label, sep, url = s.partition("=")
        if not sep or not url.startswith("http"):
            raise BenchServeError(f"--server: expected LABEL=URL (e.g. plain=http://127.0.0.1:8000), got {s!r}")
        servers.append((label, url))
    default = "" if servers else "none,medusa-tree-dynamic"
    configs = parse_configs(args.configs if args.configs is not None else default)
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        raise BenchServeError(f"--concurrency: expected a comma list of integers, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1:
        raise BenchServeError(f"--concurrency: levels must be >= 1, got {args.concurrency!r}")
    rows = run(servers, configs, levels, args.num_requests, args.max_tokens, load_prompts(args.prompts),
               shlex.split(args.serve_args), args.api_key, args.ignore_eos,
               log=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"streamed chat requests, temperature 0, max {args.max_tokens} tokens, {args.num_requests} requests per "
          "level; ITL = (last token - first token) / (tokens - 1) per request")
    print(format_table(rows), flush=True)
    plot(rows, args.out, f"specserve bench-serve: max {args.max_tokens} tokens, {args.num_requests} requests/level")
    print(f"wrote {args.out}")
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 0
