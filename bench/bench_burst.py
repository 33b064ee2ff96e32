"""A burst of simultaneous requests against one API process.

Starts ``torchyard serve`` (one uvicorn process; SQLite in a temporary data directory
unless ``--database-url`` names a PostgreSQL database), then fires N authenticated
requests at once (asyncio + httpx in this process) and prints, per round, the status
codes, the wall time of the whole burst and the per-request latency percentiles.

N larger than the threadpool (40) and the connection pool is the interesting case:
it is where a session held across the response's validation used to deadlock the
process until the pool timed out.

Usage::

    python bench/bench_burst.py                      # 200 x GET /v1/jobs, 3 rounds, SQLite
    python bench/bench_burst.py --requests 500 --path /v1/cluster
    python bench/bench_burst.py --database-url postgresql+psycopg://postgres@127.0.0.1:5432/DB
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from collections import Counter

import httpx
from bench_followers import Service


async def burst(url: str, token: str, path: str, n: int) -> tuple[Counter[str], list[float], float]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=300, limits=limits
    ) as client:

        async def one() -> tuple[str, float]:
            start = time.perf_counter()
            try:
                response = await client.get(path)
                outcome = str(response.status_code)
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            return outcome, time.perf_counter() - start

        start = time.perf_counter()
        results = await asyncio.gather(*[one() for _ in range(n)])
        wall = time.perf_counter() - start
    return Counter(code for code, _ in results), sorted(t for _, t in results), wall


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--path", default="/v1/jobs")
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()

    service = Service(args.database_url)  # `torchyard serve` in a temporary data directory
    try:
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
        print(
            f"database: {'PostgreSQL' if args.database_url else 'SQLite'}; {args.requests} x GET {args.path}"
        )
        print("| round | status codes | burst wall time | p50 | p99 | max |")
        print("| --- | --- | --- | --- | --- | --- |")
        for round_ in range(1, args.rounds + 1):
            codes, latencies, wall = asyncio.run(
                burst(service.url, service.admin_token, args.path, args.requests)
            )
            shown = ", ".join(f"{code}: {count}" for code, count in sorted(codes.items()))
            print(
                f"| {round_} | {shown} | {wall:.2f} s | {statistics.median(latencies):.2f} s "
                f"| {percentile(latencies, 0.99):.2f} s | {latencies[-1]:.2f} s |"
            )
    finally:
        service.stop()


if __name__ == "__main__":
    main()
