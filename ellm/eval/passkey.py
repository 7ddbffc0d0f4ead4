"""Pass-key retrieval: a random number hidden at a chosen depth of long filler text, answered greedily.

The prompt is the one of Mohtashami & Jaggi (2023) used by most long-context papers: an instruction,
repeated filler sentences, the key sentence at `depth` of the filler, more filler, then the question
ending in "The pass key is", so a correct model's next tokens are the digits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8


def passkey_prompt(encode, length: int, depth: float, key: int) -> list[int]:
    """Token ids of a prompt of at most `length` tokens (and close to it) with `key` at `depth` in [0, 1]."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    fixed = len(encode(INTRO + NEEDLE.format(key=key) + QUESTION))
    per_filler = len(encode(FILLER * 16)) / 16
    n_fill = max(0, int((length - fixed) / per_filler))
    while True:
        before = int(round(depth * n_fill))
        text = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n_fill - before) + QUESTION
        ids = encode(text)
        if len(ids) <= length or n_fill == 0:
            return ids
        n_fill -= 1 + (len(ids) - length) // max(1, int(per_filler))


def parse_answer(text: str) -> int | None:
    m = re.search(r"\d+", text)
    return int(m.group()) if m else None


@dataclass
class PasskeyResult:
    lengths: list[int]
    depths: list[float]
    trials: int
    # correct[i][j]: keys found at lengths[i], depths[j]
    correct: list[list[int]] = field(default_factory=list)
    answers: list[dict] = field(default_factory=list)  # one record per trial

    def accuracy(self, i: int, j: int) -> float:
        return self.correct[i][j] / self.trials

    def length_accuracy(self, i: int) -> float:
        return sum(self.correct[i]) / (self.trials * len(self.depths))

    def to_dict(self) -> dict:
        return {
            "lengths": self.lengths,
            "depths": self.depths,
            "trials": self.trials,
            "accuracy": [[self.accuracy(i, j) for j in range(len(self.depths))] for i in range(len(self.lengths))],
            "accuracy_per_length": [self.length_accuracy(i) for i in range(len(self.lengths))],
            "answers": self.answers,
        }


def run_passkey(eng, lengths: list[int], depths: list[float], trials: int = 1, seed: int = 0, progress=None) -> PasskeyResult:
    """Greedy pass-key retrieval for every (length, depth), `trials` random 5-digit keys each.

    The keys depend only on `seed`, so two configurations compared with the same seed see the same prompts.
    """
    rng = np.random.default_rng(seed)
    keys = rng.integers(10000, 100000, size=(len(lengths), len(depths), trials))
    res = PasskeyResult(list(lengths), list(depths), trials)
    for i, n in enumerate(lengths):
        row = []
        for j, d in enumerate(depths):
            ok = 0
            for k in range(trials):
                key = int(keys[i, j, k])
                ids = passkey_prompt(eng.tokenizer.encode, n, d, key)
                out = eng.generate(ids, ANSWER_TOKENS)
                text = eng.tokenizer.decode([t for t in out if not eng.tokenizer.is_eog(t)])
                found = parse_answer(text) == key
                ok += found
                res.answers.append({"length": n, "depth": d, "key": key, "prompt_tokens": len(ids),
                                    "answer": text, "correct": found})
                if progress:
                    progress(res.answers[-1])
            row.append(ok)
        res.correct.append(row)
    return res
