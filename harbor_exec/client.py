"""RolloutClient and RolloutHandle: submit rollouts over HTTP and await their results.

The API matches osmosis-ai 0.3.8's client (so harnesses can switch by changing
imports) and works against any server speaking that protocol. Two flaws of
the reference are fixed:

* **No busy loop.** The reference re-polls ``/result`` at once after every
  in-progress answer, which spins against a server that does not long-poll.
  Here, an in-progress answer that came back quickly (under a second, or half
  the server's wait) *without forward progress* (queued < running < grading)
  is followed by a pause that doubles from 50 ms up to 2 s (never more than a
  quarter of the lease). Progress, or a poll that really parked, resets the
  pause; progress can happen at most three times, so flip-flopping or
  ``unknown`` statuses cannot make it spin either.
* **``wait_for_running``/``wait_for_grading`` return promptly.** On the
  reference server a poll made while ``running`` parks until grading or the
  end, so waiting for ``running`` through ``/result`` alone can stall for the
  whole long-poll wait. Our server marks its 202 with ``X-Harbor-Exec-Features:
  status-wait``; then these waits also long-poll ``GET /rollout/{id}/status``
  (``?status=<seen>&wait=<sec>``), which answers as soon as the status moves.
  Against other servers they fall back to the ``/result`` polling.

HTTP goes through aiohttp (``harbor_exec._client_http``: a fraction of httpx's
CPU per request, which is the trainer's cost), or through the
``httpx.AsyncClient`` given as ``http_client``. Either way transport failures
raise httpx's exception classes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Generator
from time import monotonic
from typing import Any, Final, ParamSpec

import httpx
from pydantic import ValidationError

from harbor_exec._client_http import (
    DEFAULT_TIMEOUT_SEC,
    Answer,
    HttpxTransport,
    Transport,
    default_transport,
)
from harbor_exec.errors import HarborExecError
from harbor_exec.protocol import (
    FEATURES_HEADER,
    POLLING_LEASE_HEADER,
    STATUS_WAIT_FEATURE,
    TERMINAL_STATUSES,
    CancelRolloutsRequest,
    CancelRolloutsResponse,
    MessageDict,
    RolloutInitRequest,
    RolloutInitResponse,
    RolloutLifecycle,
    RolloutResultResponse,
    RolloutStatus,
)

__all__ = [
    "RolloutAdmissionTimeoutError",
    "RolloutClient",
    "RolloutHandle",
    "RolloutProtocolError",
]

logger = logging.getLogger(__name__)

P = ParamSpec("P")

_RETRY_AFTER_MIN_SEC: Final = 0.05
_RETRY_AFTER_MAX_SEC: Final = 60.0
_RETRY_AFTER_DEFAULT_SEC: Final = 1.0
_CANCEL_TIMEOUT_SEC: Final = 5.0
_READ_GRACE_SEC: Final = 10.0
_TRANSPORT_RETRY_DELAYS_SEC: Final = (0.1, 0.5)
_GATEWAY_RETRY_DELAYS_SEC: Final = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
_GATEWAY_STATUS_CODES: Final = frozenset({502, 503, 504})
_IDLE_RETRY_STATUS_CODES: Final = frozenset({408, 429, 500, 502, 503, 504})
_BACKOFF_START_SEC: Final = 0.05
_BACKOFF_MAX_SEC: Final = 2.0
# An unchanged status answered faster than this means the server did not park.
_QUICK_ANSWER_MAX_SEC: Final = 1.0
_STATUS_ORDER: Final = {
    RolloutStatus.QUEUED: 0,
    RolloutStatus.RUNNING: 1,
    RolloutStatus.GRADING: 2,
    RolloutStatus.SUCCESS: 3,
    RolloutStatus.FAILURE: 3,
    RolloutStatus.CANCELLED: 3,
}
_JSON_HEADERS: Final = {"Content-Type": "application/json"}


class RolloutAdmissionTimeoutError(HarborExecError, TimeoutError):
    """``POST /rollout`` kept answering 429 until ``admission_timeout_sec`` ran out."""


class RolloutProtocolError(HarborExecError, RuntimeError):
    """The server answered something the protocol does not allow here (see ``status_code``)."""

    def __init__(self, message: str, *, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


def _reached(status: RolloutStatus, target: RolloutStatus) -> bool:
    return _STATUS_ORDER.get(status, -1) >= _STATUS_ORDER[target]


class _Backoff:
    """Pause before re-polling after a quick, unchanged in-progress answer."""

    def __init__(self, cap: float) -> None:
        self.cap = cap
        self.delay = 0.0

    def next_delay(self, *, changed: bool, elapsed: float, quick_threshold: float) -> float:
        if changed or elapsed >= quick_threshold:
            self.delay = 0.0
        else:
            self.delay = min(self.cap, max(_BACKOFF_START_SEC, self.delay * 2))
        return self.delay


class RolloutHandle:
    """An admitted rollout. Awaiting it returns the final ``RolloutResultResponse``.

    Polling starts at once. ``status`` and ``latest_result`` follow the polls;
    ``status_changed`` is notified on each update. ``cancel()`` stops only the
    local polling; use ``RolloutClient.cancel_rollout`` to cancel the work.
    """

    def __init__(
        self,
        client: RolloutClient,
        admission: RolloutInitResponse,
        *,
        lease_deadline: float | None = None,
        status_wait: bool = False,
    ) -> None:
        self.rollout_id = admission.rollout_id
        self.status: RolloutStatus = admission.status
        self.latest_result: RolloutResultResponse | None = None
        self.status_changed = asyncio.Condition()
        self.polling_finished = False
        self.supports_status_wait = status_wait
        # Set when /status reported a terminal status before /result delivered it.
        self._finished_hint = False
        self._client = client
        self._admission = admission
        self.result_task: asyncio.Task[RolloutResultResponse] = asyncio.create_task(
            self._poll_until_final(
                lease_deadline
                if lease_deadline is not None
                else monotonic() + admission.polling_lease_timeout_sec
            )
        )

    def __await__(self) -> Generator[Any, None, RolloutResultResponse]:
        return self.result_task.__await__()

    def done(self) -> bool:
        return self.result_task.done()

    def cancel(self) -> bool:
        """Stop polling locally (no request is sent)."""
        return self.result_task.cancel()

    async def wait_for_completion(self) -> RolloutResultResponse:
        return await self.result_task

    async def wait_for_running(self) -> RolloutStatus:
        """Return once the rollout is running, grading or finished."""
        return await self._wait_for_status(RolloutStatus.RUNNING)

    async def wait_for_grading(self) -> RolloutStatus:
        """Return once the rollout is grading or finished."""
        return await self._wait_for_status(RolloutStatus.GRADING)

    async def _set_status(
        self, status: RolloutStatus, result: RolloutResultResponse | None
    ) -> None:
        async with self.status_changed:
            if result is not None:
                self.latest_result = result
            # Status only moves forward (answers to concurrent requests may arrive
            # out of order), and becomes terminal only with its result.
            if (result is not None and status in TERMINAL_STATUSES) or (
                _STATUS_ORDER.get(status, -1) > _STATUS_ORDER.get(self.status, -1)
            ):
                self.status = status
            self.status_changed.notify_all()

    async def _wait_for_status(self, target: RolloutStatus) -> RolloutStatus:
        watcher = (
            asyncio.create_task(self._watch_status(target))
            if self.supports_status_wait and not _reached(self.status, target)
            else None
        )
        try:
            async with self.status_changed:
                await self.status_changed.wait_for(
                    lambda: (
                        _reached(self.status, target)
                        or self.polling_finished
                        or self._finished_hint
                    )
                )
                current = self.status
        finally:
            if watcher is not None:
                watcher.cancel()
        if _reached(current, target):
            return current
        return (await self.result_task).status

    async def _watch_status(self, target: RolloutStatus) -> None:
        """Long-poll ``/status`` until ``target`` is reached (harbor-exec servers only)."""
        wait = self._admission.result_wait_timeout_sec
        backoff = _Backoff(min(_BACKOFF_MAX_SEC, wait))
        try:
            while not _reached(self.status, target):
                seen = self.status
                started = monotonic()
                state = await self._client.rollout_status(self.rollout_id, seen=seen, wait_sec=wait)
                status = RolloutStatus(state["status"])
                if status in TERMINAL_STATUSES:
                    # The /result poll delivers the result itself; just wake the waiter.
                    self._finished_hint = True
                    await self._set_status(self.status, None)
                    return
                await self._set_status(status, None)
                delay = backoff.next_delay(
                    changed=_STATUS_ORDER.get(status, -1) > _STATUS_ORDER.get(seen, -1),
                    elapsed=monotonic() - started,
                    quick_threshold=min(_QUICK_ANSWER_MAX_SEC, wait / 2),
                )
                if delay:
                    await asyncio.sleep(delay)
        except (httpx.HTTPError, RolloutProtocolError, KeyError, ValueError):
            # Only a shortcut: the /result polling still reports the status.
            logger.debug("status watch for %s stopped", self.rollout_id, exc_info=True)

    async def _poll_until_final(self, lease_deadline: float) -> RolloutResultResponse:
        admission = self._admission
        wait = admission.result_wait_timeout_sec
        backoff = _Backoff(min(_BACKOFF_MAX_SEC, admission.polling_lease_timeout_sec / 4))
        quick = min(_QUICK_ANSWER_MAX_SEC, wait / 2)
        previous = admission.status
        try:
            while True:
                started = monotonic()
                result, lease_deadline = await self._client._get_result(
                    admission, lease_deadline=lease_deadline
                )
                await self._set_status(result.status, result)
                if result.status in TERMINAL_STATUSES:
                    return result
                # Only forward progress earns an immediate re-poll: at most three
                # times per rollout, so a server flip-flopping between statuses
                # (or answering "unknown") is backed off like any quick answer.
                progressed = _STATUS_ORDER.get(result.status, -1) > _STATUS_ORDER.get(previous, -1)
                if progressed:
                    previous = result.status
                delay = backoff.next_delay(
                    changed=progressed,
                    elapsed=monotonic() - started,
                    quick_threshold=quick,
                )
                if delay:
                    await asyncio.sleep(delay)
        finally:
            async with self.status_changed:
                self.polling_finished = True
                self.status_changed.notify_all()


def _retry_after(response: Answer) -> float:
    raw = response.headers.get("Retry-After")
    try:
        value = float(raw) if raw is not None else _RETRY_AFTER_DEFAULT_SEC
    except ValueError:
        return _RETRY_AFTER_DEFAULT_SEC
    if not math.isfinite(value):
        return _RETRY_AFTER_DEFAULT_SEC
    return min(max(_RETRY_AFTER_MIN_SEC, value), _RETRY_AFTER_MAX_SEC)


def _expect(response: Answer, status_code: int, route: str) -> None:
    if response.status_code != status_code:
        raise RolloutProtocolError(
            f"{route} returned {response.status_code}: {response.text[:500]}",
            status_code=response.status_code,
        )


def _waiting_for_result(
    submit: Callable[P, Awaitable[RolloutHandle]],
) -> Callable[P, Coroutine[Any, Any, RolloutResultResponse]]:
    """``run_rollout`` from ``run_rollout_async``: the same parameters, then it awaits
    the handle."""

    async def run_rollout(*args: P.args, **kwargs: P.kwargs) -> RolloutResultResponse:
        """Submit a rollout and wait for its final result."""
        handle = await submit(*args, **kwargs)
        return await handle

    # What help() and IDEs show: submit's parameters, this function's result.
    run_rollout.__signature__ = inspect.signature(submit).replace(  # type: ignore[attr-defined]
        return_annotation=RolloutResultResponse.__name__
    )
    return run_rollout


class RolloutClient:
    """Client of a rollout server (ours or osmosis-ai 0.3.8's).

    ``admission_timeout_sec`` bounds the 429 retries of ``run_rollout_async``
    (None: unbounded). ``api_key`` is sent as a bearer token on every request.
    Requests go through aiohttp unless you pass an ``http_client``
    (``httpx.AsyncClient``), which is then used for every request and not closed
    by ``aclose``.
    """

    def __init__(
        self,
        *,
        url: str,
        http_client: httpx.AsyncClient | None = None,
        admission_timeout_sec: float | None = None,
        api_key: str | None = None,
    ) -> None:
        if admission_timeout_sec is not None and not math.isfinite(admission_timeout_sec):
            raise ValueError("admission_timeout_sec must be finite; omit it to wait unbounded")
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key must be non-empty when given")
        self.url = url.rstrip("/")
        self.owns_http_client = http_client is None
        self._http: Transport = (
            default_transport(self.url)
            if http_client is None
            else HttpxTransport(http_client, owned=False)
        )
        self._spare_http_client: httpx.AsyncClient | None = None
        self.admission_timeout_sec = admission_timeout_sec
        self._auth: dict[str, str] = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._json_headers = {**self._auth, **_JSON_HEADERS}

    @property
    def http_client(self) -> httpx.AsyncClient:
        """The ``httpx.AsyncClient`` passed in. Without one, the client's own calls go
        through aiohttp and this is a separate httpx client, made on first access
        and closed by ``aclose`` (kept for code that used it directly)."""
        if isinstance(self._http, HttpxTransport):
            return self._http.client
        if self._spare_http_client is None:
            self._spare_http_client = httpx.AsyncClient()
        return self._spare_http_client

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()
        if self._spare_http_client is not None:
            await self._spare_http_client.aclose()

    # ------------------------------------------------------------------ rollouts

    async def run_rollout_async(
        self,
        initial_messages: list[MessageDict],
        chat_completions_url: str,
        rollout_id: str,
        llm_api_key: str | None = None,
        label: str | None = None,
        metadata: dict[str, Any] | None = None,
        grade: bool = True,
        agent_timeout_sec: float | None = None,
        grader_timeout_sec: float | None = None,
        extra_fields: dict[str, Any] | None = None,
    ) -> RolloutHandle:
        """Submit a rollout (retrying 429 within ``admission_timeout_sec``); returns its handle.

        Raises ``ValidationError`` locally for a bad request, ``RolloutProtocolError``
        for any answer but 202/429 (409, 422, 401, 503 ...), and
        ``RolloutAdmissionTimeoutError`` when the server stayed full.
        """
        request = RolloutInitRequest(
            initial_messages=initial_messages,
            label=label,
            metadata=metadata,
            rollout_id=rollout_id,
            chat_completions_url=chat_completions_url,
            llm_api_key=llm_api_key,
            grade=grade,
            agent_timeout_sec=agent_timeout_sec,
            grader_timeout_sec=grader_timeout_sec,
            extra_fields=extra_fields,
        )
        body = request.model_dump_json().encode()
        url = f"{self.url}/rollout"
        deadline = asyncio.timeout(self.admission_timeout_sec)
        in_flight = False
        try:
            async with deadline:
                while True:
                    in_flight = True
                    started = monotonic()
                    response = await self._http.request(
                        "POST", url, content=body, headers=self._json_headers
                    )
                    in_flight = False
                    if response.status_code != 429:
                        break
                    await asyncio.sleep(_retry_after(response))
        except TimeoutError as exc:
            if not deadline.expired():
                raise
            message = (
                f"admission of rollout {rollout_id} timed out after "
                f"{self.admission_timeout_sec} seconds"
            )
            if in_flight:
                message += (
                    "; admission may have succeeded; the server cancels an unpolled "
                    "rollout when its polling lease expires"
                )
            raise RolloutAdmissionTimeoutError(message) from exc
        _expect(response, 202, "POST /rollout")
        try:
            admission = RolloutInitResponse.model_validate_json(response.content)
        except ValidationError as exc:
            raise RolloutProtocolError(
                "POST /rollout returned an invalid response", status_code=202
            ) from exc
        if admission.rollout_id != rollout_id:
            raise RolloutProtocolError(
                "POST /rollout returned a different rollout_id", status_code=202
            )
        features = response.headers.get(FEATURES_HEADER, "")
        return RolloutHandle(
            self,
            admission,
            lease_deadline=started + admission.polling_lease_timeout_sec,
            status_wait=STATUS_WAIT_FEATURE in features.split(","),
        )

    run_rollout = _waiting_for_result(run_rollout_async)

    async def _get_result(
        self, admission: RolloutInitResponse, *, lease_deadline: float
    ) -> tuple[RolloutResultResponse, float]:
        """One long-poll, with the reference's retries; returns the result and the
        renewed lease deadline (measured from when the request was sent)."""
        rollout_id = admission.rollout_id
        route = f"GET /rollout/{rollout_id}/result"
        url = f"{self.url}/rollout/{rollout_id}/result"
        headers = {**self._auth, POLLING_LEASE_HEADER: admission.polling_lease_token}
        read_timeout = admission.result_wait_timeout_sec + _READ_GRACE_SEC
        transport_delays = iter(_TRANSPORT_RETRY_DELAYS_SEC)
        gateway_delays = iter(_GATEWAY_RETRY_DELAYS_SEC)
        last_error: Exception | None = None
        while True:
            # After a failure the request may not have reached the server, so the
            # lease may not have been renewed: bound retries by the old deadline.
            bound = asyncio.timeout(
                max(0.0, lease_deadline - monotonic()) if last_error is not None else None
            )
            error: Exception
            try:
                async with bound:
                    started = monotonic()
                    response = await self._http.request(
                        "GET", url, headers=headers, timeout=read_timeout
                    )
            except TimeoutError as exc:
                if bound.expired() and last_error is not None:
                    raise last_error from exc
                raise
            except (httpx.RemoteProtocolError, httpx.NetworkError, httpx.ReadTimeout) as exc:
                error = exc
                delay = next(transport_delays, None)
            else:
                if response.status_code == 200:
                    result = _parse_result(response, rollout_id, route)
                    return result, started + admission.polling_lease_timeout_sec
                error = RolloutProtocolError(
                    f"{route} returned {response.status_code}: {response.text[:500]}",
                    status_code=response.status_code,
                )
                if response.status_code not in _GATEWAY_STATUS_CODES:
                    raise error
                delay = next(gateway_delays, None)
            if delay is None or monotonic() + delay + read_timeout >= lease_deadline:
                raise error
            logger.warning("retrying %s in %.2fs after %r", route, delay, error)
            await asyncio.sleep(delay)
            if monotonic() + read_timeout >= lease_deadline:
                raise error
            last_error = error

    async def cancel_rollout(self, rollout_id: str) -> CancelRolloutsResponse:
        """Cancel one rollout on the server (the whole call is bounded to 5 s)."""
        body = CancelRolloutsRequest(ids=[rollout_id]).model_dump_json().encode()
        async with asyncio.timeout(_CANCEL_TIMEOUT_SEC):
            response = await self._http.request(
                "POST",
                f"{self.url}/rollout/cancel",
                content=body,
                headers=self._json_headers,
                timeout=_CANCEL_TIMEOUT_SEC,
            )
        _expect(response, 200, "POST /rollout/cancel")
        try:
            return CancelRolloutsResponse.model_validate_json(response.content)
        except ValidationError as exc:
            raise RolloutProtocolError(
                "POST /rollout/cancel returned an invalid response", status_code=200
            ) from exc

    # ------------------------------------------------------------------ server state

    async def health(self) -> dict[str, Any]:
        """``GET /health`` as a dict."""
        return await self._get_object("/health")

    async def rollout_status(
        self, rollout_id: str, *, seen: RolloutStatus | None = None, wait_sec: float | None = None
    ) -> dict[str, Any]:
        """``GET /rollout/{id}/status`` (harbor-exec servers): ``{rollout_id, status,
        reward, err_message, err_category}``; with ``seen`` and ``wait_sec`` it
        long-polls until the status differs from ``seen``."""
        params: dict[str, str] = {}
        timeout: float | None = None
        if seen is not None and wait_sec:
            params = {"status": seen.value, "wait": repr(float(wait_sec))}
            timeout = wait_sec + _READ_GRACE_SEC
        return await self._get_object(f"/rollout/{rollout_id}/status", params, timeout)

    async def queue_info(self) -> dict[str, Any]:
        """``GET /queue`` (harbor-exec servers): queued, running, capacity, max_queue_depth."""
        return await self._get_object("/queue")

    async def prewarm(self, task_ids: list[str] | None = None) -> dict[str, Any]:
        """``POST /prewarm`` (harbor-exec servers) for ``task_ids``, or all tasks when None."""
        payload: dict[str, Any] = {"all": True} if task_ids is None else {"task_ids": task_ids}
        response = await self._http.request(
            "POST",
            f"{self.url}/prewarm",
            content=json.dumps(payload).encode(),
            headers=self._json_headers,
            timeout=None,
        )
        _expect(response, 200, "POST /prewarm")
        return _object(response, "POST /prewarm")

    async def wait_idle(
        self,
        *,
        timeout_sec: float = 120.0,
        poll_interval_sec: float = 1.0,
        process_id: str | None = None,
    ) -> dict[str, Any]:
        """Poll ``/health`` until no rollout is active; raises if the server restarted."""
        for value in (timeout_sec, poll_interval_sec):
            if not math.isfinite(value) or value <= 0:
                raise ValueError("wait_idle timeouts must be positive and finite")
        async with asyncio.timeout(timeout_sec):
            while True:
                try:
                    health = await self.health()
                except RolloutProtocolError as error:
                    if error.status_code not in _IDLE_RETRY_STATUS_CODES:
                        raise
                    await asyncio.sleep(poll_interval_sec)
                    continue
                except httpx.TransportError:
                    await asyncio.sleep(poll_interval_sec)
                    continue
                current = health.get("process_id")
                if not isinstance(current, str) or not current:
                    raise RolloutProtocolError("Server has no lifecycle identity", status_code=200)
                if process_id is not None and current != process_id:
                    raise RolloutProtocolError("Server restarted while waiting", status_code=200)
                process_id = current
                try:
                    lifecycle = RolloutLifecycle.model_validate(health.get("lifecycle"))
                except ValidationError as exc:
                    raise RolloutProtocolError(
                        "Server has no valid lifecycle state", status_code=200
                    ) from exc
                if lifecycle.active_rollouts == 0:
                    return health
                await asyncio.sleep(poll_interval_sec)

    async def _get_object(
        self,
        path: str,
        params: dict[str, str] | None = None,
        read_timeout_sec: float | None = None,
    ) -> dict[str, Any]:
        response = await self._http.request(
            "GET",
            f"{self.url}{path}",
            params=params,
            headers=self._auth,
            timeout=read_timeout_sec if read_timeout_sec is not None else DEFAULT_TIMEOUT_SEC,
        )
        _expect(response, 200, f"GET {path}")
        return _object(response, f"GET {path}")


def _object(response: Answer, route: str) -> dict[str, Any]:
    try:
        value = json.loads(response.content)
    except ValueError as exc:
        raise RolloutProtocolError(f"{route} returned invalid JSON", status_code=200) from exc
    if not isinstance(value, dict):
        raise RolloutProtocolError(
            f"{route} returned {type(value).__name__}, not an object", status_code=200
        )
    return value


def _parse_result(response: Answer, rollout_id: str, route: str) -> RolloutResultResponse:
    try:
        result = RolloutResultResponse.model_validate_json(response.content)
    except ValidationError as exc:
        raise RolloutProtocolError(
            f"{route} returned an invalid response", status_code=200
        ) from exc
    if result.rollout_id != rollout_id:
        raise RolloutProtocolError(f"{route} returned a different rollout_id", status_code=200)
    return result
