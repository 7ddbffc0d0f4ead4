"""A GGUF's chat template compiled once and rendered within bounds: the template is code from the model file,
so its size, nesting, running time and the sizes of the values it builds are limited, each excess one line.

jinja2's immutable sandbox already keeps a template away from Python's internals and caps `range`; what it
leaves open is cost: `9 ** 999999999`, `'x' * 10 ** 12`, a string doubled forty times with `~` or a
block `set`, loops nested twenty deep (compiling them, or running them), and (found by the atheris run, fuzz/RUNS.md) a chain of 290 unary `+`
that takes jinja2's code generator 5 s. Real templates stay far inside these limits: of 25 popular
ones (llama.cpp's models/templates) the largest is 16.7 KB and the deepest nests expressions 12 levels.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from datetime import datetime
from functools import wraps

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import GGUFError

MAX_SOURCE_CHARS = 65_536
MAX_NESTING = 32  # expression nodes inside one another
SECONDS = 2.0  # compiling and rendering, each: plus 1 s per 4 MB of message text
MIN_VALUE_LEN = 1 << 22  # characters or items in one value; 4x the messages' text when that is more
MAX_INT_BITS = 4096
_FORMAT_WIDTH = re.compile(r"\d{7,}")  # a width or precision of a million or more in a %- or {}-format


class _Limit(TemplateError):
    """A bound the template crossed (caught with the template's own errors: one line)."""


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


class _Codegen(CodeGenerator):
    """`a ~ b` joins through the environment's bounded join (jinja2 emits a bare str_join there)."""

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`, Hugging Face's marker of the assistant's text: its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        return nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True), lineno=lineno)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """As Hugging Face's renderer has it (models are trained on its output): plain JSON, no HTML escapes."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Bounded(ImmutableSandboxedEnvironment):
    """The immutable sandbox with every way to build a large value from small ones checked before it runs."""

    code_generator_class = _Codegen
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        # the environment Hugging Face's renderer builds: {% break %}/{% continue %}, {% generation %}, its tojson
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
        self.filters["tojson"] = _tojson
        self._local = threading.local()  # one template, several server threads rendering different messages
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}
        del self.globals["lipsum"]  # n paragraphs of filler text: no chat template needs it

    @property
    def max_len(self) -> int:
        return getattr(self._local, "max_len", MIN_VALUE_LEN)

    @max_len.setter
    def max_len(self, n: int) -> None:
        self._local.max_len = n

    def check_len(self, n: int, what: str) -> None:
        if n > self.max_len:
            raise _Limit(f"{what} would build a value of {n:,} items (at most {self.max_len:,})")

    def check_args(self, name: str, args, kwargs) -> None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and abs(a) > self.max_len:
                raise _Limit(f"{name} called with {a} (arguments up to {self.max_len:,})")

    @staticmethod
    def check_format(name: str, spec) -> None:
        if isinstance(spec, str) and _FORMAT_WIDTH.search(spec):
            raise _Limit(f"{name} with a width of a million or more")

    def bounded_join(self, parts) -> str:
        parts = [str(p) for p in parts]
        self.check_len(sum(map(len, parts)), "~")
        return "".join(parts)

    def concat(self, pieces) -> str:
        """What a block `{% set x %}...{% endset %}`, a macro or a `caller()` renders (jinja2: "".join)."""
        pieces = list(pieces)
        self.check_len(sum(map(len, pieces)), "a block")
        return "".join(pieces)

    def call_binop(self, context, operator: str, left, right):
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * max(abs(left).bit_length() - 1, 1) > MAX_INT_BITS:
                raise _Limit(f"{left} ** {right} has more than {MAX_INT_BITS} bits")
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int):
                    self.check_len(_size(seq) * n, "*")
            if isinstance(left, int) and isinstance(right, int):
                if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                    raise _Limit(f"a product of more than {MAX_INT_BITS} bits")
        elif operator == "+":
            self.check_len(_size(left) + _size(right), "+")
        elif operator == "%" and isinstance(left, str):
            self.check_format("%", left)
            self.check_len(len(left) + sum(map(_size, right if isinstance(right, tuple) else (right,))), "%")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        name = getattr(__obj, "__name__", "a call")
        __self.check_args(name, args, kwargs)
        if name == "replace" and isinstance(getattr(__obj, "__self__", None), str) and len(args) >= 2:
            __self.check_len((len(__obj.__self__) + 1) * _size(args[1]), "replace")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """`'...'.format(...)`: jinja2 wraps it when the attribute is read, not when it is called."""
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            self.check_format(value.__name__, value.__self__)
        return wrapper

    def _bounded_filter(self, name: str, f):
        @wraps(f)
        def bounded(*args, **kwargs):
            self.check_args(f"the filter {name}", args, kwargs)
            if name == "format":
                self.check_format("the filter format", next((a for a in args if isinstance(a, str)), None))
            return f(*args, **kwargs)

        return bounded


class _Deadline:
    """Raises _Limit in the traced thread once `seconds` have passed: checked at Python calls everywhere and at
    every line of the template's own code, where a loop with an empty body makes no call."""

    def __init__(self, seconds: float, what: str):
        self.end = time.monotonic() + seconds
        self.seconds, self.what, self.ticks = seconds, what, 0

    def _check(self) -> None:
        self.ticks += 1
        if self.ticks % 256 == 0 and time.monotonic() > self.end:
            raise _Limit(f"{self.what} took longer than {self.seconds:.0f} s")

    def _line(self, frame, event, arg):
        self._check()
        return self._line

    def _call(self, frame, event, arg):
        self._check()
        return self._line if frame.f_code.co_filename == "<template>" else None

    def __enter__(self):
        self.previous = sys.gettrace()
        if self.previous is None:  # under a debugger or coverage, theirs stays and the deadline is off
            sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        if self.previous is None:
            sys.settrace(None)


def _nesting(tree: nodes.Node) -> int:
    """How deeply expression nodes sit inside one another (iteratively: the tree may be deep)."""
    deepest, stack = 0, [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        depth = depth + 1 if isinstance(node, nodes.Expr) else 0
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in node.iter_child_nodes())
    return deepest


class ChatTemplate:
    """One model's chat template, compiled on construction; `render` fills it for a conversation."""

    def __init__(self, source: str):
        if len(source) > MAX_SOURCE_CHARS:
            raise GGUFError(f"chat template is {len(source):,} characters (eLLM renders up to {MAX_SOURCE_CHARS:,})")
        self.env = _Bounded()
        self.env.globals["raise_exception"] = _raise
        self.env.globals["strftime_now"] = _strftime_now  # as Hugging Face's renderer offers it (Mistral, gpt-oss)
        try:
            with _Deadline(SECONDS, "compiling the chat template"):
                tree = self.env.parse(source)
                if (depth := _nesting(tree)) > MAX_NESTING:
                    raise _Limit(f"expressions nested {depth} deep (at most {MAX_NESTING})")
                self.template = self.env.from_string(tree)
        except Exception as e:
            raise _failed(e) from None

    def render(self, **variables) -> str:
        text = sum(_size(m.get("content")) for m in variables.get("messages", ()) if isinstance(m, dict))
        self.env.max_len = max(MIN_VALUE_LEN, 4 * text)
        out, n = [], 0
        try:
            with _Deadline(SECONDS + text / 4e6, "rendering the chat template"):
                for piece in self.template.generate(**variables):
                    n += len(piece)
                    self.env.check_len(n, "the rendered conversation")
                    out.append(piece)
        except Exception as e:
            raise _failed(e) from None
        return "".join(out)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt)[:256])


def _raise(message):
    raise TemplateError(message)


def _failed(e: Exception) -> GGUFError:
    if isinstance(e, TemplateError):
        return GGUFError(f"chat template failed: {e}")
    # the template is the model file's: 1/0, "a" + 1, ... are its errors, not eLLM's
    return GGUFError(f"chat template failed: {type(e).__name__}: {e}")
