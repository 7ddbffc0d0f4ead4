"""A byte-level BPE vocabulary of any size where every token is reachable by its merges.

Bytes first (GPT-2's byte-to-unicode map), then tokens of growing length, each the merge of an existing
token and one printable character, in rank order; the last tokens are special (control) tokens, as in the
Llama 3 vocabulary. Real text tokenizes into real (if unusual) pieces.
"""

from __future__ import annotations

import itertools

N_SPECIAL = 256  # control tokens at the end: <|begin_of_text|>, <|end_of_text|>, ..., reserved


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def byte_bpe_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) with `size` tokens; types are llama.cpp's (1 normal, 3 control)."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    chars = [b2u[b] for b in b" etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ.,'0123456789-"]
    merges: list[str] = []
    n_normal = size - N_SPECIAL
    seen = set(tokens)
    frontier = chars
    while len(tokens) < n_normal:
        grown = []
        for a, c in itertools.product(frontier, chars):
            t = a + c
            if t in seen:
                continue
            tokens.append(t)
            seen.add(t)
            merges.append(f"{a} {c}")
            grown.append(t)
            if len(tokens) == n_normal:
                break
        frontier = grown
    specials = list(SPECIALS) + [f"<|reserved_special_token_{i}|>" for i in range(N_SPECIAL - len(SPECIALS))]
    types = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, types, merges
