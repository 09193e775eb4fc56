"""The streaming clients of bench_server.py (not a test): one process runs a group of them, so that the
clients' own Python work (the official `openai` client builds each request and parses every chunk) runs
beside the server's in several processes, as independent users' would, instead of queueing in one event
loop and showing up as the server's latency.

    python3 benchmarks/http_clients.py URL CLIENTS REQUESTS PROMPT_LEN MAX_TOKENS VOCAB ADAPTERS

CLIENTS: the clients' numbers, comma-separated (client i uses adapter a{i % ADAPTERS} and sends the prompts
client_prompt(i, r)). Each client first sends one warm-up request (prompt r = REQUESTS), so that the measured
requests find the process's client warm, as a long-running user's is: its connection open, the `openai` and
`httpx` code paths of a request already run once (a fresh process's first request took up to ~200 ms longer,
which desynchronized whole groups of clients for the rest of the run). Then the process prints "ready",
starts on a line from stdin (so that every group starts together), and prints one JSON object: its start and
end (time.perf_counter, one clock for every process of the machine) and per request (seconds to the first
token, arrival time of every token).
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import openai


def client_prompt(i: int, r: int, prompt_len: int, vocab: int) -> list[int]:
    """Client i's r-th prompt."""
    return [(7 * i + 13 * r + j) % (vocab - 1) + 1 for j in range(prompt_len)]


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(seconds to the first token, arrival time of every token). logprobs=0 makes the server send a
    chunk for every token: dummy weights mostly pick ids past the tiny tokenizer's vocabulary, which
    decode to no text, and text-less chunks are otherwise skipped."""
    t0 = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             stream=True, logprobs=0, extra_body={"ignore_eos": True})
    arrivals = []
    async for chunk in stream:
        for choice in chunk.choices:
            tokens = choice.logprobs.tokens if choice.logprobs and choice.logprobs.tokens else []
            arrivals += [time.perf_counter()] * len(tokens)
    return arrivals[0] - t0, arrivals


async def run_group(client: openai.AsyncOpenAI, clients: list[int], rounds: range, prompt_len: int, max_tokens: int,
                    vocab: int, adapters: int) -> list[tuple[float, list[float]]]:
    """Each client sends its prompts of `rounds` one after the other; the clients run concurrently."""
    async def client_loop(i: int) -> list[tuple[float, list[float]]]:
        return [await one_request(client, f"a{i % adapters}", client_prompt(i, r, prompt_len, vocab), max_tokens)
                for r in rounds]

    return [r for rs in await asyncio.gather(*(client_loop(i) for i in clients)) for r in rs]


async def serve_group(url: str, clients: list[int], requests: int, *work: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    await run_group(client, clients, range(requests, requests + 1), *work)  # warm-up
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    start = time.perf_counter()
    results = await run_group(client, clients, range(requests), *work)
    end = time.perf_counter()
    await client.close()
    return dict(start=start, end=end, results=results)


def main() -> None:
    url, clients, *work = sys.argv[1:]
    print(json.dumps(asyncio.run(serve_group(url, [int(i) for i in clients.split(",")], *map(int, work)))), flush=True)


if __name__ == "__main__":
    main()
