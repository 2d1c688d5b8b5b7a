"""CPU milliseconds the toolbox agent spends building its `openai.OpenAI` client, in a process warmed up the way the
warm launcher's server is (`gyre.actors.executions.sdk_warmup:openai_client`): the SDK's default HTTP client against
`examples/toolbox/agent.py: plain_http_client` for a plain-http endpoint.

    python benchmarks/studies/agent_client_cost.py --clients 50

Every forked agent builds one client, so this is paid once per agent run. Prints one JSON line with the median
milliseconds of each way over `--clients` builds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from pathlib import Path

TOOLBOX = Path(__file__).resolve().parents[2] / "examples" / "toolbox"
BASE_URL = "http://127.0.0.1:9/v1"


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=50, help="clients built each way")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TOOLBOX))
    import openai
    from agent import plain_http_client

    from gyre.actors.executions.sdk_warmup import openai_client

    openai_client()
    costs: dict[str, list[float]] = {"default": [], "plain_http": []}
    for _ in range(args.clients):
        for way in costs:
            before = cpu_s()
            client = openai.OpenAI(base_url=BASE_URL, api_key="k", max_retries=0,
                                   http_client=plain_http_client(BASE_URL) if way == "plain_http" else None)
            costs[way].append((cpu_s() - before) * 1000)
            client.close()
    default, plain = statistics.median(costs["default"]), statistics.median(costs["plain_http"])
    print(json.dumps({"clients": args.clients, "default_cpu_ms": round(default, 2),
                      "plain_http_cpu_ms": round(plain, 2), "default_over_plain": round(default / plain, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
