"""What the probe sends: the mix scenario's seeded request plan and the request bodies."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

WORDS = ("river", "lamp", "orbit", "violin", "granite", "maple", "comet", "harbor", "pixel", "tundra", "saffron")
STOPS: tuple[list[str] | None, ...] = (None, None, ["\n"], [".", "!"], [" the"], ["and"])


def scaled(count: int, scale: float) -> int:
    return max(1, round(count * scale))


@dataclass(frozen=True)
class MixSpec:
    chat: bool
    stream: bool
    n: int
    max_tokens: int
    temperature: float
    seed: int | None
    stop: list[str] | None
    ignore_eos: bool
    close_after: int | None  # content chunks after which we drop the stream
    prompt: str


def mix_plan(count: int, seed: int, close_fraction: float = 0.12) -> list[MixSpec]:
    """The mix scenario's requests: every one valid; a share of the streams is cut by the client."""
    rng = random.Random(seed)
    plan = []
    for i in range(count):
        stream, chat = rng.random() < 0.5, rng.random() < 0.5
        close = stream and rng.random() < close_fraction
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        plan.append(MixSpec(
            chat=chat, stream=stream, n=rng.randint(1, 3),
            # A stream we cut gets room to still be running when we cut it.
            max_tokens=rng.randint(24, 48) if close else rng.randint(1, 32),
            temperature=rng.choice((0.0, 0.7, 1.0)), seed=rng.randrange(2**31) if rng.random() < 0.5 else None,
            stop=rng.choice(STOPS), ignore_eos=close or rng.random() < 0.3,
            close_after=rng.randint(1, 4) if close else None, prompt=f"Request {i}: tell me about {words}.",
        ))  # fmt: skip
    return plan


def mix_body(spec: MixSpec, model: str) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "n": spec.n, "max_tokens": spec.max_tokens,
                            "temperature": spec.temperature, "stream": spec.stream}  # fmt: skip
    if spec.chat:
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.stop is not None:
        body["stop"] = spec.stop
    if spec.ignore_eos:
        body["ignore_eos"] = True
    return (CHAT if spec.chat else COMPLETIONS), body


def chat_stream_body(model: str, content: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
