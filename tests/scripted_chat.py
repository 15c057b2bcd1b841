"""A scripted OpenAI-compatible chat endpoint on 127.0.0.1, for Harbor's agents.

``ScriptedChat(replies)`` answers each ``POST <prefix>/chat/completions`` with the
next scripted assistant content (the last one repeats once they run out; a reply that
is a dict is the whole assistant message, e.g. ``tool_call_reply``'s), and records
every request (path, Authorization, body). With ``token_ids=True`` every answer also
carries vLLM's fields (``prompt_token_ids``, ``choices[0].token_ids`` and
``choices[0].logprobs.content``), which terminus-2's ``collect_rollout_details``
reads; ``ids_of(i)`` are the ones answer ``i`` carried. With ``cached_tokens`` every
``usage`` also says that many prompt tokens were cached
(``prompt_tokens_details.cached_tokens``). With ``per_conversation=True`` the script
restarts for each conversation (the reply is the one for the number of assistant
messages the request holds), so several agents can share one endpoint at once, and
an answer's ``id`` is that step's (``chatcmpl-<step>``), the same in every
conversation, so agents that record it give the same trajectory wherever they run. A
request with ``"stream": true`` (opencode's) gets the same answer as an SSE stream of
chunks (the message as one delta, then the finish reason, then ``usage``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "ScriptedChat",
    "ScriptedRequest",
    "env_value_sent_back",
    "terminus_reply",
    "tool_call_reply",
]


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


def _stream_events(answer: dict[str, Any]) -> list[dict[str, Any]]:
    """``answer`` (a chat completion) as the chunks of a stream."""
    choice = answer["choices"][0]
    delta = dict(choice["message"])
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    head = {k: answer[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    return [
        {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]},
        {**head, "choices": [], "usage": answer["usage"]},
    ]


@dataclass(frozen=True)
class ScriptedRequest:
    path: str
    authorization: str | None
    body: dict[str, Any]


class ScriptedChat:
    """See module doc; a context manager (starts and stops its server thread)."""

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
        self.replies = list(replies)
        self.token_ids = token_ids
        self.cached_tokens = cached_tokens
        self.per_conversation = per_conversation
        self.requests: list[ScriptedRequest] = []
        self.answers: list[Any] = []
        #: Set once the first request arrived (tests wait on it, not on a poll).
        self.asked = threading.Event()
        self._lock = threading.Lock()
        chat = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                answer = chat._answer(self.path, self.headers.get("authorization"), body)
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("cache-control", "no-cache")
                    self.end_headers()
                    for event in _stream_events(answer):
                        self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.close_connection = True
                    return
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def ids_of(self, turn: int) -> tuple[list[int], list[int], list[float]]:
        """The prompt token ids, completion token ids and logprobs of answer ``turn``."""
        base = 1000 * (turn + 1)
        prompt = [base + i for i in range(self.PROMPT_TOKENS)]
        completion = [base + 500 + i for i in range(self.COMPLETION_TOKENS)]
        logprobs = [-0.1 * (i + 1) for i in range(self.COMPLETION_TOKENS)]
        return prompt, completion, logprobs

    def _answer(self, path: str, authorization: str | None, body: dict[str, Any]) -> Any:
        with self._lock:
            turn = len(self.requests)
            self.requests.append(ScriptedRequest(path, authorization, body))
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
        return answer

    def __enter__(self) -> ScriptedChat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


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
