"""Imported for its effect: under ``TRITON_INTERPRET=1``, a kernel launch patches ``triton.language``
once instead of at every helper call (the test suite's conftest, and the ranks' fork server:
``dist_utils.PRELOAD``)."""

from __future__ import annotations

import os


def _launch_patches_the_language_once():
    """Under the interpreter, Triton patches ``triton.language`` (``inspect.getmembers`` of four
    modules) at each kernel launch and again at each call of a ``@triton.jit`` helper inside the
    kernel, once per program instance: about a third of an interpreted test's time. Inside a launch
    the launch's patch already holds for every module a helper can see, so a helper's call reuses it
    (the same functions run; only the repeated patching is skipped). Left as it is where Triton's
    interpreter is not built the way this expects."""
    try:
        from triton.runtime import interpreter as interp
    except Exception:  # noqa: BLE001 - no Triton, or another one: nothing to speed up
        return
    executor = getattr(interp, "GridExecutor", None)
    patch_lang = getattr(interp, "_patch_lang", None)
    if executor is None or patch_lang is None or not hasattr(interp, "_LangPatchScope"):
        return
    grid_call = executor.__call__
    active: list[set] = []  # the launch in progress: ids of the modules its patch covers

    def _langs(fn):
        return {id(v) for v in fn.__globals__.values() if v is interp.tl or v is interp.tl.core}

    def patch_once(fn):
        if active and _langs(fn) <= active[-1]:
            return interp._LangPatchScope()  # (nothing to restore)
        scope = patch_lang(fn)
        if active:
            active[-1] |= _langs(fn)
        return scope

    def launch(self, *args, **kwargs):
        active.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            active.pop()

    interp._patch_lang = patch_once
    interp.GridExecutor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _launch_patches_the_language_once()
