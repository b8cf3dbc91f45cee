# The C functions of _asgi.c (frameworks/asgi.py holds their Python twins).
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

def traced_await(
    coroutine: Coroutine[Any, Any, Any],
    on_exit: Callable[[BaseException | None], object],
    /,
) -> Awaitable[Any]: ...
def traced_send(
    send: Callable[[Any], Awaitable[None]],
    span: object,
    clock: Callable[[], int],
    /,
) -> Callable[[Any], Awaitable[None]]: ...
