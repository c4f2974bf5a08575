"""Parsers of a chat model's raw output: tool calls (`TOOL_PARSERS`, vLLM's `--tool-call-parser`)
and reasoning (`REASONING_PARSERS`, `--reasoning-parser`), each a registry of small classes, so
another format is one class; the outputs of constrained tool choices (`NamedCallParser`,
`CallListParser`); and `OutputParser`, reasoning then calls from the answer.

Invariants, for every parser:
- Nothing is lost: the pieces a parser returns (content, reasoning, each call's name and
  arguments) account for the whole output, except the markers themselves. Text that only looks
  like a call (malformed JSON, a missing name, an unclosed block) stays content, verbatim.
- Streaming equals whole: feeding the output in any chunks, then `finish()`, gives deltas whose
  concatenation equals `parse` of the whole text (per call: the index and id come first, then
  the name, then `arguments` in pieces that concatenate to the JSON string).
- A marker split across chunks is held back until it is complete or ruled out; nothing after
  the held-back part is released before it.
"""
from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One call: OpenAI's `tool_calls` entry, `arguments` a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class Parsed:
    """A whole output split: `content` (None when there is none), `reasoning` (None without a
    reasoning parser or reasoning), and the calls in order."""

    content: str | None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class Delta:
    """A streamed piece: text for `content` or `reasoning`, or a piece of call `index` (its id
    and name the first time, then argument text)."""

    content: str = ""
    reasoning: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could begin `marker` (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _StreamParser:
    """What both kinds share: a whole parse is a fresh parser fed everything, then finished;
    text that could begin a marker stays buffered."""

    _buf: str

    def feed(self, text: str) -> list[Delta]:
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        """The whole output split (a fresh parser's)."""
        fresh = self.fresh()
        return _collect([*fresh.feed(text), *fresh.finish()])

    def fresh(self) -> "_StreamParser":
        """A parser like this one that has seen nothing."""
        return type(self)()

    def _release(self, marker: str) -> str:
        """The buffered text that cannot begin `marker`, taken out of the buffer."""
        cut = len(self._buf) - _held(self._buf, marker)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out


class HermesToolParser(_StreamParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5/Qwen3, Hermes and
    many chat templates write calls; text outside the blocks is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf, self._in_call, self._calls = "", False, itertools.count()

    @classmethod
    def call_of(cls, body: str) -> ToolCall | None:
        """The call a block's body holds, None unless it is a JSON object with a string `name`
        and object `arguments` (a missing `arguments` is `{}`)."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def feed(self, text: str) -> list[Delta]:
        """The deltas `text` completes (a call is released when its block closes)."""
        self._buf += text
        out: list[Delta] = []
        while True:
            if not self._in_call:
                at = self._buf.find(self.OPEN)
                if at < 0:
                    text = self._release(self.OPEN)
                    return out + [Delta(content=text)] if text else out
                if at:
                    out.append(Delta(content=self._buf[:at]))
                self._buf, self._in_call = self._buf[at:], True
            end = self._buf.find(self.CLOSE)
            if end < 0:
                return out
            block = self._buf[:end + len(self.CLOSE)]
            self._buf, self._in_call = self._buf[end + len(self.CLOSE):], False
            out.extend(self._block(block))

    def _block(self, block: str) -> list[Delta]:
        call = self.call_of(block[len(self.OPEN):-len(self.CLOSE)])
        if call is None:  # not a call: the text stays, verbatim
            return [Delta(content=block)]
        i = next(self._calls)
        half = len(call.arguments) // 2
        return [Delta(index=i, id=call.id, name=call.name),
                Delta(index=i, arguments=call.arguments[:half]),
                Delta(index=i, arguments=call.arguments[half:])]

    def finish(self) -> list[Delta]:
        """What is left at the end: held-back text, or an unclosed block, as content."""
        rest, self._buf, self._in_call = self._buf, "", False
        return [Delta(content=rest)] if rest else []


class ThinkReasoningParser(_StreamParser):
    """`<think>...</think>` before the answer, as Qwen3 writes it: the text inside is reasoning,
    the rest content. An output that opens no `<think>` is all content; one whose block never
    closes is all reasoning."""

    OPEN, CLOSE = "<think>", "</think>"
    THINKS_FIRST = False  # reasoning from the first token, the opening tag optional

    def __init__(self) -> None:
        self._buf, self._state = "", "start"  # start -> thinking -> answer
        self._lead = False  # newlines right after </think> still to drop

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        if self._state == "start":
            stripped = self._buf.lstrip()
            if self.OPEN.startswith(stripped) and len(stripped) < len(self.OPEN):
                return out  # could still open the block
            if stripped.startswith(self.OPEN):
                self._buf, self._state = stripped[len(self.OPEN):], "thinking"
            else:
                self._state = "thinking" if self.THINKS_FIRST else "answer"
        if self._state == "thinking":
            end = self._buf.find(self.CLOSE)
            if end < 0:
                text = self._release(self.CLOSE)
                return out + [Delta(reasoning=text)] if text else out
            if end:
                out.append(Delta(reasoning=self._buf[:end]))
            self._buf, self._state, self._lead = self._buf[end + len(self.CLOSE):], "answer", True
        if self._state == "answer" and self._lead:  # the newlines after </think> separate, drop
            self._buf = self._buf.lstrip("\n")
            self._lead = not self._buf
        if self._state == "answer" and self._buf:
            out.append(Delta(content=self._buf))
            self._buf = ""
        return out

    def finish(self) -> list[Delta]:
        """What is left at the end: held-back text as the part it was in."""
        rest, state = self._buf, self._state
        self.__init__()
        if not rest:
            return []
        return [Delta(reasoning=rest)] if state == "thinking" else [Delta(content=rest)]


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """DeepSeek-R1's: its chat template opens `<think>` in the prompt, so the output is
    reasoning from its first token up to `</think>` (an opening tag there is dropped)."""

    THINKS_FIRST = True


class NamedCallParser(_StreamParser):
    """The output of a named `tool_choice`, generated under that function's `parameters` schema:
    the whole output is the one call's `arguments`, streamed as it comes (index, id and name
    before the first piece). An empty output is no call."""

    def __init__(self, name: str) -> None:
        self.name, self._buf, self._id = name, "", None

    def fresh(self) -> "NamedCallParser":
        return NamedCallParser(self.name)

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        out = []
        if self._id is None:
            self._id = ToolCall(self.name, "").id
            out.append(Delta(index=0, id=self._id, name=self.name))
        return out + [Delta(index=0, arguments=text)]

    def finish(self) -> list[Delta]:
        self._id = None
        return []


class CallListParser(_StreamParser):
    """The output of `tool_choice="required"`, generated under `tools.required_schema`: a JSON
    array of `{"name": ..., "parameters": {...}}` objects. Each call is released once its object
    is complete, `arguments` the parameters' `json.dumps`; what is not a complete call (an output
    cut short, anything not in that shape) stays content, verbatim."""

    _DECODER = json.JSONDecoder()

    def __init__(self) -> None:
        self._buf, self._state, self._calls = "", "start", itertools.count()  # start/items/text

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        if self._state == "start":
            head = self._buf.lstrip()
            if not head:
                return out
            self._state = "items" if head[0] == "[" else "text"
            if self._state == "items":
                self._buf = head[1:]
        while self._state == "items":
            rest = self._buf.lstrip().lstrip(",").lstrip()
            if rest.startswith("]") or not rest:
                return out
            try:
                item, end = self._DECODER.raw_decode(rest)
            except ValueError:
                return out  # not complete yet
            call = self._call_of(item)
            if call is None:  # not a call: the rest of the output is content
                self._state = "text"
                break
            self._buf = rest[end:]
            i = next(self._calls)
            out += [Delta(index=i, id=call.id, name=call.name),
                    Delta(index=i, arguments=call.arguments)]
        if self._state == "text" and self._buf:
            out.append(Delta(content=self._buf))
            self._buf = ""
        return out

    @staticmethod
    def _call_of(item: object) -> ToolCall | None:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                and isinstance(item.get("parameters"), dict)):
            return None
        return ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))

    def finish(self) -> list[Delta]:
        """What is left: the closing bracket (a marker), or text that was no call, as content."""
        rest, state = self._buf, self._state
        self.__init__()
        if state == "items" and rest.strip() == "]":
            return []
        return [Delta(content=rest)] if rest else []


class OutputParser:
    """A chat output's whole split: the reasoning parser's (if any) reasoning, then its answer
    through the tool parser (if any), so calls are parsed from the answer only. The module's
    invariants hold for it as for its parts; `called` says whether a call was released."""

    def __init__(self, reasoning: ThinkReasoningParser | None, tools: _StreamParser | None) -> None:
        self.reasoning, self.tools, self.called = reasoning, tools, False

    def feed(self, text: str) -> list[Delta]:
        return self._answer(self.reasoning.feed(text) if self.reasoning else [Delta(content=text)])

    def finish(self) -> list[Delta]:
        out = self._answer(self.reasoning.finish() if self.reasoning else [])
        return out + self._calls(self.tools.finish() if self.tools else [])

    def parse(self, text: str) -> Parsed:
        """The whole output split (by fresh parts)."""
        fresh = OutputParser(self.reasoning and self.reasoning.fresh(),
                             self.tools and self.tools.fresh())
        return _collect([*fresh.feed(text), *fresh.finish()])

    def _answer(self, deltas: list[Delta]) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            if d.reasoning:
                out.append(d)
            if d.content:
                out += self._calls(self.tools.feed(d.content)) if self.tools else [d]
        return out

    def _calls(self, deltas: list[Delta]) -> list[Delta]:
        self.called = self.called or any(d.index is not None for d in deltas)
        return deltas


def _collect(deltas: list[Delta]) -> Parsed:
    """The whole output of a parser's deltas (the streaming-equals-whole invariant's other side)."""
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        if d.index is not None:
            entry = calls.setdefault(d.index, [d.id, d.name, ""])
            entry[2] += d.arguments
    return Parsed(content if content.strip() else None, reasoning or None,
                  tuple(ToolCall(name, args, id) for id, name, args in calls.values()))


TOOL_PARSERS: dict[str, type[HermesToolParser]] = {"hermes": HermesToolParser}
REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "qwen3": ThinkReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser}


def tool_parser(name: str) -> HermesToolParser:
    """A fresh parser of the registry's `name`; ValueError naming the known ones."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()


def reasoning_parser(name: str) -> ThinkReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                         f"got {name!r}")
    return REASONING_PARSERS[name]()
