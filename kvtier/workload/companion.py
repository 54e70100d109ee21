"""AI-companion chat workload (character.ai-style), seeded and byte-reproducible.

Shape, after the published companion-app study (RAM+SSD KV offload vs plain vLLM):

* a few persona/character system prompts, some long (``system_tokens`` is the median;
  lengths are lognormal, clipped to [median/4, median*2.5]); popular characters are
  chosen more often (Zipf-like weights), so conversations share the persona prefix;
* 1..``turns_max`` turns per conversation: a geometric distribution truncated to
  [1, turns_max] whose mean is ``turns_mean`` (or a lognormal, resampled above the cap);
  conversations also stop early when the next prompt would pass ``max_prompt_tokens``;
* user turns in a dominant emotional tone, mixing small talk, personal questions,
  follow-ups, corrections, advice requests and roleplay actions; in-character replies
  of lognormal length (median ``assistant_tokens``);
* ``resume_fraction`` of conversations are resumed chats: they carry earlier messages
  (``history``), so their first request already has a long prompt;
* open-loop arrivals: Poisson with ``rate`` conversations/s; think times lognormal with
  median ``think_time_s``, and ``away_fraction`` of turns come back after a long pause
  (minutes), when a small cache will have evicted the chat;
* no request prompt exceeds ``max_prompt_tokens`` (approx chars/4 tokens, which
  over-counts English text for BPE tokenizers); the conversation stops before it would.

Only ``random.Random(seed)`` is used, so the same spec gives the same bytes.
"""

from __future__ import annotations

import math
import random
from statistics import NormalDist
from dataclasses import asdict, dataclass
from typing import Literal

from kvtier.workload import companion_text as T
from kvtier.workload import vocab
from kvtier.workload.format import Conversation, HistoryMessage, Turn, WorkloadHeader
from kvtier.workload.text import Filler, TemplateDeck, UserProfile, grow
from kvtier.workload.tokens import ApproxTokenizer, approx_token_count


@dataclass(frozen=True)
class CompanionSpec:
    conversations: int = 100
    turns_mean: float = 5.0
    turns_max: int = 16
    turns_dist: Literal["geometric", "lognormal"] = "geometric"
    personas: int = 8
    system_tokens: int = 800
    user_tokens: int = 40
    assistant_tokens: int = 120
    max_prompt_tokens: int = 6000
    resume_fraction: float = 0.15
    rate: float = 0.5
    think_time_s: float = 5.0
    away_fraction: float = 0.1
    away_time_s: float = 120.0
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        checks = [
            (self.conversations >= 1, "conversations must be >= 1"),
            (self.turns_max >= 1, "turns-max must be >= 1"),
            (1.0 <= self.turns_mean <= self.turns_max, "turns-mean must be between 1 and turns-max"),
            (self.turns_dist != "geometric" or self.turns_mean <= (1 + self.turns_max) / 2,
             "turns-mean must be at most (1 + turns-max) / 2 for the geometric distribution (its flattest "
             "truncation is uniform)"),
            (self.personas >= 1, "personas must be >= 1"),
            (self.system_tokens >= 16, "system-tokens must be >= 16"),
            (self.user_tokens >= 4, "user-tokens must be >= 4"),
            (self.assistant_tokens >= 4, "assistant-tokens must be >= 4"),
            (self.max_prompt_tokens >= 64, "max-prompt-tokens must be >= 64"),
            (0.0 <= self.resume_fraction <= 1.0, "resume-fraction must be in [0, 1]"),
            (0.0 <= self.away_fraction <= 1.0, "away-fraction must be in [0, 1]"),
            (self.rate > 0, "rate must be > 0"),
            (self.think_time_s >= 0 and self.away_time_s >= 0, "think times must be >= 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


@dataclass(frozen=True)
class Persona:
    key: str
    name: str
    archetype: str
    home: str
    prompt: str


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(rng.gauss(0.0, sigma))))


def _truncated_geometric_p(mean: float, cap: int) -> float:
    """p of a geometric on {1, 2, ...} whose mean, truncated to [1, cap], is ``mean``."""
    if mean <= 1.0 or cap <= 1:
        return 1.0
    lo, hi = 1e-9, 1.0
    for _ in range(60):
        p = (lo + hi) / 2
        w = [(1 - p) ** (k - 1) for k in range(1, cap + 1)]
        m = sum(k * x for k, x in zip(range(1, cap + 1), w)) / sum(w)
        lo, hi = (p, hi) if m > mean else (lo, p)
    return (lo + hi) / 2


