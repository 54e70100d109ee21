"""Slot-filled sentence templates for synthetic chat text (companion workload).

``Filler`` fills ``{slot}`` templates from ``vocab`` with a seeded ``random.Random``; a
``UserProfile`` keeps one user's facts (name, city, pet, job, ...) fixed for a whole
conversation so follow-ups and corrections refer back to them. Templates are drawn
without replacement per conversation (``TemplateDeck``), so a conversation does not
repeat a sentence skeleton until its deck is exhausted.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from kvtier.workload import vocab

_SLOT = re.compile(r"\{(\w+)\}")

_POOLS: dict[str, tuple[str, ...]] = {
    "place": vocab.PLACES, "setting": vocab.SETTINGS, "hobby": vocab.HOBBIES, "food": vocab.FOODS,
    "relative": vocab.RELATIVES, "event": vocab.EVENTS, "emotion": vocab.EMOTIONS, "weather": vocab.WEATHER,
    "object": vocab.OBJECTS, "media": vocab.MEDIA, "time": vocab.TIMES, "activity": vocab.ACTIVITIES,
    "adj": vocab.ADJECTIVES, "topic": vocab.TOPICS, "trait": vocab.TRAITS, "friend": vocab.FIRST_NAMES,
    "job": vocab.JOBS, "pet": vocab.PETS, "petname": vocab.PET_NAMES,
}


@dataclass
class UserProfile:
    name: str
    city: str
    job: str
    pet: str
    petname: str
    hobby: str
    food: str
    relative: str
    friend: str

    @classmethod
    def draw(cls, rng: random.Random) -> "UserProfile":
        c = rng.choice
        return cls(name=c(vocab.FIRST_NAMES), city=c(vocab.PLACES), job=c(vocab.JOBS), pet=c(vocab.PETS),
                   petname=c(vocab.PET_NAMES), hobby=c(vocab.HOBBIES), food=c(vocab.FOODS),
                   relative=c(vocab.RELATIVES), friend=c(vocab.FIRST_NAMES))


@dataclass
class Filler:
    """Fill templates: ``{my_x}`` slots come from the profile (``{your_x}``: the same fact
    addressed to the user, "my sister" -> "your sister"), others are fresh draws."""

    rng: random.Random
    profile: UserProfile | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def fill(self, template: str) -> str:
        def sub(m: re.Match[str]) -> str:
            key = m.group(1)
            if key in self.extra:
                return self.extra[key]
            if key.startswith("my_") and self.profile is not None:
                return getattr(self.profile, key[3:])
            if key.startswith("your_") and self.profile is not None:  # the user's facts, spoken to them
                value = getattr(self.profile, key[5:])
                return "your " + value[3:] if value.startswith("my ") else value
            return self.rng.choice(_POOLS[key])
        text = _SLOT.sub(sub, template)
        return text[:1].upper() + text[1:]


class TemplateDeck:
    """Draw templates without replacement; reshuffle when exhausted."""

    def __init__(self, templates: tuple[str, ...], rng: random.Random) -> None:
        self._templates = templates
        self._rng = rng
        self._deck: list[str] = []

    def draw(self) -> str:
        if not self._deck:
            self._deck = list(self._templates)
            self._rng.shuffle(self._deck)
        return self._deck.pop()


def grow(first: str, more: "callable[[], str]", approx_tokens: int, count: "callable[[str], int]") -> str:
    """Append sentences from ``more()`` to ``first`` until ``count(text) >= approx_tokens``."""
    text = first
    while count(text) < approx_tokens:
        text = f"{text} {more()}"
    return text
