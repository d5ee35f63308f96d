"""Chat templates sent with a request (--trust-request-chat-template): client code,
rendered so that none can stall or bloat the server.

They render in one persistent worker process, never on the event loop nor in the
server's process, with transformers' own renderer (render_jinja_template: jinja2's
ImmutableSandboxedEnvironment as in `tokenizer.apply_chat_template`), under a wall
clock, an output size and an address-space limit.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import resource
import signal

_STARTUP_TIMEOUT_S = 120.0  # a worker imports transformers, and torch through pagedrag


class TemplateError(ValueError):
    """A request's chat template failed, was too slow or too large: the client's fault (HTTP 400)."""


class RequestTemplateRenderer:
    """Renders request-supplied chat templates in one worker process, one at a time.

    timeout_s (2.0): a render that takes longer is killed with its worker.
    max_output_chars (1,000,000): the most characters of a rendered prompt, and of any
        string or list that `*`, `**` or `+` would build inside the template.
    memory_headroom_bytes (2 GiB): the worker's address space may grow this far over
        its size after start-up (RLIMIT_AS); past it allocations raise MemoryError.

    Invariant: a worker is reused only after it answered its last request; any other
    outcome (timeout, death, cancellation) kills it, and the next render starts a new
    one. Renders wait on an asyncio.Lock, so a slow template delays other template
    requests by at most timeout_s, plus a worker start after a kill.
    """

    def __init__(self, timeout_s: float = 2.0, max_output_chars: int = 1_000_000,
                 memory_headroom_bytes: int = 2 * 1024**3):
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.memory_headroom_bytes = memory_headroom_bytes
        self._lock = asyncio.Lock()
        self._process = None  # the worker (multiprocessing.Process), started by the first render
        self._conn = None  # our end of its pipe

    async def render(self, template: str, conversation: list[dict], add_generation_prompt: bool,
                     special_tokens: dict[str, str], kwargs: dict) -> str:
        """The prompt text `template` makes of `conversation`; special_tokens (bos_token,
        eos_token, ...) and kwargs (chat_template_kwargs, which win) are template variables.

        Raises TemplateError for any template failure or exceeded limit.
        """
        variables = {**special_tokens, **kwargs}
        variables.pop("chat_template", None)  # vLLM lets chat_template_kwargs carry the template itself
        request = (template, conversation, add_generation_prompt, variables)
        loop = asyncio.get_running_loop()
        async with self._lock:
            if self._process is None or not self._process.is_alive():
                self._discard()  # died while idle: start afresh rather than fail this request
                # Assigned only once ready, so a render cancelled here leaves no half-started worker
                self._process, self._conn = await loop.run_in_executor(None, self._spawn)
            try:  # a thread waits on the pipe, so the event loop never does
                status, value = await loop.run_in_executor(None, _exchange, self._conn, request,
                                                           self.timeout_s)
            except BaseException:  # timeout, worker death, cancellation: its state is unknown
                self._discard()
                raise
        if status == "error":
            raise TemplateError(value)
        return value

    def close(self) -> None:
        """Stop the worker; a later render starts a new one."""
        self._discard()

    def _spawn(self):
        """A ready worker and our end of its pipe (runs in a thread: a start takes seconds)."""
        context = multiprocessing.get_context("spawn")  # forking a server with threads and CUDA is unsafe
        conn, child = context.Pipe()
        process = context.Process(target=_serve, name="pagedrag-chat-template", daemon=True,
                                  args=(child, self.max_output_chars, self.memory_headroom_bytes))
        process.start()
        child.close()  # else the worker's death would never show as EOF here
        try:
            if conn.poll(_STARTUP_TIMEOUT_S) and conn.recv() == "ready":
                return process, conn
        except (EOFError, OSError):  # it died starting; its traceback is on stderr
            pass
        process.kill()
        process.join(5)
        raise RuntimeError("the chat template worker did not start")

    def _discard(self) -> None:
        """Kill the worker, if any. Its pipe is dropped, not closed: a thread may still wait
        on it (closing a descriptor under it risks a reused number); the thread sees EOF."""
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        self._process = self._conn = None


def _exchange(conn, request: tuple, timeout_s: float) -> tuple[str, str]:
    """Send one request and wait for its reply; TemplateError past timeout_s or if the worker dies."""
    try:
        conn.send(request)
        if conn.poll(timeout_s):
            return conn.recv()
    except (EOFError, OSError) as error:
        raise TemplateError("the chat template worker died while rendering") from error
    raise TemplateError(f"the chat template took longer than the limit of {timeout_s} s "
                        "(timeout_s) to render and was stopped")


def _serve(conn, max_output_chars: int, memory_headroom_bytes: int) -> None:
    """The worker: replies ("ok", text) or ("error", message) to each request until the server goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the server, which ends us
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
    from transformers.utils import chat_template_utils

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """transformers' sandbox, refusing a `*`, `**` or `+` result over max_output_chars before
        building it (filters and `~` are not intercepted: the address-space cap stops those)."""
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            if (size := _result_size(operator, left, right)) > max_output_chars:
                raise SecurityError(f"'{operator}' would build a value of about {size} characters "
                                    f"or items, over the limit of {max_output_chars} (max_output_chars)")
            return super().call_binop(context, operator, left, right)

    # transformers builds its environment from this module global; no template was compiled yet
    chat_template_utils.ImmutableSandboxedEnvironment = BoundedSandbox
    with open("/proc/self/statm") as statm:  # the address space now, after the imports
        limit = int(statm.read().split()[0]) * resource.getpagesize() + memory_headroom_bytes
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    conn.send("ready")
    while True:
        try:
            template, conversation, add_generation_prompt, variables = conn.recv()
        except EOFError:
            return  # the server dropped its end
        try:
            (text,), _ = chat_template_utils.render_jinja_template(**{
                **variables, "conversations": [conversation], "chat_template": template,
                "add_generation_prompt": add_generation_prompt})
            if len(text) > max_output_chars:
                raise ValueError(f"the rendered prompt has {len(text)} characters, over the limit "
                                 f"of {max_output_chars} (max_output_chars)")
            reply = ("ok", text)
        except MemoryError:  # its message is empty
            reply = ("error", f"MemoryError: the template needed more than the limit of "
                              f"{memory_headroom_bytes} bytes (memory_headroom_bytes)")
        except Exception as error:  # jinja's errors, RecursionError, transformers' checks
            reply = ("error", f"{type(error).__name__}: {error}")
        conn.send(reply)


def _result_size(operator: str, left, right) -> int:
    """About how many characters, items or digits `left <operator> right` has; 0 if cheap."""
    sized = (str, list, tuple)
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, sized) and isinstance(count, int):
                return len(sequence) * max(count, 0)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return (abs(left).bit_length() - 1) * right // 3  # decimal digits, about bits / 3.3
    return 0
