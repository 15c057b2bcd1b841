"""A small fake OpenAI-compatible chat endpoint for tests, on 127.0.0.1 only.

``FakeChat`` serves ``POST <any prefix>/chat/completions`` (and ``/completions``,
answered alike) from a thread:
it evaluates the arithmetic in the last user message and answers it (or answers
wrong, or with no number, or fails with HTTP 500, per ``mode``), and records
every request's method, path, headers and body (whatever the method or path, so
tests can assert that nothing reached it). ``base_url`` is what a
rollout's ``chat_completions_url`` should be (clients append ``/chat/completions``).

A request with ``"stream": true`` gets server-sent events as OpenAI sends them
(a role/content chunk, a finish chunk, a usage chunk when
``stream_options.include_usage`` is set, then ``[DONE]``); while ``stream_gate``
is set and not released, the stream pauses after its first chunk. ``padding``
adds that many bytes to the answer's content (in 1 KiB chunks when streaming);
``usage_extra`` is merged into every answer's ``usage`` (e.g. cached tokens, a cost).

``ScriptedChat(replies)``, the same server for Harbor's agents, answers each chat call
with the next scripted assistant content (the last one repeats once they run out; a reply
that is a dict is the whole assistant message, e.g. ``tool_call_reply``'s). With
``token_ids=True`` every answer also carries vLLM's fields (``prompt_token_ids``,
``choices[0].token_ids`` and ``choices[0].logprobs.content``), which terminus-2's
``collect_rollout_details`` reads; ``ids_of(i)`` are the ones answer ``i`` carried. With
``cached_tokens`` every ``usage`` also says that many prompt tokens were cached. With
``per_conversation=True`` the script restarts for each conversation (the reply is the one
for the number of assistant messages the request holds), so several agents can share one
endpoint at once, and an answer's ``id`` is that step's (``chatcmpl-<step>``). A streamed
request (opencode's) gets the same answer as chunks: the message as one delta, then the
finish reason, then ``usage``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

__all__ = [
    "ChatRequest",
    "FakeChat",
    "Mode",
    "ScriptedChat",
    "env_value_sent_back",
    "solve",
    "terminus_reply",
    "tool_call_reply",
]

# "unauthorized" answers 401 quoting the Authorization header it got, as careless servers do.
Mode = Literal["correct", "wrong", "no_answer", "error", "slow", "unauthorized"]

_OPS: dict[type[ast.operator], Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_EXPRESSION = re.compile(r"[-+*/().\d\s]+")


def _eval(node: ast.expr) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return float(_OPS[type(node.op)](_eval(node.left), _eval(node.right)))
    raise ValueError("not arithmetic")


def solve(question: str) -> float:
    """The value of the longest arithmetic expression in ``question``."""
    candidates = sorted(
        (m.strip() for m in _EXPRESSION.findall(question) if any(c.isdigit() for c in m)),
        key=len,
        reverse=True,
    )
    for candidate in candidates:
        try:
            return _eval(ast.parse(candidate, mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError):
            continue
    raise ValueError(f"no arithmetic in {question!r}")


def _format(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


@dataclass(frozen=True)
class ChatRequest:
    """One request the endpoint received."""

    path: str
    authorization: str | None
    body: dict[str, Any]
    method: str = "POST"
    # (name, value) as received, names lowercased.
    headers: tuple[tuple[str, str], ...] = field(default=())


class _QuietServer(ThreadingHTTPServer):
    """Drops a reply the client hung up on (tests that time out or cancel a call do
    that on purpose) instead of printing its traceback; other errors still print."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeChat:
    """The endpoint; use as a context manager (starts and stops its server thread)."""

    URL_PREFIX = ""

    def __init__(self, mode: Mode = "correct") -> None:
        self.mode: Mode = mode
        self.requests: list[ChatRequest] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._release = threading.Event()
        self.stream_gate: threading.Event | None = None
        self.padding = 0
        self.usage_extra: dict[str, Any] = {}
        self._server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{self.URL_PREFIX}"

    @property
    def authorizations(self) -> list[str | None]:
        with self._lock:
            return [r.authorization for r in self.requests]

    def wait_for_requests(self, count: int, timeout: float) -> bool:
        """Block until ``count`` requests arrived (True) or ``timeout`` seconds passed."""
        with self._arrived:
            return self._arrived.wait_for(lambda: len(self.requests) >= count, timeout)

    def release_slow(self) -> None:
        """Let the requests "slow" mode holds answer now."""
        with self._lock:
            self._release.set()

    def reset(self, mode: Mode = "correct") -> None:
        with self._lock:
            self._release.set()  # let any request still held by "slow" finish
            self._release = threading.Event()
            self.mode = mode
            self.requests.clear()
            if self.stream_gate is not None:
                self.stream_gate.set()
            self.stream_gate = None
            self.padding = 0
            self.usage_extra = {}

    def __enter__(self) -> FakeChat:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if self.mode == "slow":
            # Hangs the workflow (bounded) so tests can cancel or time it out mid-run.
            with self._lock:
                release = self._release
            release.wait(timeout=60)
        if self.mode == "error":
            return 500, {"error": {"message": "fake chat told to fail", "type": "server_error"}}
        messages = body.get("messages") or []
        question = next(
            (str(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), ""
        )
        if self.mode == "no_answer":
            content = "I would rather not say."
        else:
            try:
                value = solve(question)
            except ValueError:
                content = "I only do arithmetic."
            else:
                content = _format(value + 1 if self.mode == "wrong" else value)
        return 200, {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": body.get("model", "fake"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": len(question.split()),
                "completion_tokens": 1,
                **self.usage_extra,
            },
        }

    def _events(self, body: dict[str, Any], answer: dict[str, Any]) -> Iterator[bytes]:
        """The SSE stream of ``answer``, paused after the first event while the gate is shut."""
        content = answer["choices"][0]["message"]["content"]
        base = {"id": answer["id"], "object": "chat.completion.chunk", "model": answer["model"]}

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return b"data: " + json.dumps({**base, "choices": choices, **extra}).encode() + b"\n\n"

        yield event([{"index": 0, "delta": {"role": "assistant", "content": content}}])
        for start in range(0, self.padding, 1024):
            filler = "x" * min(1024, self.padding - start)
            yield event([{"index": 0, "delta": {"content": filler}}])
        gate = self.stream_gate
        if gate is not None:
            gate.wait(timeout=30)
        yield event([{"index": 0, "delta": {}, "finish_reason": "stop"}])
        if (body.get("stream_options") or {}).get("include_usage"):
            yield event([], usage=answer["usage"])
        yield b"data: [DONE]\n\n"

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        chat = self

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> dict[str, Any] | None:
                """The JSON body, after recording the request (None: answered 400)."""
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) or b"{}"
                try:
                    body = json.loads(raw)
                except json.JSONDecodeError:
                    body = None
                headers = tuple((k.lower(), v) for k, v in self.headers.items())
                with chat._lock:
                    chat.requests.append(
                        ChatRequest(
                            self.path,
                            self.headers.get("Authorization"),
                            body if isinstance(body, dict) else {},
                            self.command,
                            headers,
                        )
                    )
                    chat._arrived.notify_all()
                if body is None:
                    self._reply(400, {"error": {"message": "body is not JSON"}})
                return body if isinstance(body, dict) else None

            def _other_method(self) -> None:
                if self._record() is not None:
                    self._reply(404, {"error": {"message": f"no route {self.path}"}})

            do_GET = do_DELETE = do_PUT = do_PATCH = do_HEAD = do_OPTIONS = _other_method

            def do_POST(self) -> None:
                body = self._record()
                if body is None:
                    return
                if chat.mode == "unauthorized":
                    quoted = self.headers.get("Authorization")
                    self._reply(401, {"error": {"message": f"Incorrect API key: {quoted}"}})
                    return
                # "/completions" too: the legacy route an operator may let through a relay.
                if not self.path.split("?")[0].rstrip("/").endswith("/completions"):
                    self._reply(404, {"error": {"message": f"no route {self.path}"}})
                    return
                status, answer = chat._answer(body)
                if status == 200 and chat.padding and not body.get("stream"):
                    answer["choices"][0]["message"]["content"] += "x" * chat.padding
                if status != 200 or not body.get("stream"):
                    self._reply(status, answer)
                    return
                # HTTP/1.0 and no length: the stream ends when the connection closes.
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                try:
                    for data in chat._events(body, answer):
                        self.wfile.write(data)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client (or a relay) cut the stream: expected in tests

            def _reply(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output quiet

        return Handler


def tool_call_reply(command: str, *, call_id: str, text: str = "Running a command.") -> Any:
    """An assistant message calling the ``bash`` tool (mini-swe-agent 2.x's format)."""
    return {
        "role": "assistant",
        "content": text,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": command})},
            }
        ],
    }


