"""A deterministic synthetic language for the GPT example: a small probabilistic grammar, generated from a seed.

Why a grammar and not random tokens: it has structure a small model can learn in a minute (determiner-noun
and subject-verb number agreement, transitive verbs taking objects, relative and conditional clauses,
sentence-final periods), so the loss falls well below the uniform ``ln(vocab)`` instead of flat-lining.
Nothing is downloaded: the same seed gives the same token stream on every machine (``random.Random`` with an
integer seed is stable across platforms and Python versions).
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset

# Word classes: singular and plural forms are parallel lists so agreement is a choice of list, not a lookup.
DET_SG = ["the", "a", "every", "this"]
DET_PL = ["the", "some", "many", "these"]
ADJ = ["small", "old", "red", "quiet", "happy", "clever"]
NOUN_SG = ["cat", "dog", "bird", "child", "teacher", "robot", "farmer", "river"]
NOUN_PL = ["cats", "dogs", "birds", "children", "teachers", "robots", "farmers", "rivers"]
VERB_T_SG = ["sees", "likes", "follows", "finds", "helps"]
VERB_T_PL = ["see", "like", "follow", "find", "help"]
VERB_I_SG = ["sleeps", "runs", "sings", "waits"]
VERB_I_PL = ["sleep", "run", "sing", "wait"]
PREP = ["near", "behind", "with"]
FUNCTION = ["that", "and", "if", "then", ".", "<eos>"]

VOCAB: list[str] = sorted(set(
    DET_SG + DET_PL + ADJ + NOUN_SG + NOUN_PL + VERB_T_SG + VERB_T_PL + VERB_I_SG + VERB_I_PL + PREP + FUNCTION
))
TOKEN_ID: dict[str, int] = {word: i for i, word in enumerate(VOCAB)}
EOS = "<eos>"


class Grammar:
    """Samples sentences word by word; ``depth`` bounds the clause recursion so sentences stay short."""

    def __init__(self, seed: int, max_depth: int = 2) -> None:
        self.rng = random.Random(seed)
        self.max_depth = max_depth

    def noun_phrase(self, plural: bool, depth: int) -> list[str]:
        r = self.rng
        words = [r.choice(DET_PL if plural else DET_SG)]
        if r.random() < 0.4:
            words.append(r.choice(ADJ))
        words.append(r.choice(NOUN_PL if plural else NOUN_SG))
        if depth < self.max_depth and r.random() < 0.2:
            words += [r.choice(PREP)] + self.noun_phrase(r.random() < 0.5, depth + 1)
        elif depth < self.max_depth and r.random() < 0.15:  # relative clause agrees with the head noun
            words += ["that"] + self.verb_phrase(plural, depth + 1)
        return words

    def verb_phrase(self, plural: bool, depth: int) -> list[str]:
        r = self.rng
        if r.random() < 0.6:
            verb = r.choice(VERB_T_PL if plural else VERB_T_SG)
            return [verb] + self.noun_phrase(r.random() < 0.5, depth + 1)
        return [r.choice(VERB_I_PL if plural else VERB_I_SG)]

    def clause(self, depth: int) -> list[str]:
        plural = self.rng.random() < 0.5
        return self.noun_phrase(plural, depth) + self.verb_phrase(plural, depth)

    def sentence(self) -> list[str]:
        r = self.rng.random()
        if r < 0.15:
            words = ["if"] + self.clause(1) + ["then"] + self.clause(1)
        elif r < 0.3:
            words = self.clause(1) + ["and"] + self.clause(1)
        else:
            words = self.clause(0)
        return words + ["."]

    def paragraph(self) -> list[str]:
        """One to four sentences closed by ``<eos>``."""
        words: list[str] = []
        for _ in range(self.rng.randint(1, 4)):
            words += self.sentence()
        return words + [EOS]


def token_stream(num_tokens: int, seed: int) -> torch.Tensor:
    """The first ``num_tokens`` token ids (int64) of the language generated from ``seed``."""
    if num_tokens < 1:
        raise ValueError(f"token_stream: num_tokens must be >= 1, got {num_tokens}")
    grammar = Grammar(seed)
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += [TOKEN_ID[w] for w in grammar.paragraph()]
    return torch.tensor(ids[:num_tokens], dtype=torch.long)


def decode(ids: list[int] | torch.Tensor) -> str:
    """Token ids back to words, for printing samples."""
    return " ".join(VOCAB[int(i)] for i in ids)


class GrammarDataset(Dataset):
    """``num_samples`` windows of ``block_size + 1`` consecutive tokens (inputs plus the shifted targets).

    Windows do not overlap, so an epoch sees every generated token once. Item ``i`` is an int64 tensor of shape
    ``(block_size + 1,)``; the default collate stacks them into ``(batch, block_size + 1)``.
    """

    def __init__(self, num_samples: int, block_size: int, seed: int = 1234) -> None:
        if num_samples < 1 or block_size < 1:
            raise ValueError(f"GrammarDataset: num_samples and block_size must be >= 1, "
                             f"got num_samples={num_samples}, block_size={block_size}")
        self.block_size = block_size
        self.windows = token_stream(num_samples * (block_size + 1), seed).view(num_samples, block_size + 1)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.windows[index]
