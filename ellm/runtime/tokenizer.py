"""Tokenizer built from the GGUF's own vocabulary with the `tokenizers` library, and the chat template.

GGUF `gpt2` models are byte-level BPE with a pre-tokenizer chosen by `tokenizer.ggml.pre` (the
regexes llama.cpp uses); `llama` models are SentencePiece BPE, whose merges are derived from the
token scores. The result is saved as tokenizer.json in the artifact and loaded without the GGUF.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import GGUFError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (regexes applied in sequence, ignore_merges), as in llama.cpp's llama-vocab.cpp.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{k: ((_GPT2,), False) for k in ("gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling")},
    **{k: ((r"\p{N}", _GPT2), False) for k in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{k: ((_LLAMA3,), True) for k in ("llama3", "llama-bpe", "llama-v3", "falcon3", "pixtral", "dbrx", "smaug-bpe")},
    **{k: ((_QWEN2,), False) for k in ("qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan")},
}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_BYTE = 3, 4, 6
# Texts llama.cpp also treats as end-of-generation when they are control tokens.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the runtime needs besides the tokenizer.json: special ids, BOS policy, chat template."""

    model: str  # "gpt2" | "llama"
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    eog_ids: tuple[int, ...]
    chat_template: str | None
    vocab_size: int
    specials: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["eog_ids"] = list(self.eog_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TokenizerInfo:
        d = dict(d)
        d["eog_ids"] = tuple(d["eog_ids"])
        return cls(**d)


def _added_tokens(tokens: list[str], types: list[int]):
    from tokenizers import AddedToken

    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == TOKEN_TYPE_CONTROL:
            added.append((i, AddedToken(t, special=True, normalized=False)))
        elif ty == TOKEN_TYPE_USER_DEFINED:
            added.append((i, AddedToken(t, special=False, normalized=False)))
    return added


def _bpe_gpt2(tokens, types, merges, pre: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); known: {', '.join(sorted(PRE_TOKENIZERS))}")
    regexes, ignore_merges = PRE_TOKENIZERS[pre]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE as ordered merges: (a, b) for every normal token a+b, ranked by the token's score."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    merges = []
    for t, i in vocab.items():
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                merges.append((-scores[i], vocab[a], vocab[b], a, b))
    merges.sort()
    return [(a, b) for _, _, _, a, b in merges]


def _bpe_spm(tokens, types, scores, add_space_prefix: bool, unk_id: int | None):
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    model = models.BPE(
        vocab=vocab, merges=_spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    tok = Tokenizer(model)
    norms = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return tok


def build_from_gguf(gf):
    """(tokenizers.Tokenizer, TokenizerInfo) from GGUF metadata."""
    model = gf.get_str("tokenizer.ggml.model", None)
    tokens = gf.get_array("tokenizer.ggml.tokens", "string", None)
    if model is None or tokens is None:
        raise GGUFError(f"{gf.path}: no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    types = gf.get_array("tokenizer.ggml.token_type", "int", None) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{gf.path}: {len(types)} token types for {len(tokens)} tokens (tokenizer.ggml.token_type)")
    ids = ("bos", "eos", "eot", "eom", "unknown")
    special = {k: gf.get_int(f"tokenizer.ggml.{k}_token_id", None, minimum=0) for k in ids}
    bad = [k for k, v in special.items() if v is not None and v >= len(tokens)]
    if bad:
        raise GGUFError(f"{gf.path}: tokenizer.ggml.{bad[0]}_token_id {special[bad[0]]} is past the {len(tokens)} tokens")
    try:  # the `tokenizers` library raises a bare Exception for a vocabulary it cannot build (a merge of unknown tokens)
        if model == "gpt2":
            merges = gf.get_array("tokenizer.ggml.merges", "string", None)
            if merges is None:
                raise GGUFError(f"{gf.path}: BPE tokenizer without tokenizer.ggml.merges")
            bad = next((i for i, m in enumerate(merges) if not all(m.partition(" ")[::2])), None)
            if bad is not None:
                raise GGUFError(f"{gf.path}: tokenizer.ggml.merges[{bad}] {merges[bad][:40]!r} is not two tokens "
                                "joined by a space")
            tok = _bpe_gpt2(tokens, types, merges, gf.get_str("tokenizer.ggml.pre", "default").replace("default", "gpt2"))
            default_bos = False
        elif model == "llama":
            scores = gf.get_array("tokenizer.ggml.scores", "float", None) or [0.0] * len(tokens)
            if len(scores) != len(tokens):
                raise GGUFError(f"{gf.path}: {len(scores)} token scores for {len(tokens)} tokens (tokenizer.ggml.scores)")
            tok = _bpe_spm(tokens, types, scores, gf.get_bool("tokenizer.ggml.add_space_prefix", True), special["unknown"])
            default_bos = True
        else:
            raise GGUFError(f"{gf.path}: unsupported tokenizer model {model!r} (supported: gpt2, llama)")
        added = _added_tokens(tokens, types)
        tok.add_special_tokens([a for _, a in added if a.special])
        tok.add_tokens([a for _, a in added if not a.special])
    except Exception as e:
        if type(e) is not Exception:  # ours (GGUFError), or a bug: not the library's refusal
            raise
        raise GGUFError(f"{gf.path}: its tokenizer cannot be built from the vocabulary: {e}") from None

    bos, eos = special["bos"], special["eos"]
    eog = {x for x in (eos, special["eot"], special["eom"]) if x is not None}
    eog |= {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_TYPE_CONTROL and t in EOG_TEXTS}
    info = TokenizerInfo(
        model=model,
        bos_id=int(bos) if bos is not None else None,
        eos_id=int(eos) if eos is not None else None,
        add_bos=gf.get_bool("tokenizer.ggml.add_bos_token", default_bos) and bos is not None,
        eog_ids=tuple(sorted(eog)),
        chat_template=gf.get_str("tokenizer.chat_template", None),
        vocab_size=len(tokens),
        specials={t: i for i, t in enumerate(tokens) if types[i] == TOKEN_TYPE_CONTROL},
    )
    return tok, info


class Tokenizer:
    """Text <-> token ids for one model, with its BOS policy and chat template."""

    def __init__(self, hf_tokenizer, info: TokenizerInfo):
        self._tok = hf_tokenizer
        self.info = info
        self._lock = threading.Lock()
        self._template = None  # ChatTemplate, compiled at first use

    @classmethod
    def from_gguf(cls, gf) -> Tokenizer:
        return cls(*build_from_gguf(gf))

    @classmethod
    def load(cls, json_path: str | Path, info: TokenizerInfo) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(json_path)), info)

    def to_json(self) -> str:
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def vocabulary_digest(self) -> str:
        """What the token ids mean, as a SHA-256 of every token's id and text: two tokenizers with the same
        digest give the same ids the same meaning (their chat templates may differ)."""
        import hashlib

        h = hashlib.sha256()
        for text, i in sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1]):
            h.update(f"{i}\t{text}\n".encode())
        return h.hexdigest()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special-token texts (e.g. <|im_start|>) become their ids."""
        with self._lock:  # encode_text flips the special-token switch
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.info.add_bos if add_bos is None else add_bos) and self.info.bos_id is not None:
            if not ids or ids[0] != self.info.bos_id:
                ids = [self.info.bos_id] + ids
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` with special-token texts kept as text (user content: "<|im_end|>" typed by a
        user is ordinary characters, never a control token). No BOS."""
        with self._lock:  # the switch is the tokenizer's state
            self._tok.encode_special_tokens = True
            try:
                return self._tok.encode(text, add_special_tokens=False).ids
            finally:
                self._tok.encode_special_tokens = False

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` in the chat template: the template's own text is parsed for special tokens,
        the messages' content never is. Content without special-token text is tokenized with the template's
        text, as llama.cpp does; otherwise each content is rendered as a placeholder, the rendering is cut
        there, and the content is encoded as plain text."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        if not any(name in str(m.get("content", "")) for m in messages for name in self.info.specials):
            return self.encode(text)
        marks = [f"\x00ellm-content-{i}\x00" for i in range(len(messages))]
        text = self.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                        add_generation_prompt)
        if any(text.count(mark) != 1 for mark in marks):
            raise GGUFError("this model's chat template transforms message content, so content with "
                            "special-token text cannot be kept as text")
        ids: list[int] = []
        for i, m in enumerate(messages):
            head, text = text.split(marks[i], 1)
            ids += self.encode(head, add_bos=None if i == 0 else False)
            ids += self.encode_text(str(m["content"]))
        return ids + self.encode(text, add_bos=False)

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def is_eog(self, token: int) -> bool:
        return int(token) in self.info.eog_ids

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render the GGUF's chat template (jinja2, sandboxed and bounded: chat_template.py) for `messages`."""
        if not self.info.chat_template:
            raise GGUFError("this model has no chat template (tokenizer.chat_template)")
        if self._template is None:  # compiled once; a race between threads compiles it twice, harmlessly
            from .chat_template import ChatTemplate

            self._template = ChatTemplate(self.info.chat_template)
        names = {i: t for t, i in self.info.specials.items()}
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=names.get(self.info.bos_id, ""),
            eos_token=names.get(self.info.eos_id, ""),
        )

    def info_json(self) -> str:
        return json.dumps(self.info.to_dict())