def terminus_reply(
    *, keystrokes: list[str] | None = None, task_complete: bool = False, duration: float = 0.3
) -> str:
    """An answer in terminus-2's JSON format."""
    return json.dumps(
        {
            "analysis": "Looking at the terminal.",
            "plan": "Do what the task asks." if keystrokes else "Finish.",
            "commands": [{"keystrokes": k, "duration": duration} for k in keystrokes or []],
            "task_complete": task_complete,
        }
    )


class ScriptedChat(FakeChat):
    """See module doc: the same server, answering from a script."""

    URL_PREFIX = "/v1"
    PROMPT_TOKENS = 11
    COMPLETION_TOKENS = 5

    def __init__(
        self,
        replies: list[Any],
        *,
        token_ids: bool = False,
        cached_tokens: int | None = None,
        per_conversation: bool = False,
    ) -> None:
        super().__init__()
        self.replies = list(replies)
        self.token_ids = token_ids
        self.cached_tokens = cached_tokens
        self.per_conversation = per_conversation
        self.answers: list[Any] = []
        #: Set once the first request arrived (tests wait on it, not on a poll).
        self.asked = threading.Event()

    def __enter__(self) -> ScriptedChat:
        super().__enter__()
        return self

    def ids_of(self, turn: int) -> tuple[list[int], list[int], list[float]]:
        """The prompt token ids, completion token ids and logprobs of answer ``turn``."""
        base = 1000 * (turn + 1)
        prompt = [base + i for i in range(self.PROMPT_TOKENS)]
        completion = [base + 500 + i for i in range(self.COMPLETION_TOKENS)]
        logprobs = [-0.1 * (i + 1) for i in range(self.COMPLETION_TOKENS)]
        return prompt, completion, logprobs

    def _answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            turn = len(self.answers)
            step = turn
            if self.per_conversation:
                messages = body.get("messages") or []
                step = sum(1 for m in messages if m.get("role") == "assistant")
            content = self.replies[min(step, len(self.replies) - 1)]
            self.answers.append(content)
        self.asked.set()
        message = (
            content if isinstance(content, dict) else {"role": "assistant", "content": content}
        )
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
        }
        answer: dict[str, Any] = {
            "id": f"chatcmpl-{step}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", "scripted"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": self.PROMPT_TOKENS,
                "completion_tokens": self.COMPLETION_TOKENS,
                "total_tokens": self.PROMPT_TOKENS + self.COMPLETION_TOKENS,
            },
        }
        if self.cached_tokens is not None:
            answer["usage"]["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        if self.token_ids:
            prompt, completion, logprobs = self.ids_of(turn)
            answer["prompt_token_ids"] = prompt
            choice["token_ids"] = completion
            choice["logprobs"] = {
                "content": [
                    {"token": f"t{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                    for t, lp in zip(completion, logprobs, strict=True)
                ]
            }
        return 200, answer

    def _events(self, body: dict[str, Any], answer: dict[str, Any]) -> Iterator[bytes]:
        """``answer`` as the chunks of a stream: the message as one delta, the finish, usage."""
        choice = answer["choices"][0]
        delta = dict(choice["message"])
        if delta.get("tool_calls"):
            delta["tool_calls"] = [
                {"index": i, **call} for i, call in enumerate(delta["tool_calls"])
            ]
        head = {k: answer[k] for k in ("id", "created", "model")}
        head["object"] = "chat.completion.chunk"
        for event in (
            {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            {
                **head,
                "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
            },
            {**head, "choices": [], "usage": answer["usage"]},
        ):
            yield b"data: " + json.dumps(event).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


def env_value_sent_back(messages: list[dict[str, Any]], name: str) -> str | None:
    """``name``'s value in the ``env`` output a tool message carried back to the model
    (plain text, or a JSON ``{"output": ...}`` as mini-swe-agent sends it)."""
    for message in messages:
        if message.get("role") != "tool":
            continue
        content = message.get("content")
        text = content if isinstance(content, str) else json.dumps(content)
        try:
            output = str(json.loads(text)["output"])
        except (ValueError, KeyError, TypeError):
            output = text
        for line in output.splitlines():
            if line.startswith(f"{name}="):
                return line.partition("=")[2]
    return None
