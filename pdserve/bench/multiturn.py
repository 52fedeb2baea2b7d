"""Multi-turn chat: several conversations at once, each turn its whole history (earlier
messages and answers) plus a new message. Per turn: mean TTFT and the prompt tokens every
server of the layout computed, for three layouts in one run:

- `pdserve up --local-prefill-below N`: a turn whose part no decode holds is short goes to
  the decode holding its history, which computes only that part;
- `pdserve up`: every turn disaggregated; the prefill holds the earlier prompts, but not
  the answers, which it computes again (and the decode pulls what it lacks);
- `pdserve serve`: one server with prefix caching (the reference).

    pdserve bench multiturn --conversations 4 --turns 6
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from pdserve.bench.launch import free_port, launched, up_layout

COMPUTED = "pdserve_prompt_tokens_computed_total"
WORDS = ("river", "stone", "light", "garden", "winter", "letter", "market", "engine", "silver",
         "morning", "window", "harbor", "forest", "question", "answer", "little", "number",
         "station", "paper", "bridge")


@dataclass(slots=True)
class Layout:
    name: str
    argv: list[str]
    front: str  # where clients send
    servers: list[str]  # whose computed prompt tokens count
    ttft: list[list[float]] = field(default_factory=list)  # per turn, per conversation
    computed: list[float] = field(default_factory=list)  # per turn, all servers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench multiturn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--message-words", type=int, default=150,
                   help="words a turn's new message has (~1.3 tokens each)")
    p.add_argument("--answer-tokens", type=int, default=100)
    p.add_argument("--local-prefill-below", type=int, default=512)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    common = ["--dtype", args.dtype]
    layouts = [_up("up, history-aware", common + ["--local-prefill-below",
                                                  str(args.local_prefill_below)]),
               _up("up, every turn disaggregated", common),
               _serve("serve (monolithic)", common)]
    rng = random.Random(args.seed)
    messages = [[" ".join(rng.choices(WORDS, k=args.message_words))
                 for _ in range(args.turns)] for _ in range(args.conversations)]
    for layout in layouts:
        with launched(layout.argv, [layout.front, *layout.servers]), \
                httpx.Client(timeout=600) as client:
            _run(client, layout, messages, args.answer_tokens)
    print(report(layouts, args))
    print(json.dumps({lay.name: {"ttft_s": [statistics.mean(t) for t in lay.ttft],
                                 "computed": lay.computed} for lay in layouts}))
    return 0


def _up(name: str, extra: list[str]) -> Layout:
    argv, proxy, prefill, decode = up_layout(extra)
    return Layout(name, argv, proxy, [prefill, decode])


def _serve(name: str, extra: list[str]) -> Layout:
    url = f"http://127.0.0.1:{(port := free_port())}"
    return Layout(name, ["serve", "--port", str(port), *extra], url, [])


def _run(client: httpx.Client, layout: Layout, messages: list[list[str]],
         answer_tokens: int) -> None:
    servers = layout.servers or [layout.front]
    _stream(client, layout.front, "Warm-up.", 2)
    histories = ["" for _ in messages]
    with ThreadPoolExecutor(len(messages)) as pool:
        for turn in range(len(messages[0])):
            for i, conv in enumerate(messages):
                histories[i] += f"User: {conv[turn]}\nAssistant:"
            before = sum(_metric(client, s, COMPUTED) for s in servers)
            done = list(pool.map(lambda h: _stream(client, layout.front, h, answer_tokens),
                                 histories))
            layout.computed.append(sum(_metric(client, s, COMPUTED) for s in servers) - before)
            layout.ttft.append([ttft for ttft, _ in done])
            for i, (_, text) in enumerate(done):
                histories[i] += text + "\n"


def _stream(client: httpx.Client, url: str, prompt: str, max_tokens: int
            ) -> tuple[float, str]:
    """(seconds to the first streamed token, the whole answer)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start, first, text = time.perf_counter(), None, []
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            first = first or time.perf_counter() - start
            text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return first or float("nan"), "".join(text)


def _metric(client: httpx.Client, url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in
               client.get(url + "/metrics").text.splitlines() if line.startswith(name))


def report(layouts: list[Layout], args: argparse.Namespace) -> str:
    head = " | ".join(f"{lay.name}: TTFT ms / tokens computed" for lay in layouts)
    lines = [f"{args.conversations} conversations x {args.turns} turns, new messages of "
             f"{args.message_words} words, answers of {args.answer_tokens} tokens",
             f"| turn | {head} |", "|---:|" + "---:|" * len(layouts)]
    for t in range(args.turns):
        cells = " | ".join(f"{statistics.mean(lay.ttft[t]) * 1e3:.0f} / {lay.computed[t]:.0f}"
                           for lay in layouts)
        lines.append(f"| {t + 1} | {cells} |")
    totals = " | ".join(f"{sum(map(statistics.mean, lay.ttft)) / args.turns * 1e3:.0f} / "
                        f"{sum(lay.computed):.0f}" for lay in layouts)
    lines.append(f"| all (mean TTFT / sum) | {totals} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
