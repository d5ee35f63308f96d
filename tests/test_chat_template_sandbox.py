"""RequestTemplateRenderer: a request's chat template renders as jinja2 would, and no
template can stall the event loop or grow the server's memory (no model, no network).

The tests share one renderer (a worker start imports transformers and torch) and run
in file order; the last one checks the server process's memory across all of them.
"""

import asyncio
import os
import signal
import time

import jinja2
import pytest

from pagedrag.server.chat_template import RequestTemplateRenderer, TemplateError

CHATML = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.first and message.role != 'system' %}"
    "<|im_start|>system\n{{ system_default }}<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "user", "content": "What is RAG?"},
                {"role": "assistant", "content": "Retrieval-augmented generation."},
                {"role": "user", "content": "Thanks"}]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def rss_bytes() -> int:
    """The resident memory of this (the server's) process."""
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def baseline_rss():
    return rss_bytes()


@pytest.fixture(scope="module")
def renderer(baseline_rss):
    renderer = RequestTemplateRenderer(timeout_s=1.0)
    yield renderer
    renderer.close()


def render(renderer, template, conversation=CONVERSATION, kwargs=None):
    return asyncio.run(renderer.render(template, conversation, True, SPECIAL, kwargs or {}))


def rejected(renderer, template, match, within_s=10.0):
    """Assert that `template` fails with TemplateError matching `match` within `within_s` seconds.
    The message names the check that refused it; the bound is generous (two suites may share
    the cores) and only catches a render that hangs instead of being refused."""
    start = time.monotonic()
    with pytest.raises(TemplateError, match=match):
        render(renderer, template)
    assert time.monotonic() - start < within_s


def test_chatml_renders_as_jinja2_does(renderer):
    kwargs = {"system_default": "You are helpful."}
    expected = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHATML).render(
        messages=CONVERSATION, add_generation_prompt=True, **SPECIAL, **kwargs)
    assert render(renderer, CHATML, kwargs=kwargs) == expected
    assert expected.startswith("<s><|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n")
    # chat_template_kwargs may carry the template itself (vLLM): it is not a variable
    assert render(renderer, CHATML, kwargs={**kwargs, "chat_template": "ignored"}) == expected


def test_string_repetition_is_refused_before_it_is_built(renderer):
    rejected(renderer, "{{ 'A ' * 3000000 }}", "max_output_chars")
    rejected(renderer, "{{ [0] * 100000000 }}", "max_output_chars")
    rejected(renderer, "{{ 10 ** 100000000 }}", "max_output_chars")


def test_output_over_the_limit_is_refused(renderer):
    # No single operator is large: the loops write 2,000,000 characters
    rejected(renderer, "{% for i in range(1000) %}{% for j in range(1000) %}xx{% endfor %}{% endfor %}",
             "2000000 characters, over the limit of 1000000")


def test_huge_allocation_fails_on_the_memory_limit(renderer):
    rejected(renderer, "{{ 'x' | center(3000000000) }}", "memory_headroom_bytes")


def test_slow_template_is_killed_and_the_loop_keeps_running(renderer):
    async def main():
        gaps, last = [], time.monotonic()

        async def ticker():
            nonlocal last
            while True:
                await asyncio.sleep(0.01)
                gaps.append(time.monotonic() - last)
                last = time.monotonic()

        ticking = asyncio.create_task(ticker())
        start = time.monotonic()
        with pytest.raises(TemplateError, match="timeout_s"):
            await renderer.render(NESTED, CONVERSATION, True, SPECIAL, {})
        elapsed = time.monotonic() - start
        ticking.cancel()
        return elapsed, max(gaps)

    elapsed, longest_gap = asyncio.run(main())
    assert 1.0 <= elapsed < 30.0  # the 1 s limit held (generous: a loaded machine is slow to notice)
    assert longest_gap < 0.9  # the event loop never waited on the template (a wait would be >= 1 s)
    assert render(renderer, CHATML, kwargs={"system_default": "S"}).startswith("<s><|im_start|>system\nS")


@pytest.mark.parametrize("template, match", [
    ("{% if %}", "TemplateSyntaxError: Expected an expression"),
    ("{{ raise_exception('Conversation roles must alternate') }}", "Conversation roles must alternate"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'"),
    ("{{ messages.__class__.__base__.__subclasses__() }}", "SecurityError"),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "SecurityError: .* '__init__'"),
    ("{{ undefined_function() }}", "UndefinedError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
])
def test_template_errors_become_template_errors(renderer, template, match):
    rejected(renderer, template, match)


def test_worker_that_died_is_restarted(renderer):
    render(renderer, CHATML)
    os.kill(renderer._process.pid, signal.SIGKILL)
    renderer._process.join(5)
    assert render(renderer, "{{ messages | length }}") == "3"


def test_cancelled_render_leaves_no_pending_reply(renderer):
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(renderer.render(NESTED, CONVERSATION, True, SPECIAL, {}), 0.2)
        return await renderer.render("{{ bos_token }}ok", CONVERSATION, True, SPECIAL, {})

    assert asyncio.run(main()) == "<s>ok"


def test_concurrent_renders_are_serialized(renderer):
    async def main():
        return await asyncio.gather(*(renderer.render("{{ n }}", CONVERSATION, True, SPECIAL, {"n": n})
                                      for n in range(8)))

    assert asyncio.run(main()) == [str(n) for n in range(8)]


def test_server_memory_did_not_grow(renderer, baseline_rss):
    render(renderer, CHATML)
    assert rss_bytes() - baseline_rss < 50 * 1024 * 1024