def _num_turns(rng: random.Random, spec: CompanionSpec) -> int:
    p = _truncated_geometric_p(spec.turns_mean, spec.turns_max)
    if spec.turns_dist == "geometric" and p < 1.0 and 1.0 - (1.0 - p) ** spec.turns_max < 0.5:
        # a flat truncated geometric (mean near (1 + turns_max) / 2): rejection would almost never
        # accept (it hung), so draw from the truncated distribution's inverse CDF in one step
        q = 1.0 - p
        u = rng.random()
        n = math.ceil(math.log1p(-u * (1.0 - q ** spec.turns_max)) / math.log(q))
        return min(spec.turns_max, max(1, n))
    while True:
        if spec.turns_dist == "geometric":
            n = 1 if p >= 1.0 else 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
        else:
            n = max(1, round(spec.turns_mean * math.exp(rng.gauss(-0.18, 0.6))))
        if n <= spec.turns_max:
            return n


def make_personas(spec: CompanionSpec, rng: random.Random) -> list[Persona]:
    names = list(vocab.CHARACTER_NAMES)
    rng.shuffle(names)
    archetypes = list(vocab.ARCHETYPES)
    rng.shuffle(archetypes)
    personas = []
    sections = (T.PERSONA_BACKSTORY, T.PERSONA_WORLD, T.PERSONA_STYLE, T.PERSONA_EXAMPLE)
    # lengths: evenly spaced quantiles of lognormal(median, 0.6), in shuffled popularity order
    n = spec.personas
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)] if n > 1 else [0.0]
    rng.shuffle(z)
    for i in range(n):
        name = names[i % len(names)] + ("" if i < len(names) else f" {i // len(names) + 1}")
        archetype = archetypes[i % len(archetypes)]
        home = rng.choice(vocab.PLACES)
        target = min(spec.system_tokens * 2.5, max(spec.system_tokens / 4, spec.system_tokens * math.exp(0.6 * z[i])))
        target = min(int(target), spec.max_prompt_tokens // 2)
        f = Filler(rng, extra={"char": name, "archetype": archetype, "home": home})
        decks = [TemplateDeck(s, rng) for s in sections]
        parts = [f.fill(T.PERSONA_INTRO[0]), f.fill(rng.choice(T.PERSONA_TRAITS))]
        rules = f.fill(T.PERSONA_RULES[0])
        k = 0
        while approx_token_count(" ".join(parts) + " " + rules) < target:
            parts.append(f.fill(decks[k % len(decks)].draw()))
            k += 1
        personas.append(Persona(key=f"p{i:02d}", name=name, archetype=archetype, home=home,
                                prompt="\n".join(parts + [rules])))
    return personas


class _Chat:
    """Text for one conversation: fixed persona, user profile and dominant tone."""

    _CAT_WEIGHTS = {"small_talk": 3, "personal_question": 2, "follow_up": 3, "correction": 1,
                    "emotional_share": 2, "advice": 1.5, "roleplay": 1}

    def __init__(self, rng: random.Random, persona: Persona, tone: str) -> None:
        self.rng = rng
        self.tone = tone
        cats = list(self._CAT_WEIGHTS)
        self.theme = rng.choices(cats, weights=[self._CAT_WEIGHTS[c] for c in cats])[0]
        self.profile = UserProfile.draw(rng)
        extra = {"char": persona.name, "home": persona.home, "archetype": persona.archetype}
        self.fill = Filler(rng, self.profile, extra).fill
        self.user_decks = {c: TemplateDeck(t, rng) for c, t in T.USER_BY_CATEGORY.items()}
        self.tone_deck = TemplateDeck(T.TONE_LINES[tone], rng)
        self.body_deck = TemplateDeck(T.ASSISTANT_BODY, rng)
        self.question_deck = TemplateDeck(T.ASSISTANT_QUESTIONS, rng)

    def category(self, k: int) -> str:
        """Turn k's category: the conversation's theme is 4x as likely; never a follow-up or
        correction on the first turn."""
        if k == 0 and self.theme in ("follow_up", "correction"):
            return "small_talk"
        cats = [c for c in self._CAT_WEIGHTS if k > 0 or c not in ("follow_up", "correction")]
        w = [self._CAT_WEIGHTS[c] * (4 if c == self.theme else 1) for c in cats]
        return self.rng.choices(cats, weights=w)[0]

    def turn_tone(self) -> str:
        return self.tone if self.rng.random() < 0.75 else self.rng.choice(T.TONES)

    def user(self, k: int, category: str, tone: str, tokens: int) -> str:
        first = self.fill(self.rng.choice(T.USER_OPENERS)) if k == 0 else ""
        lines = [first] if first else []
        lines.append(self.fill(TemplateDeck(T.TONE_LINES[tone], self.rng).draw() if tone != self.tone
                               else self.tone_deck.draw()))
        lines.append(self.fill(self.user_decks[category].draw()))
        more = lambda: self.fill(self.user_decks[self.rng.choice(list(self.user_decks))].draw())  # noqa: E731
        return grow(" ".join(lines), more, tokens, approx_token_count)

    def assistant(self, tone: str, tokens: int) -> str:
        opener = self.fill(self.rng.choice(T.ASSISTANT_OPENERS[tone]))
        text = grow(opener, lambda: self.fill(self.body_deck.draw()), max(1, tokens - 10), approx_token_count)
        return f"{text} {self.fill(self.question_deck.draw())}"


def generate_companion(spec: CompanionSpec) -> tuple[WorkloadHeader, list[Conversation]]:
    """Build the workload described by ``spec`` (see module docstring)."""
    spec.validate()
    rng = random.Random(spec.seed)
    personas = make_personas(spec, rng)
    weights = [1.0 / (i + 1) ** 0.8 for i in range(len(personas))]
    msg_len, gen_len = ApproxTokenizer.message_length, ApproxTokenizer.GENERATION_PROMPT_LENGTH
    conversations: list[Conversation] = []
    t = 0.0
    for ci in range(spec.conversations):
        t += rng.expovariate(spec.rate) if ci else 0.0
        persona = rng.choices(personas, weights=weights)[0]
        tone = rng.choice(T.TONES)
        chat = _Chat(rng, persona, tone)
        n_turns = _num_turns(rng, spec)
        resumed = rng.random() < spec.resume_fraction
        history: list[HistoryMessage] = []
        if resumed:
            for _ in range(rng.randint(4, 12)):
                tt = chat.turn_tone()
                ut = int(_lognormal(rng, spec.user_tokens, 0.5, 4, spec.user_tokens * 4))
                at = int(_lognormal(rng, spec.assistant_tokens, 0.6, 8, spec.assistant_tokens * 5))
                history.append(HistoryMessage(role="user", content=chat.user(1, chat.category(1), tt, ut)))
                history.append(HistoryMessage(role="assistant", content=chat.assistant(tt, at)))
        conv = Conversation(id=f"c{ci:05d}", arrival_s=round(t, 3), system=persona.prompt, history=history,
                            metadata={"persona": persona.key, "character": persona.name, "tone": tone,
                                      "category": chat.theme, "user": chat.profile.name, "resumed": resumed},
                            turns=[Turn(user="")])
        turns: list[Turn] = []
        # approx prompt length of the next turn = history so far + its user message + generation prompt
        history_len = msg_len("system", persona.prompt) + sum(msg_len(h.role, h.content) for h in history)
        for k in range(n_turns):
            category, tt = chat.category(k), chat.turn_tone()
            ut = int(_lognormal(rng, spec.user_tokens, 0.5, 4, spec.user_tokens * 4))
            at = int(_lognormal(rng, spec.assistant_tokens, 0.6, 8, spec.assistant_tokens * 5))
            away = k > 0 and rng.random() < spec.away_fraction
            think = (_lognormal(rng, spec.away_time_s, 0.5, spec.away_time_s / 4, spec.away_time_s * 4) if away
                     else _lognormal(rng, spec.think_time_s, 0.5, 0.2, spec.think_time_s * 6)) if k > 0 else 0.0
            reply = chat.assistant(tt, at)
            turn = Turn(user=chat.user(k, category, tt, ut), assistant=reply, think_time_s=round(think, 3),
                        max_tokens=max(8, min(1024, approx_token_count(reply))),
                        metadata={"category": category, "tone": tt})
            if history_len + msg_len("user", turn.user or "") + gen_len > spec.max_prompt_tokens:
                break
            turns.append(turn)
            history_len += msg_len("user", turn.user or "") + msg_len("assistant", turn.assistant)
        if not turns:  # the resumed history alone is too long: drop the history, keep one turn
            conv.history = []
            turns = [turn]
        conv.turns = turns
        conversations.append(conv)
    header = WorkloadHeader(name="companion", description="AI-companion chat (character.ai-style), synthetic",
                            generator={"kind": "companion", **asdict(spec)})
    return header, conversations
